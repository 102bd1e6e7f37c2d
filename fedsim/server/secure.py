"""Rounds under secure aggregation: four protocol exchanges instead of one plain exchange.

`SecureAggregationStrategy` is `ScenarioStrategy` with the training exchange replaced. Flower's
`Strategy.start` sends one batch of messages per round; SecAgg+ needs four (setup, share keys,
collect masked vectors, unmask), which Flower's own `SecAggPlusWorkflow` drives on the grid
(fedsim/engine/flower_compat.py: run_secaggplus), and so does LightSecAgg (keys, shares, upload,
aggregate: fedsim/server/lightsecagg.py). So `configure_train` runs the protocol on the grid it is
handed and returns no messages, and `aggregate_train` applies what the protocol unmasked: the
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
import logging
import time
from typing import Iterable

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid

from fedsim.engine.flower_compat import (SECAGG_STAGES, recorddict_size, run_secaggplus, secaggplus_record_key)
from fedsim.client.secure import SECAGG_TIMING  # a client's protocol seconds (a measurement)
from fedsim.server.lightsecagg import RECORD as LIGHTSECAGG_RECORD, STAGES as LIGHTSECAGG_STAGES, run_lightsecagg
from fedsim.seeding import derive_seed
from fedsim.server.record import RoundRecord
from fedsim.server.strategy import ReplyOwners, ScenarioStrategy
from fedsim.updates import UpdateBatch
from fedsim.wire import MEASUREMENT_RECORDS, pack_model

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


class SecureAggregationStrategy(ScenarioStrategy):
    """ScenarioStrategy whose training exchange is a secure aggregation protocol (see the module's docstring)."""

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> list[Message]:
        messages = super().configure_train(server_round, arrays, config, grid)  # samples, builds and records as usual
        rnd = server_round + self.offset
        sa = self.scenario.secure_aggregation
        pid_of = {node: pid for pid, node in self.node_of.items()}
        model = [t.numpy() for t in self.layout.unflatten(self.global_vec).values()]
        instructions = {}
        for m in messages:
            pid = pid_of[m.metadata.dst_node_id]
            cfg = dict(m.content["config"])
            cfg["secagg-rounding-seed"] = derive_seed(self.scenario.seed, SECAGG_ROUNDING, rnd, pid) % (2**31)
            instructions[pid] = (model, cfg)
        groups = self.pending.groups if isinstance(self.pending.groups, list) and self.pending.groups else [
            sorted(instructions)]
        max_weight = sa.max_weight or max(self.rt.client_size(p, attacking=p in self.pending.attackers)
                                          for p in range(self.scenario.federation.num_clients))
        counter = CountingGrid(grid)
        started = time.perf_counter()
        self._secure = []
        for group in groups:
            members = [p for p in group if p in instructions]
            fit_ins = {self.node_of[p]: instructions[p] for p in members}
            facts = sa.group_facts(len(members))
            timeout = sa.timeout or self.scenario.federation.round_timeout
            try:
                if sa.name == "lightsecagg":
                    outcome = run_lightsecagg(counter, fit_ins, rnd, section=sa, max_weight=max_weight,
                                              length=self.layout.dim, timeout=timeout)
                else:
                    outcome = run_secaggplus(
                        counter, fit_ins, rnd, num_shares=sa.num_shares, reconstruction_threshold=sa.reconstruction_threshold,
                        max_weight=max_weight, clipping_range=sa.clipping_range, quantization_range=sa.quantization_range,
                        modulus_range=sa.modulus_range, timeout=timeout)
            except ValueError as err:  # e.g. fewer clients than the protocol's parameters allow
                outcome = None
                log.warning("round %s: %s refused group %s: %s", rnd, sa.name, members, err)
            self._secure.append((members, outcome, facts))
        self._secure_server_seconds = time.perf_counter() - started - counter.waiting_seconds  # the server's own work
        self._secure_counter, self._secure_max_weight = counter, max_weight
        self._owner = ReplyOwners([], self.node_of)
        return []  # the protocol did the exchanges: Flower's loop has nothing left to send

    def aggregate_train(self, server_round: int, replies) -> tuple[ArrayRecord | None, MetricRecord | None]:
        server_round += self.offset
        t_start = time.perf_counter()
        timing = self._timing.setdefault(server_round, {})
        timing["secure_aggregation"] = t_start - self._sent_at
        sa = self.scenario.secure_aggregation
        record: RoundRecord = self.pending
        counter: CountingGrid = self._secure_counter
        pid_of = {node: pid for pid, node in self.node_of.items()}
        self._report = None
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
        for members, outcome, facts in self._secure:
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
                    self._take_backdoor_report(p, counter.collected[self.node_of[p]])
            means.append(torch.from_numpy(np.concatenate([a.reshape(-1) for a in outcome.aggregate]).astype(np.float32)))
            totals.append(sum(weights))
            row_ids.append(got[0])
            summed += got
            bounds.append(sa.error_bound(len(got), weights, self._secure_max_weight))
        record.rejected = dict(sorted(rejected.items()))
        record.train_loss = (sum(losses[p] for p in sorted(losses)) / len(losses)) if losses else None
        record.attacker_update_norms, record.honest_update_norm_median = {}, None  # hidden by the protocol
        record.secure_aggregation = {
            "protocol": sa.name, "groups": info_groups, "summed": sorted(summed),
            "bytes_per_stage": {s: stages[s] for s in (*SECAGG_STAGES, *LIGHTSECAGG_STAGES) if s in stages},
            "max_weight": self._secure_max_weight, "error_bound": max(bounds) if bounds else None,
        }
        client_seconds = {pid_of[n]: s for n, s in counter.client_seconds.items()}
        record.secure_aggregation_seconds = {"server": self._secure_server_seconds, "clients": dict(sorted(client_seconds.items()))}
        if len(summed) < self.scenario.federation.min_replies or not means:
            record.skipped = (f"{len(summed)} updates securely aggregated, fewer than federation.min_replies="
                              f"{self.scenario.federation.min_replies}") if means else f"{sa.name} halted in every group"
            log.warning("round %s skipped: %s", server_round, record.skipped)
            return None, None
        batch = UpdateBatch(torch.stack(means), torch.tensor(totals, dtype=torch.float32), tuple(row_ids))
        groups = [[p] for p in row_ids] if self.pipeline.needs_groups else None
        # rows: the secure group means, never a client's update
        _, outcome = self.run_pipeline(batch, set(), server_round, groups)
        if outcome.aggregator is not None:
            record.aggregator = outcome.aggregator
        if outcome.skipped is not None:
            record.skipped = outcome.skipped
            log.warning("round %s skipped: %s", server_round, outcome.skipped)
            return None, None
        record.aggregated = sorted(summed)
        self.global_vec = self.server_opt.step(self.global_vec, outcome.aggregate.cpu(), server_round)
        record.global_norm = float(torch.linalg.vector_norm(self.global_vec))
        record.model_params = self.layout.dim
        timing["aggregate"] = time.perf_counter() - t_start
        return pack_model(self.global_vec, self.layout), MetricRecord({"num-updates": len(summed)})

