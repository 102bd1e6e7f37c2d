"""ScenarioStrategy: a Flower Message-API strategy driven by the scenario.

Per round: sample clients with a seeded RNG (attack schedule included), send the global model,
decode and check every upload (untrusted input), let server-side attacks replace the malicious
rows, apply the defenses and the aggregator to the stacked `[n, d]` updates, and record what
happened. Flower's own `Strategy.start` runs the round loop; the centralized `evaluate_fn` closes
each round by evaluating the global model and appending the round's line to `rounds.jsonl`.

With `evaluation.overlap` the central evaluation of round t runs in a background thread while
round t+1 trains (torch releases the GIL, so spare cores evaluate while the clients train), at most
one round behind: lines are written in round order, round t's checkpoint is saved before its line,
and the last round's evaluation finishes before the run ends. Per-round timings (encode, waiting
for clients, decode, aggregation, evaluation) go to the `fedsim.timing` logger, not to rounds.jsonl,
whose lines stay identical from run to run except `wall_seconds`.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Callable, Iterable

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fedsim.attacks.schedules import sample_round
from fedsim.runs.checkpoint import save_server
from fedsim.runs.folder import RunFolder
from fedsim.compression.base import PayloadError
from fedsim.devices import deterministic_switches_on, resolve_device
from fedsim.engine.options import EngineOptions
from fedsim.lowrank.switch import LowRankSwitch
from fedsim.privacy.local import LocalPrivacyLedger
from fedsim.server.evaluation import CentralEvaluator
from fedsim.server.detection import round_detection
from fedsim.server.optimizer import ServerOptimizer
from fedsim.server.pipeline import RoundPipeline, update_norms
from fedsim.server.record import RoundRecord
from fedsim.server.tools import ServerTools
from fedsim.seeding import SAMPLE, SERVER, numpy_rng, torch_generator
from fedsim.updates import RoundContext, UpdateBatch
from fedsim.wire import attacker_train_seconds, decode_upload, message_bytes, pack_model, records_bytes, shared_backdoor_state

log = logging.getLogger("fedsim")
timing_log = logging.getLogger("fedsim.timing")  # one INFO record per round, the seconds in `record.fedsim_timing`


class ReplyOwners:
    """Which client a reply belongs to: the client of the message it answers (`reply_to_message_id`).

    Not its `src_node_id`: a SuperLink answers for a node it has marked offline with an error reply
    from its own node id, which would put the failure under a client that does not exist and leave
    the dead client with a false timeout. The grid gives each message its id when it pushes it, so
    the map is read after sending. A reply whose message id is unknown (a grid that sets none)
    falls back to its source node."""

    def __init__(self, sent: list[tuple[Message, int]], node_of: dict[int, int]) -> None:
        self.sent = sent
        self.node_pid = {node: pid for pid, node in node_of.items()}
        self._by_id: dict[str, int] | None = None

    def __call__(self, reply: Message) -> int:
        if self._by_id is None:
            self._by_id = {m.metadata.message_id: pid for m, pid in self.sent if m.metadata.message_id}
        pid = self._by_id.get(reply.metadata.reply_to_message_id)
        return pid if pid is not None else self.node_pid.get(reply.metadata.src_node_id, -1)


class Background:
    """One call in its own (non-daemon) thread; `result()` joins it and re-raises its error.

    A thread per round rather than a pool: nothing is left running when a run stops halfway, and
    the interpreter still waits for a line being evaluated before it exits.
    """

    def __init__(self, fn: Callable, args: tuple) -> None:
        self.value, self.error = None, None
        self.thread = threading.Thread(target=self._run, args=(fn, args), name="fedsim-evaluation")
        self.thread.start()

    def _run(self, fn: Callable, args: tuple) -> None:
        try:
            self.value = fn(*args)
        except BaseException as err:  # handed to whoever waits for the result
            self.error = err

    def result(self):
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.value


class ScenarioStrategy(Strategy):
    def __init__(
        self, runtime, on_round: Callable[[dict], None] | None = None, checkpoint_to: RunFolder | None = None,
        options: EngineOptions = EngineOptions(), node_map: Callable | None = None, defer_last_round: bool = False,
    ) -> None:
        self.options = options  # how fast, never what: see fedsim/engine/options.py
        self.node_map = node_map  # fedsim's simulation: (grid, timeout) -> {partition id: node id} (see discover_nodes)
        self.defer_last_round = defer_last_round  # evaluate the last round in the background too (see drive_server)
        self.rt = runtime
        if runtime.scenario.deterministic:  # process-wide, before the server's first CUDA use (docs/gpu.md)
            deterministic_switches_on()
        self.device = resolve_device(runtime.scenario.server.device, "server.device")  # the defenses' and rule's
        self.checkpoint_to = checkpoint_to  # the run folder whose checkpoint/ gets the server's state each round
        self.offset = 0  # rounds already completed before this start (a resumed run)
        self.scenario = runtime.scenario
        self.on_round = on_round or (lambda record: None)
        self.pipeline = RoundPipeline(self.scenario, runtime.attack)  # attack, defenses, rule: no Flower inside
        self.server_opt = ServerOptimizer(self.scenario.server)  # how the aggregate moves the global model
        self.node_of: dict[int, int] = {}  # partition id -> node id
        self.lowrank = LowRankSwitch(runtime, self.scenario.lowrank)
        self.global_vec = self.lowrank.start(runtime.initial_weights())
        self.tools = ServerTools(runtime, self.lowrank.model)  # the server's own data and training (FLTrust)
        self.evaluator = CentralEvaluator(runtime, reference=self.lowrank.model(self.global_vec))  # the clean initial model
        self.pending = RoundRecord(0)  # this round's facts, written when the round closes
        self.t_round = time.perf_counter()
        self._owner = ReplyOwners([], {})  # this round's messages: whose is each reply
        # (attacker id, report) whose trigger this round's evaluation measures; handed to the evaluator
        # once the previous round's evaluation (maybe still running beside this round) is done
        self._report: tuple[int, dict] | None = None
        self._last_attack_round: int | None = None  # see rounds_since_attack
        self._looked_back = False
        self._timing: dict[int, dict[str, float]] = {}  # round -> seconds spent per step (logged)
        local_dp = self.scenario.federation.local_dp  # each client's own ε under local DP, counted here
        self.local_privacy = LocalPrivacyLedger(local_dp, self.scenario.federation.num_clients) if local_dp else None
        self._counted_round = 0  # the ledger holds rounds 1.._counted_round (a resumed run catches up by re-sampling)
        self._sent_at = self.t_round  # when this round's messages were handed to Flower
        self._closing: Background | None = None  # the previous round's evaluation and line, if still running
        self._line_at: float | None = None  # when the last round line of this run was written
        # torch threads of an evaluation in line: the process's count now. Set explicitly wherever
        # an evaluation runs: torch's count is per thread, but a thread's first parallel op (and,
        # measured, some later ones) picks up the count last set by *any* thread, e.g. 1 by an
        # evaluation beside training.
        self._inline_threads = torch.get_num_threads()

    def global_model(self) -> torch.nn.Module:
        """The current global model as a module (what the server evaluates)."""
        return self.lowrank.model(self.global_vec)

    @property
    def layout(self):
        """The current model layout (it changes once, if the model is factorized mid-run)."""
        return self.lowrank.layout()

    # --- set-up -------------------------------------------------------------------------------
    def discover_nodes(self, grid: Grid, timeout: float) -> None:
        """Map partition ids to node ids: node ids are random per run, partition ids are what the scenario names.

        Each node is asked for its partition id (a QUERY message), as a deployment must. Inside
        fedsim's own simulation the engine's map is known where Flower registers the nodes
        (fedsim/engine/simulate.py, handed in as `node_map`), which saves one message per registered
        client at start-up.
        """
        expected = self.scenario.federation.num_clients
        known = self._simulation_nodes(grid, timeout)
        if known is not None:
            if sorted(known) != list(range(expected)):
                raise RuntimeError(f"the simulation registered partitions {sorted(known)[:10]}..., expected 0..{expected - 1}")
            self.node_of = dict(known)
            return
        deadline = time.monotonic() + timeout
        nodes = list(grid.get_node_ids())
        while len(nodes) < expected:
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {len(nodes)} of {expected} client nodes connected within {timeout:.0f}s")
            time.sleep(0.2)
            nodes = list(grid.get_node_ids())
        queries = [
            Message(RecordDict({"config": ConfigRecord({})}), dst_node_id=n, message_type=MessageType.QUERY)
            for n in nodes
        ]
        for reply in grid.send_and_receive(queries, timeout=timeout):
            if reply.has_error():
                raise RuntimeError(f"node {reply.metadata.src_node_id} failed to report its partition: {reply.error.reason}")
            pid = int(reply.content["info"]["partition-id"])
            if pid in self.node_of:
                raise RuntimeError(f"two nodes report partition-id {pid}")
            self.node_of[pid] = reply.metadata.src_node_id
        missing = sorted(set(range(expected)) - set(self.node_of))
        if missing:
            raise RuntimeError(f"no node holds partitions {missing[:10]}{'...' if len(missing) > 10 else ''}")

    def _simulation_nodes(self, grid: Grid, timeout: float) -> dict[int, int] | None:
        """{partition id: node id} as fedsim's simulation engine registered them, or None elsewhere."""
        if self.node_map is None:
            return None
        return self.node_map(getattr(grid, "inner", grid), timeout)  # StoppableGrid wraps the engine's grid

    # --- training round -----------------------------------------------------------------------
    def resume_from(self, state: dict) -> None:
        """Continue after the checkpointed round: its global model and defense states."""
        self.offset = int(state["round"])
        self.lowrank.load_state_dict(state.get("extra", {}))
        self.pipeline.load_history(state.get("extra", {}).get("pipeline", {}))
        self.server_opt.load_state_dict(state.get("extra", {}).get("server_optimizer", {}))
        self.global_vec = state["global"].clone()
        self.pipeline.load_state_dict(state["defenses"])
        shared = state.get("extra", {}).get("backdoor_report")
        if shared:
            self.evaluator.use_shared({k: v.numpy() for k, v in shared.items()})

    def checkpoint(self, rnd: int) -> None:
        if self.checkpoint_to is not None:
            extra = {**self.lowrank.state_dict(), "pipeline": self.pipeline.history(), "server_optimizer": self.server_opt.state_dict()}
            if self.evaluator.shared is not None:  # the trigger the backdoor is measured with
                extra["backdoor_report"] = {k: torch.from_numpy(np.array(v)) for k, v in self.evaluator.shared.items()}
            save_server(self.checkpoint_to, rnd, self.global_vec, self.pipeline.state_dict(), extra)

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        server_round += self.offset
        self.t_round = time.perf_counter()
        sampled, strikers = self.sample(server_round)
        client_strikers = strikers if self.rt.attack is not None and self.rt.attack.side == "client" else []
        if client_strikers:  # what Attack of the Tails' replacement attacker is assumed to know
            total_examples = sum(self.rt.client_size(p, attacking=p in strikers) for p in sampled)
        model_record = pack_model(self.global_vec, self.layout)
        model_bytes = records_bytes({"arrays": model_record})  # the same model goes to everyone: size it once
        groups, shard_of = self._groups(sampled)
        sent, down, down_per_client = [], 0, {}
        for pid in self.longest_first(sampled, shard_of):
            cfg = {"server-round": server_round, "lr": self.rt.lr(server_round)}
            if self.lowrank.ranks:
                cfg["model-ranks"] = json.dumps(self.lowrank.ranks, sort_keys=True)
            if pid in shard_of:
                cfg["data-partition"] = shard_of[pid]
            if pid in client_strikers:
                cfg["round_total_examples"] = total_examples
            config_record = ConfigRecord(cfg)
            msg = Message(
                RecordDict({"arrays": model_record, "config": config_record}),
                dst_node_id=self.node_of[pid],
                message_type=MessageType.TRAIN,
            )
            size = model_bytes + records_bytes({"config": config_record})
            down += size
            down_per_client[pid] = size
            sent.append((msg, pid))
        self._owner = ReplyOwners(sent, self.node_of)
        self.pending = RoundRecord(server_round, sampled, strikers, bytes_down=down, bytes_down_per_client=down_per_client)
        if groups:
            self.pending.groups = groups
        if self.scenario.attack is not None:
            self.pending.rounds_since_attack = self.rounds_since_attack(server_round, bool(strikers))
        if self.local_privacy is not None:
            for earlier in range(self._counted_round + 1, server_round):  # sampling is seeded per round: replayable
                self.local_privacy.count(self.sample(earlier)[0])
            self.local_privacy.count(sampled)
            self._counted_round = server_round
            self.pending.local_privacy = self.local_privacy.report()
        self._sent_at = time.perf_counter()
        self._timing[server_round] = {"encode": self._sent_at - self.t_round}
        return [msg for msg, _ in sent]

    def rounds_since_attack(self, server_round: int, attacked: bool) -> int | None:
        """Rounds since the last round with an attacker (0 now, None before any). The schedule is
        seeded per round, so after a resume the last attack round is found by sampling back."""
        if self._last_attack_round is None and server_round > 1 and not self._looked_back:
            self._looked_back = True
            self._last_attack_round = next((r for r in range(server_round - 1, 0, -1) if self.sample(r)[1]), None)
        if attacked:
            self._last_attack_round = server_round
        return None if self._last_attack_round is None else server_round - self._last_attack_round

    def longest_first(self, sampled: list[int], shard_of: dict[int, int]) -> list[int]:
        """The sampled clients, largest partition first (ties by id): the order the messages are created
        and so delivered in. The simulation's actors take messages in that order as they free up, so
        the largest jobs start first and the round does not end with one actor training a big client
        while the others idle (longest-processing-time-first scheduling). Results do not depend on it:
        updates are aggregated in partition-id order."""
        if not self.options.largest_first:
            return list(sampled)
        parts = self.rt.partitions
        return sorted(sampled, key=lambda p: (-len(parts[shard_of.get(p, p)]), p))

    def sample(self, server_round: int) -> tuple[list[int], list[int]]:
        """This round's clients and, among them, the attackers that strike (seeded by the round)."""
        fed = self.scenario.federation
        rng = numpy_rng(self.scenario.seed, SAMPLE, server_round)
        attack = self.scenario.attack
        if attack is not None:
            return sample_round(attack.schedule, server_round, fed.num_clients, fed.clients_per_round, self.rt.attackers, rng)
        return sorted(rng.choice(fed.num_clients, fed.clients_per_round, replace=False).tolist()), []

    def _groups(self, sampled: list[int]) -> tuple[list[list[int]], dict[int, int]]:
        """For group-based rules (DETOX): consecutive groups of r sampled clients and, with
        redundancy, the shard each member trains on (its group's first member's), so honest
        members of a group compute bit-identical updates."""
        spec = self.scenario.aggregator
        if not self.pipeline.needs_groups:
            return [], {}
        r = spec.group_size
        starts = list(range(0, max(len(sampled) - r + 1, 1), r))
        groups = [sampled[s : s + r] for s in starts]
        groups[-1] = sampled[starts[-1] :]  # the last group absorbs the leftovers
        shard_of = {p: g[0] for g in groups for p in g} if spec.redundancy else {}
        return groups, shard_of

    def _decode(self, replies: Iterable[Message]) -> tuple[list, dict, int, dict]:
        """Accepted (pid, update, weight) rows sorted by partition id, rejections with reasons, upload bytes."""
        rows, rejected, up, losses = [], {}, 0, {}
        up_per_client = self.pending.bytes_up_per_client = {}
        train_seconds = {}
        for reply in replies:
            pid = self._owner(reply)
            if reply.has_error():
                rejected[pid] = f"client error: {reply.error.reason}"
                continue
            try:
                size = message_bytes(reply)
                up += size
                up_per_client[pid] = size
                update, weight, loss = decode_upload(reply.content, self.rt.codec, self.layout)
            except PayloadError as err:
                rejected[pid] = str(err)
                log.warning("round %s: rejected upload from client %s: %s", self.pending.round, pid, err)
                continue
            losses[pid] = loss
            rows.append((pid, update, weight))
            if pid in self.pending.attackers:
                self._take_backdoor_report(pid, reply)
                seconds = attacker_train_seconds(reply.content)
                if seconds is not None:
                    train_seconds[pid] = seconds
        rows.sort(key=lambda r: r[0])  # aggregation independent of arrival order
        if train_seconds:
            self.pending.attacker_train_seconds = dict(sorted(train_seconds.items()))
        return rows, rejected, up, losses

    def _take_backdoor_report(self, pid: int, reply: Message) -> None:
        """An attacker's report of the trigger it planted: the backdoor is measured with the report of
        the round's attacker with the lowest id (deterministic whatever the arrival order)."""
        try:
            shared = shared_backdoor_state(reply.content, self.layout)
        except PayloadError as err:
            log.warning("round %s: ignored the backdoor report of attacker %s: %s", self.pending.round, pid, err)
            return
        if shared is not None and (self._report is None or pid < self._report[0]):
            self._report = (pid, shared)

    def run_pipeline(self, batch: UpdateBatch, strikers: set, server_round: int, groups):
        """The round's pipeline (attack, defenses, rule) on `server.device`, timed into the pending
        round's record with its defenses' reports; the global model stays on CPU. Returns the batch as
        the pipeline saw it (on that device) and the outcome."""
        if self.device.type != "cpu":
            batch = UpdateBatch(batch.updates.to(self.device), batch.weights.to(self.device), batch.client_ids)
        ctx = RoundContext(server_round, self.global_vec.to(self.device), self.layout,
                           torch_generator(self.scenario.seed, SERVER, server_round), tools=self.tools)
        started = time.perf_counter()
        outcome = self.pipeline.run(batch, strikers, ctx, groups)
        self.pending.pipeline_seconds = time.perf_counter() - started
        self.pending.defenses = outcome.defenses
        return batch, outcome

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        server_round += self.offset
        t_start = time.perf_counter()
        timing = self._timing.setdefault(server_round, {})
        timing["waiting_for_clients"] = t_start - self._sent_at
        replies = list(replies)
        self._report = None
        rows, rejected, up, losses = self._decode(replies)
        timing["decode"] = time.perf_counter() - t_start
        record = self.pending
        answered = {self._owner(m) for m in replies}
        for pid in record.sampled:
            if pid not in answered:  # a node that died or timed out: the round goes on without it
                rejected[pid] = f"no reply within federation.round_timeout={self.scenario.federation.round_timeout}s"
        record.update({"bytes_up": up, "rejected": rejected, "defenses": {}, "skipped": None})
        record.train_loss = (sum(losses[p] for p in sorted(losses)) / len(losses)) if losses else None
        strikers = set(record.attackers)
        batch = UpdateBatch(
            torch.stack([u for _, u, _ in rows]) if rows else torch.zeros(0, self.layout.dim),
            torch.tensor([w for _, _, w in rows], dtype=torch.float32),
            tuple(pid for pid, _, _ in rows),
        )
        record.attacker_update_norms, record.honest_update_norm_median = update_norms(batch, strikers)
        if len(rows) < self.scenario.federation.min_replies:
            record.skipped = f"{len(rows)} valid updates, fewer than federation.min_replies={self.scenario.federation.min_replies}"
            log.warning("round %s skipped: %s", server_round, record.skipped)
            return None, None
        batch, outcome = self.run_pipeline(batch, strikers, server_round, record.groups or None)
        if outcome.attack is not None:  # the attackers' norms are those of the updates the attack crafted
            crafted = outcome.attack.pop("norms")
            record.attacker_update_norms = {**record.attacker_update_norms, **crafted}
            record.attack = outcome.attack
        if outcome.aggregator is not None:
            record.aggregator = outcome.aggregator
        record.detection = round_detection(list(batch.client_ids), strikers, outcome.aggregated, outcome.aggregator,
                                           outcome.defenses, outcome.weights)
        if outcome.skipped is not None:
            record.skipped = outcome.skipped
            log.warning("round %s skipped: %s", server_round, outcome.skipped)
            return None, None
        record.aggregated = outcome.aggregated
        self.global_vec = self.server_opt.step(self.global_vec, outcome.aggregate.cpu(), server_round)
        record.global_norm = float(torch.linalg.vector_norm(self.global_vec))
        self.global_vec, switch = self.lowrank.after_round(server_round, self.global_vec)
        if switch is not None:  # the model was factorized: last round's aggregate no longer fits it
            record.lowrank = switch
            self.pipeline.previous_aggregate = None
        record.model_params = self.layout.dim
        arrays = pack_model(self.global_vec, self.layout)
        timing["aggregate"] = time.perf_counter() - t_start - timing["decode"]
        return arrays, MetricRecord({"num-updates": len(rows)})

    # --- no federated evaluation: the server evaluates centrally ------------------------------
    def configure_evaluate(self, server_round, arrays, config, grid):
        return []

    def aggregate_evaluate(self, server_round, replies):
        return None

    def summary(self) -> None:
        log.info("ScenarioStrategy: %s, aggregator %s, defenses %s", self.scenario.name, self.scenario.aggregator.name,
                 self.pipeline.defense_names)

    # --- end of round: central evaluation and the round's line --------------------------------
    def end_round(self, server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        """Checkpoint the round, then evaluate the global model and write the round's line.

        With `evaluation.overlap` the evaluation and the line are handed to a background thread
        and the next round starts at once; before that, the previous round's line is waited for,
        so lines stay in order and at most one evaluation runs beside training (the two newest
        checkpoints kept on disk then always include one whose line is written). The last round
        is closed before returning, so the run ends with every line written.
        """
        if server_round == 0 and self.offset:
            return None  # a resumed run: round 0 was evaluated the first time
        server_round += self.offset
        ev = self.scenario.evaluation
        last = server_round == self.scenario.federation.rounds
        if server_round == 0:
            if not ev.initial:
                return None
            record = RoundRecord(0)
        else:
            record = self.pending
        timing = self._timing.pop(server_round, {})
        t_wait = time.perf_counter()
        self._wait_for_previous_round()
        timing["evaluation_wait"] = time.perf_counter() - t_wait
        if self._report is not None:
            self.evaluator.use_shared(self._report[1])
            self._report = None
        if server_round:
            self.checkpoint(server_round)  # before the line: a written line always has its checkpoint
        evaluate = server_round == 0 or server_round % ev.every == 0 or last
        model = self.global_model() if evaluate else None  # a snapshot: the next round replaces global_vec
        close = (server_round, record, model, timing, self.t_round)
        overlap = ev.overlap if self.options.overlap_evaluation is None else self.options.overlap_evaluation
        if overlap and (not last or self.defer_last_round):
            # beside the next round: one thread by default (the client actors have the cores);
            # the last round's, deferred past the engine's shutdown: as many as in line
            threads = ev.threads or (self._inline_threads if last else 1)
            self._closing = Background(self._close_round_in_background, (threads, *close))
            return None
        threads = torch.get_num_threads()
        torch.set_num_threads(ev.threads or self._inline_threads)
        try:
            return self._close_round(*close)
        finally:
            torch.set_num_threads(threads)

    def _close_round_in_background(self, threads: int, *close) -> MetricRecord:
        # A multi-threaded evaluation beside the client actors only oversubscribes the cores they
        # already fill (measured in docs/performance.md); set here, in this thread (see _inline_threads).
        torch.set_num_threads(threads)
        return self._close_round(*close)

    def wait_for_lines(self) -> None:
        """Block until every round's line is written (the last evaluation may still be running)."""
        self._wait_for_previous_round()

    def _wait_for_previous_round(self) -> None:
        """Block until the previous round's line is written; re-raise its error, if any."""
        closing, self._closing = self._closing, None
        if closing is not None:
            closing.result()

    def _close_round(self, server_round: int, record: RoundRecord, model, timing: dict, started: float) -> MetricRecord:
        """Evaluate (if `model` is given), then write the round's line; runs in the background thread
        or, for the last round and without overlap, in the server thread."""
        if model is not None:
            t_eval = time.perf_counter()
            record.update(self.evaluator(model, server_round))
            timing["evaluate"] = time.perf_counter() - t_eval
        now = time.perf_counter()
        if server_round:
            # seconds since the previous round's line (the round's own start for the first one):
            # with overlapping evaluation, the rounds' wall_seconds add up to the run's time in rounds
            record.wall_seconds = now - (self._line_at if self._line_at is not None else started)
            self._line_at = now
        else:
            record.wall_seconds = 0.0
        line = record.to_json()
        self.on_round(line)
        timing["wall"] = record.wall_seconds
        timing_log.info("round %s timing (s): %s", server_round, ", ".join(f"{k} {v:.3f}" for k, v in timing.items()),
                 extra={"fedsim_round": server_round, "fedsim_timing": dict(timing)})
        metrics = {k: v for k, v in line.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        return MetricRecord(metrics)
