"""The round driver: everything a round is made of that is not a message, with no Flower inside.

A round protocol's server side (fedsim/server/exchange.py and its kin) asks the driver which
clients a round samples and what each one is told (`open_round`), hands it the update batch its
replies made (`aggregate`: server-side attack, defenses and rule in the pipeline, then the server
optimizer and the low-rank switch), and the Flower strategy (fedsim/server/strategy.py) only
connects the two. The driver also keeps what must survive a restart: the global model, the
pipeline's and optimizer's state, the backdoor report the evaluation follows; `checkpoint` writes
them each round and `resume_from` reads them back. The local-DP ledger and the schedule's "rounds
since attack" replay earlier rounds by re-sampling them (sampling is seeded per round), so a
resumed run counts exactly as an uninterrupted one.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from fedsim.aggregators.detox import consecutive_groups
from fedsim.attacks.schedules import sample_round
from fedsim.clock.clock import FederationClock
from fedsim.devices import deterministic_switches_on, resolve_device
from fedsim.lowrank.switch import LowRankSwitch
from fedsim.privacy.local import LocalPrivacyLedger
from fedsim.registry import MODELS
from fedsim.runs.checkpoint import save_server
from fedsim.runs.detection import round_detection
from fedsim.scenario import scenario_fingerprint
from fedsim.seeding import SAMPLE, SERVER, numpy_rng, torch_generator
from fedsim.server.evaluation import CentralEvaluator
from fedsim.server.leakage import PrivacyProbe
from fedsim.server.optimizer import ServerOptimizer
from fedsim.server.pipeline import RoundPipeline
from fedsim.server.record import UNSET, RoundRecord
from fedsim.server.tools import ServerTools
from fedsim.updates import RoundContext, UpdateBatch


LIST_UNAVAILABLE_UP_TO = 1000  # registered clients up to which a round line lists who was not checked in (else counts them)


@dataclass
class RoundPlan:
    """One round as the driver opened it: who trains, in which order, on which shard, told what."""

    round: int
    sampled: list[int]
    strikers: list[int]  # the sampled attackers that strike this round
    groups: list[list[int]] = field(default_factory=list)  # group rules (DETOX): the sampled clients' groups
    order: list[int] = field(default_factory=list)  # the order the messages go out in (largest first)
    configs: dict[int, dict] = field(default_factory=dict)  # client -> what its training message says


class SwitchingModel:
    """The global model as one flat vector, factorized once if the scenario's low-rank scheme says so;
    parameters the model's registry entry marks `replanted` are written back to their initial values
    after every server step (a malicious server re-planting Robbing the Fed's imprint block)."""

    def __init__(self, runtime) -> None:
        self.lowrank = LowRankSwitch(runtime, runtime.scenario.lowrank)
        self.vec = self.lowrank.start(runtime.initial_weights())
        spec = runtime.scenario.model
        replanted = MODELS.get(spec.name).traits.replanted
        layout = self.layout()
        self.planted = {name: self.vec[layout.slice(name)].clone() for name in (replanted(spec) if replanted else ())}

    def layout(self):
        return self.lowrank.layout()

    def module(self) -> torch.nn.Module:
        return self.lowrank.model(self.vec)

    def after_round(self, rnd: int) -> dict | None:
        """Re-plant, then factorize now if the scheme says so; returns the switch's report, else None."""
        if self.planted:
            layout, vec = self.layout(), self.vec.clone()
            for name, value in self.planted.items():
                if name not in layout.names:
                    raise ValueError(f"model: the re-planted parameter {name} is gone from the model (a low-rank switch "
                                     "factorized it); drop model.replant or the low-rank scheme")
                vec[layout.slice(name)] = value
            self.vec = vec
        self.vec, switch = self.lowrank.after_round(rnd, self.vec)
        return switch

    def config(self) -> dict:
        """What every training message must say about the model's shape."""
        return {"model-ranks": json.dumps(self.lowrank.ranks, sort_keys=True)} if self.lowrank.ranks else {}

    def state_dict(self) -> dict:
        return self.lowrank.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.lowrank.load_state_dict(state)


class RoundDriver:
    """Sampling, schedules, groups, message order, the DP ledger, the global model and its server
    step, checkpoints and resume: the parts of a round every protocol shares."""

    def __init__(self, runtime, checkpoint_to=None, largest_first: bool = True, update_pipeline: bool = True,
                 real_clock: bool = False, run_folder=None) -> None:
        self.rt, self.scenario = runtime, runtime.scenario
        if self.scenario.deterministic:  # process-wide, before the server's first CUDA use (docs/gpu.md)
            deterministic_switches_on()
        self.device = resolve_device(self.scenario.server.device, "server.device")  # the defenses' and rule's
        self.checkpoint_to = checkpoint_to  # the run folder whose checkpoint/ gets the server's state each round
        self.largest_first = largest_first
        self.offset = 0  # rounds completed before this start (a resumed run)
        # attack, defenses, rule (a protocol that builds the model otherwise, FedMA's matching, has none)
        self.pipeline = RoundPipeline(self.scenario, runtime.attack) if update_pipeline else None
        self.server_opt = ServerOptimizer(self.scenario.server)  # how the aggregate moves the global model
        self.model = SwitchingModel(runtime)
        self.tools = ServerTools(runtime, self.model.lowrank.model)  # the server's own data and training (FLTrust)
        self.evaluator = CentralEvaluator(runtime, reference=self.model.module())  # the clean initial model
        # the scenario's privacy attacks, on what the server saw (their image grids in `run_folder`/privacy)
        self.privacy = PrivacyProbe(runtime, run_folder, self.device) if self.scenario.privacy_attacks else None
        self.pending = RoundRecord(0)  # this round's facts, written when the round closes
        self.plan: RoundPlan | None = None
        self.started = time.perf_counter()  # when this round opened
        self.timing: dict[int, dict[str, float]] = {}  # round -> seconds spent per step (logged)
        # (attacker id, report) whose trigger this round's evaluation measures
        self.report: tuple[int, dict] | None = None
        self._last_attack_round: int | None = None  # see rounds_since_attack
        self._looked_back = False
        local_dp = self.scenario.federation.local_dp  # each client's own ε under local DP, counted here
        self.local_privacy = LocalPrivacyLedger(local_dp, self.scenario.federation.num_clients) if local_dp else None
        self._counted_round = 0  # the ledger holds rounds 1.._counted_round
        self.last_start_loss: float | None = None  # the last round's mean loss at its global model (AdaComm's F)
        # a protocol's own state beside the driver's (the asynchronous exchange's clients in flight):
        # `protocol_state()` is checkpointed each round, handed back as `resumed_protocol` on resume
        self.protocol_state: Callable[[], dict] | None = None
        self.resumed_protocol: dict | None = None
        systems = self.scenario.systems  # the federation clock (fedsim/clock/): devices, networks, availability
        # (none on the real clock of a deployment, where `systems:` may only choose an asynchronous round)
        self.clock = FederationClock(systems, self.scenario.federation.num_clients, runtime.attackers,
                                     self.scenario.seed) if systems is not None and not real_clock else None

    # --- the global model ------------------------------------------------------------------------
    @property
    def global_vec(self) -> torch.Tensor:
        return self.model.vec

    @global_vec.setter
    def global_vec(self, vec: torch.Tensor) -> None:
        self.model.vec = vec

    @property
    def layout(self):
        """The current model layout (it changes if the model is factorized or its layers grow)."""
        return self.model.layout()

    def global_model(self) -> torch.nn.Module:
        """The current global model as a module (what the server evaluates)."""
        return self.model.module()

    # --- opening a round -------------------------------------------------------------------------
    def sample(self, rnd: int) -> tuple[list[int], list[int]]:
        """This round's clients and, among them, the attackers that strike (seeded by the round).
        On the federation clock: among the clients checked in at the round's start, as many as
        the round policy selects (over-selection: more than clients_per_round)."""
        fed = self.scenario.federation
        rng = numpy_rng(self.scenario.seed, SAMPLE, rnd)
        population, per_round = np.arange(fed.num_clients), fed.clients_per_round
        if self.clock is not None:
            population = np.flatnonzero(self.clock.checked_in(rnd))
            per_round = min(self.scenario.systems.round.selected(per_round), len(population))
        if self.scenario.attack is not None:
            return sample_round(self.scenario.attack.schedule, rnd, population, per_round, self.rt.attackers, rng)
        # drawing positions in the population: for all clients the same draws as choice(num_clients)
        return sorted(population[rng.choice(len(population), per_round, replace=False)].tolist()), []

    def rounds_since_attack(self, rnd: int, attacked: bool) -> int | None:
        """Rounds since the last round with an attacker (0 now, None before any). The schedule is
        seeded per round, so after a resume the last attack round is found by sampling back."""
        if self._last_attack_round is None and rnd > 1 and not self._looked_back:
            self._looked_back = True
            self._last_attack_round = next((r for r in range(rnd - 1, 0, -1) if self.sample(r)[1]), None)
        if attacked:
            self._last_attack_round = rnd
        return None if self._last_attack_round is None else rnd - self._last_attack_round

    def groups(self, sampled: list[int]) -> tuple[list[list[int]], dict[int, int]]:
        """For group rules (DETOX): consecutive groups of r sampled clients and, with redundancy, the
        shard each member trains on (its group's first member's), so honest members of a group
        compute bit-identical updates."""
        if self.pipeline is None or not self.pipeline.needs_groups:
            return [], {}
        spec = self.scenario.aggregator
        groups = [[sampled[i] for i in g] for g in consecutive_groups(len(sampled), spec.group_size)]
        shard_of = {p: g[0] for g in groups for p in g} if spec.redundancy else {}
        return groups, shard_of

    def longest_first(self, sampled: list[int], shard_of: dict[int, int]) -> list[int]:
        """The sampled clients, largest partition first (ties by id): the order the messages are created
        and so delivered in. The simulation's actors take messages in that order as they free up, so
        the largest jobs start first and the round does not end with one actor training a big client
        while the others idle (longest-processing-time-first scheduling). Results do not depend on it:
        updates are aggregated in partition-id order."""
        if not self.largest_first:
            return list(sampled)
        parts = self.rt.partitions
        return sorted(sampled, key=lambda p: (-len(parts[shard_of.get(p, p)]), p))

    def open_round(self, rnd: int) -> RoundPlan:
        """Sample round `rnd`, decide every client's instructions and start its record."""
        self.started = time.perf_counter()
        self.report = None
        sampled, strikers = self.sample(rnd)
        attack = self.rt.attack
        client_strikers = strikers if attack is not None and attack.side == "client" else []
        groups, shard_of = self.groups(sampled)
        gone = self.clock.dropouts(rnd, sampled) if self.clock is not None else []  # never answer: not messaged
        plan = RoundPlan(rnd, sampled, strikers, groups, self.longest_first([p for p in sampled if p not in gone], shard_of))
        if client_strikers:  # what Attack of the Tails' replacement attacker is assumed to know
            total_examples = sum(self.rt.client_size(p, attacking=p in strikers) for p in sampled)
        shape = self.model.config()
        period = self.clock.local_period(rnd, self.last_start_loss, self.rt.lr(rnd)) if self.clock is not None else None
        if period is not None:  # AdaComm: this round's local steps
            shape = {**shape, "local-steps": period}
        for pid in plan.order:
            cfg = {"server-round": rnd, "lr": self.rt.lr(rnd), **shape}
            if pid in shard_of:
                cfg["data-partition"] = shard_of[pid]
            if pid in client_strikers:
                cfg["round_total_examples"] = total_examples
            plan.configs[pid] = cfg
        self.pending = RoundRecord(rnd, sampled, strikers)
        if self.clock is not None:
            away = np.flatnonzero(~self.clock.checked_in(rnd))
            self.pending.update({"sim_start": self.clock.start_of(rnd), "dropped_out": gone, "unavailable": len(away)})
            if self.scenario.federation.num_clients <= LIST_UNAVAILABLE_UP_TO:
                self.pending.unavailable_clients = away.tolist()
            if period is not None:
                self.pending.local_steps = period
        if groups:
            self.pending.groups = groups
        if self.scenario.attack is not None:
            self.pending.rounds_since_attack = self.rounds_since_attack(rnd, bool(strikers))
        if self.local_privacy is not None:
            for earlier in range(self._counted_round + 1, rnd):  # sampling is seeded per round: replayable
                self.local_privacy.count(self.sample(earlier)[0])
            self.local_privacy.count(sampled)
            self._counted_round = rnd
            self.pending.local_privacy = self.local_privacy.report()
        self.plan = plan
        return plan

    def take_backdoor_report(self, pid: int, shared: dict | None) -> None:
        """An attacker's report of the trigger it planted: the backdoor is measured with the report of
        the round's attacker with the lowest id (deterministic whatever the arrival order)."""
        if shared is not None and (self.report is None or pid < self.report[0]):
            self.report = (pid, shared)

    # --- closing a round's aggregation -----------------------------------------------------------
    def run_pipeline(self, batch: UpdateBatch, strikers: set, groups, reference: UpdateBatch | None = None):
        """The round's pipeline (attack, defenses, rule) on `server.device`, timed into the pending
        round's record with its defenses' reports; the global model stays on CPU. Returns the batch as
        the pipeline saw it (on that device) and the outcome."""
        if self.device.type != "cpu":
            batch = UpdateBatch(batch.updates.to(self.device), batch.weights.to(self.device), batch.client_ids)
        rnd = self.pending.round
        ctx = RoundContext(rnd, self.global_vec.to(self.device), self.layout,
                           torch_generator(self.scenario.seed, SERVER, rnd), tools=self.tools)
        started = time.perf_counter()
        outcome = self.pipeline.run(batch, strikers, ctx, groups, reference)
        self.pending.pipeline_seconds = time.perf_counter() - started
        self.pending.defenses = outcome.defenses
        return batch, outcome

    def aggregate(self, batch: UpdateBatch, strikers: set[int], groups=None, audit: bool = True, scale: float = 1.0,
                  reference: UpdateBatch | None = None) -> bool:
        """Run the pipeline on the round's batch and step the global model with its aggregate; what
        happened goes into the pending record. `audit`: the rows are clients' own updates (the
        detection audit means something); under secure aggregation they are group sums. `scale`
        multiplies the aggregate before the server step (FedAsync's α·s(staleness)); `reference`
        goes to the pipeline (the honest rows a server-side attack crafts from).
        Returns whether the round was aggregated (False: skipped, with the reason recorded)."""
        record = self.pending
        batch, outcome = self.run_pipeline(batch, strikers, groups, reference)
        if outcome.attack is not None:  # the attackers' norms are those of the updates the attack crafted
            crafted = outcome.attack.pop("norms")
            record.attacker_update_norms = {**record.attacker_update_norms, **crafted}
            record.attack = outcome.attack
        if outcome.aggregator is not None:
            record.aggregator = outcome.aggregator
        if audit:
            record.detection = round_detection(list(batch.client_ids), strikers, outcome.aggregated, outcome.aggregator,
                                               outcome.defenses, outcome.weights)
        if self.privacy is not None:
            self.probe_privacy(batch, strikers, audit, outcome)
        if outcome.skipped is not None:
            record.skipped = outcome.skipped
            return False
        if audit:
            record.aggregated = outcome.aggregated
        aggregate = outcome.aggregate.cpu() if scale == 1.0 else scale * outcome.aggregate.cpu()
        self.global_vec = self.server_opt.step(self.global_vec, aggregate, record.round)
        record.global_norm = float(torch.linalg.vector_norm(self.global_vec))
        switch = self.model.after_round(record.round)
        if switch is not None:  # the model was factorized: last round's aggregate no longer fits it
            record.lowrank = switch
            self.pipeline.previous_aggregate = None
        record.model_params = self.layout.dim
        if self.privacy is not None:
            self.add_privacy(*self.privacy.after_step(record.round, self.global_model, self.trained_honest))
        if record.start_loss is not UNSET and record.start_loss is not None:
            self.last_start_loss = record.start_loss
        return True

    def probe_privacy(self, batch: UpdateBatch, strikers: set[int], individual: bool, outcome) -> None:
        """The scenario's inversion attacks on this round's decoded uploads and its aggregate,
        before the global model steps (the model the clients trained from is still the global one)."""
        record = self.pending
        if individual:
            contributors = list(outcome.aggregated)
        else:  # secure rows are group sums: whose data is in them is the protocol's record
            contributors = list((record.secure_aggregation or {}).get("summed", [])) \
                if record.secure_aggregation is not UNSET else list(outcome.aggregated)
        examples = sum((outcome.weights or {}).values())
        self.add_privacy(*self.privacy.after_pipeline(
            record.round, batch, strikers | set(record.attackers), individual, self.global_model, self.layout,
            self.global_vec, outcome.aggregate, contributors, examples))

    def trained_honest(self, rnd: int) -> list[int]:
        """The honest clients sampled in some round up to `rnd` (sampling is seeded per round): whose
        examples a membership game counts as members."""
        attackers = set(self.rt.attackers)
        return sorted({p for r in range(1, rnd + 1) for p in self.sample(r)[0] if p not in attackers})

    def add_privacy(self, lines: list[dict], seconds: dict) -> None:
        if not lines:
            return
        record = self.pending
        record.privacy_attack = [*(record.privacy_attack if record.privacy_attack is not UNSET else []), *lines]
        record.privacy_attack_seconds = {**(record.privacy_attack_seconds if record.privacy_attack_seconds is not UNSET
                                            else {}), **seconds}

    # --- what survives a restart -----------------------------------------------------------------
    def checkpoint(self, rnd: int) -> None:
        if self.checkpoint_to is None:
            return
        extra = {**self.model.state_dict(), "server_optimizer": self.server_opt.state_dict()}
        if self.pipeline is not None:
            extra["pipeline"] = self.pipeline.history()
        if self.clock is not None:
            extra["clock"] = {**self.clock.state_dict(), "last_start_loss": self.last_start_loss}
        if self.protocol_state is not None:
            extra["protocol"] = self.protocol_state()
        if self.evaluator.shared is not None:  # the trigger the backdoor is measured with
            extra["backdoor_report"] = {k: torch.from_numpy(np.array(v)) for k, v in self.evaluator.shared.items()}
        defenses = self.pipeline.state_dict() if self.pipeline is not None else {}
        save_server(self.checkpoint_to, rnd, self.global_vec, defenses, extra, scenario_fingerprint(self.scenario))

    def resume_from(self, state: dict) -> None:
        """Continue after the checkpointed round: its global model, defense and optimizer states."""
        self.offset = int(state["round"])
        extra = state.get("extra", {})
        self.model.load_state_dict(extra)
        if self.pipeline is not None:
            self.pipeline.load_history(extra.get("pipeline", {}))
            self.pipeline.load_state_dict(state["defenses"])
        self.server_opt.load_state_dict(extra.get("server_optimizer", {}))
        self.global_vec = state["global"].clone()
        self.resumed_protocol = extra.get("protocol")
        if self.clock is not None and "clock" in extra:
            self.clock.load_state_dict(extra["clock"])
            self.last_start_loss = extra["clock"].get("last_start_loss")
        shared = extra.get("backdoor_report")
        if shared:
            self.evaluator.use_shared({k: v.numpy() for k, v in shared.items()})
