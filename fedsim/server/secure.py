"""Rounds under secure aggregation: four protocol exchanges instead of one plain exchange.

The `secaggplus` and `lightsecagg` protocols' server side (fedsim/server/exchange.py: the calling
convention). Flower's `Strategy.start` sends one batch of messages per round; SecAgg+ needs four
(setup, share keys, collect masked vectors, unmask), which Flower's own `SecAggPlusWorkflow` drives
on the grid (fedsim/flower/compat.py: run_secaggplus), and so does LightSecAgg (keys, shares,
upload, aggregate: fedsim/server/lightsecagg.py). So `configure` runs the protocol on the grid it
is handed and returns no messages, and `aggregate` applies what the protocol unmasked: the
example-weighted mean of the survivors' updates, never one client's update.

What the server then does with it:

- `fedavg`: the secure weighted mean is the aggregate;
- `detox` with `redundancy: false` (DETOX-style groups): every group of the round runs its own
  SecAgg+ instance; the group means (weights: the groups' example totals) are the rows the DETOX
  rule sees, so its robust inner rule runs across the group sums exactly as it does in the clear.

The round's line records the bytes of all four exchanges per client (`bytes_up_per_client`,
`bytes_down_per_client`, and per stage in `secure_aggregation`), who was summed, who dropped and
at which stage, the protocol's parameters and its documented error bound. What needs individual
updates is absent: no update norms, no detection audit (the scenario's validation has already
refused every defense and server-side attack that would need them: fedsim/secagg/config.py).
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
import logging
import time
from typing import Iterable

import numpy as np
import torch
from flwr.app import Message, RecordDict
from flwr.serverapp import Grid

from fedsim.flower.compat import (SECAGG_STAGES, recorddict_size, run_secaggplus, secaggplus_record_key)
from fedsim.server.lightsecagg import RECORD as LIGHTSECAGG_RECORD, STAGES as LIGHTSECAGG_STAGES, run_lightsecagg
from fedsim.secagg.config import SECAGG_TIMING  # a client's protocol seconds (a measurement)
from fedsim.seeding import derive_seed
from fedsim.server.record import RoundRecord
from fedsim.server.exchange import take_backdoor_report
from fedsim.updates import UpdateBatch
from fedsim.wire import MEASUREMENT_RECORDS

log = logging.getLogger("fedsim")

SECAGG_ROUNDING = 5  # seed stream of the clients' stochastic rounding (fedsim/seeding.py keeps 1..4)


class CountingGrid:
    """The grid as a secure protocol sees it: every message and reply sized (serialized RecordDict,
    as fedsim counts every upload) per node and protocol stage; the masked-upload stage's replies
    kept (an attacker's backdoor report) and each client's protocol seconds summed."""

    def __init__(self, grid: Grid) -> None:
        self.grid = grid
        self.keys = (secaggplus_record_key(), LIGHTSECAGG_RECORD)  # where a protocol message names its stage
        self.down: dict[int, dict[str, int]] = {}
        self.up: dict[int, dict[str, int]] = {}
        self.last_stage: dict[int, str] = {}  # node -> the last stage it answered without error
        self.client_seconds: dict[int, float] = {}
        self.collected: dict[int, Message] = {}  # node -> its collect-stage reply
        self.waiting_seconds = 0.0  # in send_and_receive: the clients' work, the transport, the sizing

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        started = time.perf_counter()
        try:
            return self._send_and_receive(messages, timeout)
        finally:  # the clients' work, the transport and this instrumentation: not the server's protocol work
            self.waiting_seconds += time.perf_counter() - started

    def _send_and_receive(self, messages: Iterable[Message], timeout: float | None) -> list[Message]:
        # one message each, as serialization gives every node its own copy: the workflow hands all
        # nodes one shared content at setup, which the client mod edits in place (an in-process grid)
        messages = [Message(copy.deepcopy(m.content), dst_node_id=m.metadata.dst_node_id,
                            message_type=m.metadata.message_type, group_id=m.metadata.group_id) for m in messages]
        stage = None
        for m in messages:
            key = next((k for k in self.keys if k in m.content.config_records), None)
            stage = str(m.content.config_records[key].get("stage", "?")) if key else "?"
            node = m.metadata.dst_node_id
            per = self.down.setdefault(node, {})
            per[stage] = per.get(stage, 0) + recorddict_size(m.content)
        replies = list(self.grid.send_and_receive(messages, timeout=timeout))
        for r in replies:
            if r.has_error():
                continue
            node = r.metadata.src_node_id
            content = {k: v for k, v in r.content.items() if k not in MEASUREMENT_RECORDS and k != SECAGG_TIMING}
            per = self.up.setdefault(node, {})
            per[stage] = per.get(stage, 0) + recorddict_size(RecordDict(content))
            self.last_stage[node] = stage
            if SECAGG_TIMING in r.content.metric_records:
                self.client_seconds[node] = self.client_seconds.get(node, 0.0) + float(r.content[SECAGG_TIMING]["seconds"])
            if stage in ("collect_masked_vectors", "upload"):
                self.collected[node] = r
        return replies


def largest_client(rt, strikers) -> int:
    """The most examples any client trains on this round (SecAgg+'s default max_weight): the largest
    partition when no attack changes a client's data, read from the partition sizes at once."""
    if rt.attack is None:
        return int(rt.partitions.sizes.max())
    return max(rt.client_size(p, attacking=p in strikers) for p in range(rt.scenario.federation.num_clients))


class SecureExchange(ABC):
    """A secure aggregation protocol's exchanges for one round, one protocol instance per group
    (see the module's docstring). Subclasses say how one group's secure sum runs (`run_group`)."""

    def __init__(self, driver, node_of: dict[int, int]) -> None:
        self.driver, self.node_of = driver, node_of
        self.section = driver.scenario.secure_aggregation
        self.groups_out: list = []  # (members, outcome, facts) of this round's groups
        self.counter: CountingGrid | None = None
        self.server_seconds = 0.0
        self.max_weight = 0.0

    @abstractmethod
    def run_group(self, grid, fit_ins: dict, rnd: int, max_weight: float, timeout: float):
        """Run one group's secure sum on `grid`; returns the protocol's outcome (aggregate, summed, metrics)."""

    def configure(self, plan, grid: Grid) -> list[Message]:
        driver, sa, rnd = self.driver, self.section, plan.round
        model = [t.numpy() for t in driver.layout.unflatten(driver.global_vec).values()]
        instructions = {}
        for pid in plan.order:
            cfg = dict(plan.configs[pid])
            cfg["secagg-rounding-seed"] = derive_seed(driver.scenario.seed, SECAGG_ROUNDING, rnd, pid) % (2**31)
            instructions[pid] = (model, cfg)
        groups = plan.groups or [sorted(instructions)]
        self.max_weight = sa.max_weight or largest_client(driver.rt, plan.strikers)
        counter = CountingGrid(grid)
        started = time.perf_counter()
        driver.timing[rnd] = {"encode": started - driver.started}
        self.groups_out = []
        for group in groups:
            members = [p for p in group if p in instructions]
            fit_ins = {self.node_of[p]: instructions[p] for p in members}
            facts = sa.group_facts(len(members))
            try:
                outcome = self.run_group(counter, fit_ins, rnd, self.max_weight,
                                         sa.timeout or driver.scenario.federation.round_timeout)
            except ValueError as err:  # e.g. fewer clients than the protocol's parameters allow
                outcome = None
                log.warning("round %s: %s refused group %s: %s", rnd, sa.name, members, err)
            self.groups_out.append((members, outcome, facts))
        finished = time.perf_counter()
        driver.timing[rnd]["secure_aggregation"] = finished - started
        self.server_seconds = finished - started - counter.waiting_seconds  # the server's own work
        self.counter = counter
        return []  # the protocol did the exchanges: Flower's loop has nothing left to send

    def aggregate(self, replies) -> int | None:
        driver, sa, counter = self.driver, self.section, self.counter
        record: RoundRecord = driver.pending
        t_start = time.perf_counter()
        timing = driver.timing.setdefault(record.round, {})
        pid_of = {self.node_of[p]: p for members, _, _ in self.groups_out for p in members}  # the round's clients
        up_per = {pid_of[n]: sum(v.values()) for n, v in counter.up.items()}
        down_per = {pid_of[n]: sum(v.values()) for n, v in counter.down.items()}
        stages: dict[str, dict[str, int]] = {}
        for direction, table in (("up", counter.up), ("down", counter.down)):
            for per in table.values():
                for stage, size in per.items():
                    stages.setdefault(stage, {"up": 0, "down": 0})[direction] += size
        record.bytes_up_per_client = dict(sorted(up_per.items()))
        record.bytes_down_per_client = dict(sorted(down_per.items()))
        record.update({"bytes_up": sum(up_per.values()), "bytes_down": sum(down_per.values()), "defenses": {},
                       "skipped": None})
        rejected, means, totals, row_ids, summed, losses, bounds, info_groups = {}, [], [], [], [], {}, [], []
        for members, outcome, facts in self.groups_out:
            got = [] if outcome is None else sorted(pid_of[n] for n in outcome.summed)
            for pid in members:
                if pid not in got:
                    last = counter.last_stage.get(self.node_of[pid])
                    rejected[pid] = (f"dropped before answering {sa.name}'s first stage" if last is None else
                                     f"dropped after {sa.name} stage {last}; the round went on without its update"
                                     if outcome is not None and outcome.aggregate is not None else
                                     f"{sa.name} halted after stage {last}: too few shares or survivors ({facts})")
            info_groups.append({"members": members, "summed": got, **facts,
                                "halted": outcome is None or outcome.aggregate is None})
            if outcome is None or outcome.aggregate is None or not got:
                continue
            metrics = {pid_of[n]: m for n, m in outcome.metrics.items()}
            weights = [float(metrics[p]["num_examples"]) for p in got]
            for p in got:
                losses[p] = float(metrics[p].get("train-loss", 0.0))
                if p in record.attackers and self.node_of[p] in counter.collected:
                    take_backdoor_report(driver, p, counter.collected[self.node_of[p]])
            means.append(torch.from_numpy(np.concatenate([a.reshape(-1) for a in outcome.aggregate]).astype(np.float32)))
            totals.append(sum(weights))
            row_ids.append(got[0])
            summed += got
            bounds.append(sa.error_bound(len(got), weights, self.max_weight))
        record.rejected = dict(sorted(rejected.items()))
        record.train_loss = (sum(losses[p] for p in sorted(losses)) / len(losses)) if losses else None
        record.attacker_update_norms, record.honest_update_norm_median = {}, None  # hidden by the protocol
        record.secure_aggregation = {
            "protocol": sa.name, "groups": info_groups, "summed": sorted(summed),
            "bytes_per_stage": {s: stages[s] for s in (*SECAGG_STAGES, *LIGHTSECAGG_STAGES) if s in stages},
            "max_weight": self.max_weight, "error_bound": max(bounds) if bounds else None,
        }
        client_seconds = {pid_of[n]: s for n, s in counter.client_seconds.items()}
        record.secure_aggregation_seconds = {"server": self.server_seconds, "clients": dict(sorted(client_seconds.items()))}
        min_replies = driver.scenario.federation.min_replies
        if len(summed) < min_replies or not means:
            record.skipped = (f"{len(summed)} updates securely aggregated, fewer than federation.min_replies="
                              f"{min_replies}") if means else f"{sa.name} halted in every group"
            log.warning("round %s skipped: %s", record.round, record.skipped)
            return None
        # rows: the secure group means, never a client's update
        batch = UpdateBatch(torch.stack(means), torch.tensor(totals, dtype=torch.float32), tuple(row_ids))
        groups = [[p] for p in row_ids] if driver.pipeline.needs_groups else None
        if not driver.aggregate(batch, set(), groups, audit=False):
            log.warning("round %s skipped: %s", record.round, record.skipped)
            return None
        record.aggregated = sorted(summed)
        timing["aggregate"] = time.perf_counter() - t_start
        return len(summed)


class SecAggPlusExchange(SecureExchange):
    """Flower's SecAgg+ workflow, one instance per group (fedsim/flower/compat.py: run_secaggplus)."""

    def run_group(self, grid, fit_ins: dict, rnd: int, max_weight: float, timeout: float):
        sa = self.section
        return run_secaggplus(grid, fit_ins, rnd, num_shares=sa.num_shares,
                              reconstruction_threshold=sa.reconstruction_threshold, max_weight=max_weight,
                              clipping_range=sa.clipping_range, quantization_range=sa.quantization_range,
                              modulus_range=sa.modulus_range, timeout=timeout)


class LightSecAggExchange(SecureExchange):
    """LightSecAgg's four exchanges, one instance per group (fedsim/server/lightsecagg.py)."""

    def run_group(self, grid, fit_ins: dict, rnd: int, max_weight: float, timeout: float):
        return run_lightsecagg(grid, fit_ins, rnd, section=self.section, max_weight=max_weight,
                               length=self.driver.layout.dim, timeout=timeout)
