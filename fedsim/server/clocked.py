"""The round protocols on the federation clock (`systems.round`: wait_for_all, deadline,
over_selection): the plain exchange, wrapped.

The driver has already sampled among the clients checked in at the round's start, as many as the
policy selects, and left out those that drop out (fedsim/server/driver.py with
fedsim/clock/clock.py). Every other selected client trains for real; when its reply arrives the
clock times its part of the round from the bytes of the message it got, the samples it reports
training on and the bytes of its reply. The policy closes the round from those finish times; a
client finishing after the close is a straggler: its reply is dropped before decoding (it was
aborted at the close: its upload is not in bytes_up) and it is no failure (not in `rejected`).
The on-time replies go to the plain exchange, which decodes and aggregates them as always.
"""

from __future__ import annotations

import time

from flwr.app import Message
from flwr.serverapp import Grid

from fedsim.clock.cost import train_flops_per_sample
from fedsim.compression.base import PayloadError
from fedsim.server.driver import RoundDriver, RoundPlan
from fedsim.server.exchange import PlainExchange
from fedsim.wire import is_number, message_bytes, trained_samples


class ClockedExchange:
    def __init__(self, driver: RoundDriver, node_of: dict[int, int]) -> None:
        self.driver, self.inner = driver, PlainExchange(driver, node_of)
        self.clock = driver.clock
        self._flops: dict[int, float] = {}  # model dimension -> training FLOPs per sample

    def configure(self, plan: RoundPlan, grid: Grid) -> list[Message]:
        return self.inner.configure(plan, grid)

    def flops_per_sample(self) -> float:
        """The global model's training FLOPs per sample, counted once per model shape."""
        dim = self.driver.layout.dim
        if dim not in self._flops:
            self._flops[dim] = train_flops_per_sample(self.driver.global_model(), self.driver.rt.data.x_train)
        return self._flops[dim]

    def aggregate(self, replies: list[Message]) -> int | None:
        driver, record, clock = self.driver, self.driver.pending, self.clock
        rnd, started = record.round, time.perf_counter()
        policy = driver.scenario.systems.round
        flops = self.flops_per_sample()
        finish, times, sizes = {}, {}, {}
        for reply in replies:
            pid = self.inner.owner(reply)
            if reply.has_error() or pid not in record.bytes_down_per_client:
                continue  # a failure: the plain exchange records it
            try:
                up = sizes[pid] = message_bytes(reply)  # serialized once: the plain exchange reuses it
            except PayloadError:
                continue  # cannot have crossed a wire: the plain exchange rejects it
            samples = trained_samples(reply.content)
            if samples is None:
                continue  # no work reported: the plain exchange decodes it (and rejects it if it is malformed)
            t = clock.client_time(pid, record.bytes_down_per_client[pid], samples, flops, up, rnd)
            finish[pid], times[pid] = t.total, [t.down, t.compute, t.up]
        target = driver.scenario.federation.clients_per_round
        close = policy.close(list(finish.values()), target)
        late = sorted(p for p, f in finish.items() if close is not None and f > close)
        late_set = set(late)
        on_time = [r for r in replies if self.inner.owner(r) not in late_set]
        record.update({"stragglers": late, "client_seconds": {p: [round(s, 6) for s in times[p]] for p in sorted(times)}})
        if clock.adacomm is not None:
            record.start_loss = start_loss(on_time)
        excused = frozenset(late_set) | frozenset(record.dropped_out)
        result = self.inner.aggregate(on_time, excused=excused, sizes=sizes)
        server = driver.scenario.systems.server_seconds
        if server == "measured":  # this machine's decode and aggregation (not reproducible: said in the docs)
            server = time.perf_counter() - started
        duration = close if close is not None else driver.scenario.systems.idle_seconds  # nobody reported
        record.sim_time = clock.close_round(rnd, duration, server)
        record.sim_seconds = clock.now - record.sim_start
        return result


def start_loss(replies: list[Message]) -> float | None:
    """The mean loss the replying clients report at the round's global model (each one's first
    batch, before its first step): AdaComm's estimate of the training loss F there. A value that
    is not a finite non-negative number (untrusted input) is left out."""
    values = []
    for reply in replies:
        if reply.has_error() or "metrics" not in reply.content.metric_records:
            continue
        value = reply.content["metrics"].get("start-loss")
        if is_number(value) and 0 <= value < 1e6:
            values.append(float(value))
    return sum(values) / len(values) if values else None
