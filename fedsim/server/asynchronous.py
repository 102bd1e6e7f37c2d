"""The asynchronous round protocols' server side (`systems.round`: fedasync, fedbuff).

One Flower round is one server step. `open_round` starts the step's record; `configure` runs the
simulated clock (fedsim/clock/events.py) until the step's buffer is complete, training the tasks
the clock asks for in waves of messages through the grid, each client told the model version its
task started from; `aggregate` decodes the buffer's replies like the plain exchange and steps the
model:
- FedBuff: each update Δ_k (against the model its client started from) scaled by s(staleness_k),
  equal weights (the paper's 1/K mean), then defenses and rule, then the server optimizer (η_g);
- FedAsync: the row is x_new − x_{t−1} = (x_τ + Δ) − x_{t−1}, and the aggregate is scaled by
  α·s(staleness) before the server step, so plain FedAvg gives x_t = (1 − α_t)·x_{t−1} + α_t·x_new.
Defenses and the rule see the buffer's rows as they are scaled. A server-side (omniscient) attack
crafts from the honest rows the server received most recently (the last `concurrency` of them,
scaled alike, each client's latest): under FedAsync a buffer holds one row, so there would be none
to craft from; until enough have arrived an attack may be unable to craft (the step's `attack`
says why, and the attackers' own rows go on).

A client-side attacker assumes the model-replacement boost of its protocol: the round total it
is told is K times its own examples under FedBuff (the equal-weight mean of K), its own examples
over α under FedAsync (one update mixed in with weight α).

In a deployment there is no simulated clock: the same steps run on the real one, with messages
pushed and replies pulled as they come (fedsim/server/live.py).

Each step's checkpoint keeps the clients in flight and waiting (without their replies), the model
versions they started from and the recent honest rows; a resumed run trains the tasks that had
trained again, so it needs clients without memory between tasks (refused otherwise, with the
reason), and cannot resume a deployment.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid

from fedsim.clock.asynchrony import FedAsync
from fedsim.clock.cost import train_flops_per_sample
from fedsim.clock.events import AsyncFederation, Step, Task
from fedsim.compression.base import PayloadError
from fedsim.server.driver import RoundDriver, RoundPlan
from fedsim.server.exchange import PlainExchange, ReplyOwners
from fedsim.server.live import LiveArrivals
from fedsim.server.record import RoundRecord
from fedsim.updates import UpdateBatch
from fedsim.wire import message_bytes, pack_model, records_bytes, trained_samples

log = logging.getLogger("fedsim")


@dataclass
class Version:
    vec: torch.Tensor
    record: ArrayRecord | None = None  # packed on first send


class AsynchronousExchange:
    def __init__(self, driver: RoundDriver, node_of: dict[int, int]) -> None:
        self.driver, self.node_of = driver, node_of
        self.scenario, self.rt, self.clock = driver.scenario, driver.rt, driver.clock
        self.policy = self.scenario.systems.round
        self.plain = PlainExchange(driver, node_of)  # decodes the buffer and hands it to the driver
        if self.clock is None:  # a deployment: the real clock, replies in the order they come (fedsim/server/live.py)
            self.federation = LiveArrivals(self.policy, self.scenario.federation, self.rt.attackers,
                                           self.scenario.attack, self.scenario.seed, self.prepare)
        else:
            self.federation = AsyncFederation(self.policy, self.scenario.federation, self.clock, self.rt.attackers,
                                              self.scenario.attack, self.scenario.seed, self.prepare)
        self.versions: dict[int, Version] = {}
        self.model_bytes: int | None = None  # every version's serialized size (the layout never changes)
        self._flops: float | None = None
        self.recent: OrderedDict[int, torch.Tensor] = OrderedDict()  # client -> its latest honest row, as the rule saw it
        self.step: Step | None = None
        self.grid: Grid | None = None
        self.retrain: list[Task] = []  # a resumed run's tasks that had trained (their replies are not checkpointed)
        if self.clock is not None:
            driver.protocol_state = self.state_dict
        self._last_attack: int | None = None

    # --- a server step ---------------------------------------------------------------------------
    def open_round(self, rnd: int) -> RoundPlan:
        driver = self.driver
        if driver.offset and rnd == driver.offset + 1:
            self.resume()
        driver.started = time.perf_counter()
        driver.report = None
        keep = self.federation.versions_in_use() | {self.federation.version}
        self.versions = {v: m for v, m in self.versions.items() if v in keep}
        self.versions[self.federation.version] = Version(driver.global_vec)
        driver.pending = RoundRecord(rnd)
        driver.plan = RoundPlan(rnd, [], [])
        return driver.plan

    def configure(self, plan: RoundPlan, grid: Grid) -> list[Message]:
        """Run the clock until the buffer is complete (the clients train here, in waves); nothing is
        left for Flower's own loop to send."""
        self.grid = grid
        if self.retrain:  # a resumed run: the tasks that had trained, trained again (same model, same seed)
            tasks, self.retrain = self.retrain, []
            self.train(tasks)
        driver = self.driver
        driver.timing[plan.round] = {"encode": time.perf_counter() - driver.started}
        if self.clock is None:
            self.step = self.federation.step(grid, self.message)
        else:
            server = self.scenario.systems.server_seconds
            self.step = self.federation.step(self.train, 0.0 if server == "measured" else server)
        self.plain.sent_at = time.perf_counter()
        return []

    # --- what survives a restart -----------------------------------------------------------------
    def state_dict(self) -> dict:
        """The clients in flight and waiting, the model versions they trained from, the recent honest rows."""
        in_use = self.federation.versions_in_use()
        state = {"federation": self.federation.state_dict(), "last_attack": self._last_attack,
                 "versions": {str(v): m.vec for v, m in self.versions.items() if v in in_use},
                 "recent": {str(p): row for p, row in self.recent.items()}}
        if self.driver.local_privacy is not None:
            state["releases"] = {str(p): n for p, n in self.driver.local_privacy.releases.items()}
        return state

    def resume(self) -> None:
        """Continue from the checkpoint the driver resumed from. The tasks that had trained are
        trained again (a client's training depends only on the model version, the seed and its data),
        which needs clients that keep no memory between tasks."""
        driver, state = self.driver, self.driver.resumed_protocol
        name = f"systems.round={self.policy.name}"
        if self.clock is None:
            raise RuntimeError(f"{name} on a real SuperLink cannot be resumed: its messages in flight are the link's")
        if state is None:
            raise RuntimeError(f"{name}: the checkpoint holds no asynchronous state (written by another protocol?)")
        folder = driver.checkpoint_to
        if folder is not None and any(folder.client_states.glob("*.npz")):
            raise RuntimeError(f"{name}: clients keep memory between tasks here (a codec's error feedback or an "
                               "attacker's own arrays), which training a task again would not replay exactly; "
                               "an asynchronous run with client memory cannot be resumed: start it again")
        self.retrain = self.federation.load_state_dict(state["federation"])
        self.versions = {int(v): Version(vec) for v, vec in state["versions"].items()}
        self.recent = OrderedDict((int(p), row) for p, row in state["recent"].items())
        self._last_attack = state["last_attack"]
        if driver.local_privacy is not None:
            driver.local_privacy.releases.update({int(p): int(n) for p, n in state.get("releases", {}).items()})

    def prepare(self, task: Task) -> None:
        """A started task's download size and the earliest it can finish (no upload, the fewest samples)."""
        if self.model_bytes is None:
            self.model_bytes = records_bytes({"arrays": pack_model(self.driver.global_vec, self.driver.layout)})
        bytes_down = self.model_bytes + records_bytes({"config": ConfigRecord(self.config(task))})
        task.bytes_down = bytes_down
        if self.clock is None:
            return
        least = self.fewest_samples(task)
        task.bound = task.start + self.clock.client_time(task.pid, bytes_down, least, self.flops(), 0, task=task.number).total

    def fewest_samples(self, task: Task) -> int:
        """Samples an honest client processes at least: every epoch's full batches (an attacker's
        own loop may differ: 0)."""
        fed = self.scenario.federation
        if task.attacker or fed.local_steps is not None:
            return 0
        n = self.rt.client_size(task.pid)
        return fed.local_epochs * (n // fed.batch_size) * fed.batch_size

    def flops(self) -> float:
        if self._flops is None:
            self._flops = train_flops_per_sample(self.driver.global_model(), self.rt.data.x_train)
        return self._flops

    def config(self, task: Task) -> dict:
        rnd = task.version + 1  # the server step its update is meant for: its lr, its seeds
        cfg = {"server-round": rnd, "lr": self.rt.lr(rnd), **self.driver.model.config()}
        if task.attacker and self.rt.attack is not None and self.rt.attack.side == "client":
            own = self.rt.client_size(task.pid, attacking=True)
            cfg["round_total_examples"] = (own / self.policy.alpha if isinstance(self.policy, FedAsync)
                                           else own * self.policy.buffer_size)
        return cfg

    def message(self, task: Task) -> Message:
        """The task's training message: its version's model and its config."""
        version = self.versions[task.version]
        if version.record is None:
            version.record = pack_model(version.vec, self.driver.layout)
        return Message(RecordDict({"arrays": version.record, "config": ConfigRecord(self.config(task))}),
                       dst_node_id=self.node_of[task.pid], message_type=MessageType.TRAIN)

    def train(self, tasks: list[Task]) -> None:
        """One wave: each task's message (its version's model) out, its reply in, its finish time set."""
        sent = [(self.message(task), task) for task in tasks]
        owner = ReplyOwners([(m, t.number) for m, t in sent])
        timeout = self.scenario.federation.round_timeout
        replies = list(self.grid.send_and_receive([m for m, _ in sent], timeout=timeout))
        by_number = {t.number: t for _, t in sent}
        for reply in replies:
            task = by_number.get(owner(reply))
            if task is None:
                continue
            task.reply = reply
            samples, up = 0, 0
            if not reply.has_error():
                try:
                    up = task.bytes_up = message_bytes(reply)  # serialized once: the decoding reuses it
                except PayloadError:
                    up = 0
                samples = trained_samples(reply.content) or 0
            t = self.clock.client_time(task.pid, task.bytes_down, samples, self.flops(), up, task=task.number)
            task.finish = max(task.start + t.total, task.bound)
            task.times = [t.down, t.compute, t.up]
        for task in tasks:
            if task.reply is None:  # no reply from the engine: a failure; the server gives up on it at the timeout
                task.dropped = True
                task.failure = f"no reply within federation.round_timeout={timeout}s"

    def aggregate(self, replies: list[Message]) -> int | None:
        driver, record, step = self.driver, self.driver.pending, self.step
        rnd = record.round
        arrivals = step.arrivals
        by_pid = {a.task.pid: a for a in arrivals}
        record.sampled = sorted(by_pid)
        record.attackers = sorted(p for p, a in by_pid.items() if a.task.attacker)
        down: dict[int, int] = {}  # the models of the tasks started during the step (their download then)
        for task in step.started:
            down[task.pid] = down.get(task.pid, 0) + task.bytes_down
        record.bytes_down, record.bytes_down_per_client = sum(down.values()), dict(sorted(down.items()))
        record.update({
            "staleness": {p: by_pid[p].staleness for p in record.sampled},
            "trained_from": {p: by_pid[p].task.version for p in record.sampled},
            "arrived": {p: round(by_pid[p].time, 6) for p in record.sampled},
            "started": sorted(t.pid for t in step.started),
            "discarded": sorted(t.pid for t in step.discarded),
            "dropped_out": sorted(t.pid for t in step.given_up if t.dropped and not t.failure),
            "stragglers": sorted(t.pid for t in step.given_up if not t.dropped),
            "in_flight": self.federation.in_flight(),
        })
        if self.clock is not None:  # simulated times (live: `arrived` is this server's clock, wall_seconds the rest)
            record.update({"sim_start": step.start, "sim_time": step.time, "sim_seconds": self.federation.now - step.start,
                           "client_seconds": {p: [round(s, 6) for s in by_pid[p].task.times] for p in record.sampled}})
        if self.scenario.attack is not None:
            if record.attackers:
                self._last_attack = rnd
            record.rounds_since_attack = None if self._last_attack is None else rnd - self._last_attack
        if driver.local_privacy is not None:
            driver.local_privacy.count(record.sampled)
            record.local_privacy = driver.local_privacy.report()
        buffer_replies = [by_pid[p].task.reply for p in record.sampled]
        owner_of = {id(r): p for p, r in zip(record.sampled, buffer_replies)}
        self.plain.owner = lambda reply: owner_of.get(id(reply), -1)
        sizes = {p: by_pid[p].task.bytes_up for p in record.sampled if by_pid[p].task.bytes_up is not None}
        result = self.plain.aggregate(buffer_replies, sizes=sizes, reshape=self.reshape)
        failures = {t.pid: t.failure for t in step.given_up if t.failure}
        if failures:
            record.rejected = {**failures, **record.rejected}
        server = self.scenario.systems.server_seconds
        if server == "measured" and self.clock is not None:  # this machine's decode and aggregation (not reproducible: docs/clock.md)
            self.federation.now += time.perf_counter() - self.plain.sent_at
            record.sim_seconds = self.federation.now - step.start
        return result

    def reshape(self, batch: UpdateBatch) -> tuple[UpdateBatch, dict]:
        """The buffer's rows as the rule sees them (module docstring), equal weights, and the driver's
        options: FedAsync's α·s(staleness), an omniscient attack's recent honest rows."""
        record, rows, options = self.driver.pending, batch.updates, {}
        if isinstance(self.policy, FedAsync):
            if len(batch.client_ids):
                start = torch.stack([self.versions[record.trained_from[p]].vec for p in batch.client_ids])
                rows = start + rows - self.driver.global_vec
                (pid,) = batch.client_ids
                options["scale"] = self.policy.alpha * self.policy.staleness.weight(record.staleness[pid])
        else:
            s = torch.tensor([self.policy.staleness.weight(record.staleness[p]) for p in batch.client_ids],
                             dtype=rows.dtype)
            rows = rows * s[:, None]
        attackers, keep = set(record.attackers), self.policy.in_flight(self.scenario.federation)
        for pid, row in zip(batch.client_ids, rows):
            if pid not in attackers:
                self.recent.pop(pid, None)
                self.recent[pid] = row
        while len(self.recent) > keep:
            self.recent.popitem(last=False)
        pipeline = self.driver.pipeline
        if pipeline is not None and pipeline.attack is not None and self.recent:
            ids = tuple(self.recent)
            options["reference"] = UpdateBatch(torch.stack([self.recent[p] for p in ids]), torch.ones(len(ids)), ids)
        return UpdateBatch(rows, torch.ones(len(batch.client_ids)), batch.client_ids), options
