"""What the server does with one round's decoded updates, with no Flower in sight:

    server-side attack -> each defense's `before` -> the aggregation rule -> each defense's `after`

Pure apart from the defenses' own state (FoolsGold's history, ...) and a stateful server-side
attack's (mimic's direction estimate), which it holds and checkpoints. A round protocol's
exchange (fedsim/server/exchange.py) decodes the replies into an `UpdateBatch`; the round driver
(fedsim/server/driver.py) calls `RoundPipeline.run` and writes the `RoundOutcome` into the
round's record. Tests and benchmarks call it directly on tensors.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from fedsim.aggregators.base import AggregationError, call_rule
from fedsim.server.buffers import BufferRows
from fedsim.registry import AGGREGATORS, ATTACKS, DEFENSES
from fedsim.updates import RoundContext, UpdateBatch

log = logging.getLogger("fedsim")


def rows_to_clients(info: dict, client_ids: tuple[int, ...]) -> dict:
    """An aggregator's report with row indices replaced by client ids (for rounds.jsonl)."""
    def ids(rows):
        return [client_ids[i] for i in rows]

    out = dict(info)
    if "per_row" in out:  # a rule's per-row numbers (FLTrust's trust): {name: {client id: value}}
        out["per_row"] = {name: dict(zip(client_ids, values)) for name, values in out["per_row"].items()}
    for key in ("selected", "outvoted"):
        if key in out:
            out[key] = ids(out[key])
    if "voters" in out:
        out["voters"] = [ids(v) for v in out["voters"]]
    if "dropped" in out:
        out["dropped"] = [{**d, "members": ids(d["members"])} for d in out["dropped"]]
    return out


def update_norms(batch: UpdateBatch, strikers: set[int]) -> tuple[dict[int, float], float | None]:
    """Each attacker's update norm and the median honest norm (what a norm defense sees)."""
    norms = torch.linalg.vector_norm(batch.updates, dim=1).tolist() if len(batch.client_ids) else []
    by_client = dict(zip(batch.client_ids, norms))
    honest = sorted(v for pid, v in by_client.items() if pid not in strikers)
    attackers = {pid: v for pid, v in by_client.items() if pid in strikers}
    return attackers, (float(np.median(honest)) if honest else None)


def make_defense(spec, scenario):
    """A defense instance; one registered `with_federation=True` is also given the federation
    section (DP-FedAvg: its sampling rate, noise denominator and default δ)."""
    entry = DEFENSES.get(spec.name)
    if entry.traits.with_federation:
        return entry.obj(spec, federation=scenario.federation)
    return entry.obj(spec)


@dataclass
class RoundOutcome:
    """What the pipeline made of a round: the aggregate (None when skipped) and what each step reported."""

    aggregate: torch.Tensor | None = None
    aggregated: list[int] = field(default_factory=list)  # client ids that reached the rule (after the defenses)
    weights: dict[int, float] | None = None  # client id -> weight at the rule's input
    defenses: dict[str, dict] = field(default_factory=dict)  # defense name -> its reports, before and after
    aggregator: dict | None = None  # a choosing rule's report, by client id
    attack: dict | None = None  # what a server-side attack chose this round (γ, z, λ, ...) and its updates' norms
    skipped: str | None = None  # why there is no aggregate


class RoundPipeline:
    """Server-side attack, defenses and the rule of one scenario, applied round after round."""

    def __init__(self, scenario, attack=None) -> None:
        spec = scenario.aggregator
        self.rule = spec  # called through call_rule, which supplies what the rule declared (context, groups)
        self.entry = AGGREGATORS.get(spec.name)
        self.attack = attack if attack is not None and attack.side == "server" else None
        traits = ATTACKS.entry_for(self.attack).traits if self.attack is not None else None
        self.attack_takes_ids = bool(traits and traits.with_client_ids)  # craft(..., honest_ids=)
        self.attack_stateful = bool(traits and traits.stateful)  # state_dict / load_state_dict
        self.attack_takes_rule = bool(traits and traits.with_rule)  # craft(..., rule=) tunes itself
        if self.attack_stateful:  # its own instance, as the defenses: the runtime's may serve several runs of a process
            self.attack = type(self.attack)(self.attack.params)
        self.defenses = [(d.name, make_defense(d, scenario)) for d in scenario.defenses]
        self.previous_aggregate: torch.Tensor | None = None  # what the last aggregated round applied (ctx)

    @property
    def needs_groups(self) -> bool:
        return self.entry.traits.needs_groups

    def run(self, batch: UpdateBatch, strikers: set[int], ctx: RoundContext,
            groups: list[list[int]] | None = None, reference: UpdateBatch | None = None) -> RoundOutcome:
        """Aggregate one round; a rule or defense that cannot (AggregationError) skips the round with its reason.
        `reference`: the honest rows a server-side attack crafts from, where not the batch's own
        (asynchronous protocols: the honest updates the server received most recently)."""
        out = RoundOutcome()
        buffers = None  # BatchNorm statistics: averaged aside, never seen by attack, defenses or rule
        if ctx.layout is not None and ctx.layout.has_buffers:
            batch, ctx, buffers = BufferRows.split(batch, ctx)
            if reference is not None:  # the attack crafts trainable coordinates from trainable ones
                reference = reference.with_updates(reference.updates[:, buffers.mask.to(reference.updates.device)])
        previous = self.previous_aggregate  # on the batch's device (a checkpoint's is on CPU)
        ctx = replace(ctx, previous_aggregate=None if previous is None else previous.to(batch.updates.device))
        batch = self.server_attack(batch, strikers, ctx, out, groups, reference)
        try:
            for name, defense in self.defenses:
                batch, info = defense.before(batch, ctx)
                out.defenses.setdefault(name, {}).update(info)
                if batch.updates.shape[0] == 0:
                    raise AggregationError(f"defense {name} removed every update")
            out.aggregated = list(batch.client_ids)
            out.weights = dict(zip(batch.client_ids, batch.weights.tolist()))
            aggregate = self.aggregate(batch, groups, out, ctx)
            for name, defense in self.defenses:
                aggregate, info = defense.after(aggregate, ctx)
                out.defenses.setdefault(name, {}).update(info)
            if buffers is not None:  # the buffers of the clients the rule picked, if it picks
                full = buffers.join(aggregate, batch, (out.aggregator or {}).get("selected"))
            else:
                full = aggregate
        except AggregationError as err:
            out.skipped = str(err)
            return out
        out.aggregate = full
        self.previous_aggregate = aggregate  # trainable coordinates only, as the defenses see it
        return out

    def server_attack(self, batch: UpdateBatch, strikers: set[int], ctx: RoundContext,
                      out: RoundOutcome | None = None, groups: list[list[int]] | None = None,
                      reference: UpdateBatch | None = None) -> UpdateBatch:
        """The striking attackers' rows replaced by what a server-side (Byzantine) attack crafts from the
        honest rows; `out.attack` gets what the attack chose and the crafted updates' norms, by client id.
        An attack declared `with_rule=True` may run this round's rule (same clients, weights and groups)
        on candidate malicious rows to tune itself. With a `reference` (the honest updates an
        asynchronous server received most recently) the attack crafts from those; if it cannot
        (too few of them yet), the attackers' own rows stay and `out.attack` says why."""
        if self.attack is None or not strikers:
            return batch
        bad = torch.tensor([pid in strikers for pid in batch.client_ids])
        if not bad.any() or (bad.all() and (reference is None or len(reference.client_ids) == 0)):
            return batch
        updates = batch.updates.clone()
        kwargs = {}
        if reference is None:
            honest, honest_ids = batch.updates[~bad], tuple(p for p, b in zip(batch.client_ids, bad.tolist()) if not b)
        else:
            honest, honest_ids = reference.updates.to(batch.updates.device), reference.client_ids
        if self.attack_takes_ids:  # an attack that follows clients across rounds (mimic)
            kwargs["honest_ids"] = honest_ids
        if self.attack_takes_rule:
            def rule(malicious: torch.Tensor) -> torch.Tensor:
                trial = updates.clone()
                trial[bad] = malicious
                seeded = ctx.generator.get_state()  # a randomised rule (bucketing) sees the draws the real round will
                try:
                    return self.aggregate(batch.with_updates(trial), groups, RoundOutcome(), ctx)
                finally:
                    ctx.generator.set_state(seeded)
            kwargs["rule"] = rule
        try:
            made = self.attack.craft(honest, int(bad.sum()), ctx, **kwargs)
        except ValueError as err:
            if reference is None:
                raise
            log.warning("round %s: the server-side attack could not craft: %s", ctx.round, err)
            if out is not None:
                out.attack = {"failed": str(err), "norms": {}}
            return batch
        updates[bad] = made.rows
        if out is not None:
            norms = torch.linalg.vector_norm(updates[bad], dim=1).tolist()
            crafted = [pid for pid, b in zip(batch.client_ids, bad.tolist()) if b]
            out.attack = {**made.log, "norms": dict(zip(crafted, norms))}
        return batch.with_updates(updates)

    def aggregate(self, batch: UpdateBatch, groups: list[list[int]] | None, out: RoundOutcome,
                  ctx: RoundContext) -> torch.Tensor:
        """Run the rule (`call_rule`: its context and groups as it declared them); rules that pick or
        vote (Krum, DETOX) also report which clients, by id."""
        rows = None
        if self.needs_groups:  # the groups' client ids as rows of this batch
            row_of = {pid: i for i, pid in enumerate(batch.client_ids)}
            rows = [g for g in ([row_of[p] for p in group if p in row_of] for group in groups or []) if g]
        aggregate, info = call_rule(self.rule, batch.updates, batch.weights, ctx, rows)
        if info is None:
            return aggregate
        out.aggregator = rows_to_clients(info, batch.client_ids)
        if "weight" in out.aggregator.get("per_row", {}):  # a rule that weighs clients itself: the audit uses its weights
            out.weights = dict(out.aggregator["per_row"]["weight"])
        return aggregate

    # --- state for checkpoints: the defenses' own, the last aggregate and a stateful attack's -----
    def state_dict(self) -> dict[str, dict]:
        return {name: d.state_dict() for name, d in self.defenses}

    def load_state_dict(self, states: dict[str, dict]) -> None:
        for name, defense in self.defenses:
            defense.load_state_dict(states.get(name, {}))

    def history(self) -> dict:
        out = {"previous_aggregate": None if self.previous_aggregate is None else self.previous_aggregate.to("cpu", copy=True)}
        if self.attack_stateful:
            out["attack"] = self.attack.state_dict()
        return out

    def load_history(self, state: dict) -> None:
        self.previous_aggregate = state.get("previous_aggregate")
        if self.attack_stateful:  # a checkpoint without it (older, or saved before any attack round): a fresh start
            self.attack.load_state_dict(state.get("attack", {}))

    def deployed_states(self) -> list:
        """Each defense's `deployed_state()` now, in the scenario's order (what the evaluation of the
        round just aggregated deploys by)."""
        return [d.deployed_state() for _, d in self.defenses]

    @property
    def defense_names(self) -> list[str]:
        return [name for name, _ in self.defenses]
