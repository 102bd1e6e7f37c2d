"""FedAsync and FedBuff on a real SuperLink: arrivals in the order the replies really come.

In a deployment there is no simulated clock (fedsim/deploy/run_config.py admits `systems:` there
only to choose an asynchronous `round`). The server keeps `concurrency` messages in flight with
Flower's Message API, `Grid.push_messages`, and collects replies as they come with
`Grid.pull_messages`, polling; each reply is an arrival at this server's clock (seconds since the
run started). Everything else is as on the simulated clock (fedsim/clock/events.py): a task
starts from the model version current when its message is pushed; a freed slot takes a client at
once (a node not busy, drawn from the seed and the task's number), except the arrival that
completes the buffer, whose slot is refilled when the next step opens (with the new model); a client's second update in a
buffer waits for the next; a task with no reply `timeout` seconds after its push is given up
(a straggler) and its slot refilled. Attackers are whoever the scenario names (real devices time
their reports themselves: `systems.attackers` is simulation-only and refused here).

Not reproducible as the simulation is: the order of arrivals is the network's and the devices'.
"""

from __future__ import annotations

import time
from typing import Callable

from flwr.app import Message
from flwr.serverapp import Grid

from fedsim.clock.events import Arrival, AttackerSlots, Step, Task, admit_waiting
from fedsim.seeding import SAMPLE, numpy_rng


class LiveArrivals:
    """The slots, the waiting updates and the model version of an asynchronous run on a real grid."""

    def __init__(self, policy, federation, attackers: list[int], attack, seed: int,
                 prepare: Callable[[Task], None], poll_seconds: float = 0.05) -> None:
        self.k, self.c, self.timeout = policy.buffer_size, policy.in_flight(federation), policy.timeout
        self.num_clients, self.seed, self.prepare, self.poll_seconds = federation.num_clients, seed, prepare, poll_seconds
        self.attacker_slots = AttackerSlots(attackers, attack)
        self.version, self.next_number, self.opened = 0, 1, False
        self.slots: list[Task | None] = [None] * self.c
        self.waiting: list[Task] = []
        self.sent: dict[str, Task] = {}  # message id -> its task, until its reply is pulled
        self.refill: list[int] = []  # slots freed by the last step's closing arrivals: they take its new model
        self.t0 = time.monotonic()

    def now(self) -> float:
        return time.monotonic() - self.t0

    def fill(self, slot: int, grid: Grid, message_for: Callable[[Task], Message], started: list[Task]) -> None:
        """Push a task to a client that is not busy, from the current version."""
        busy = {t.pid for t in self.slots if t is not None}
        number, attackers = self.next_number, self.attacker_slots
        pid = attackers.take(slot, self.version, busy)
        if pid is None:
            excluded = busy if attackers.pooled else busy | set(attackers.attackers)
            free = [p for p in range(self.num_clients) if p not in excluded]
            if not free:
                self.slots[slot] = None
                return
            pid = free[int(numpy_rng(self.seed, SAMPLE, 0, number).integers(len(free)))]
        self.next_number += 1
        task = Task(number, pid, self.version, self.now(), slot, pid in attackers.attackers)
        self.prepare(task)
        (message_id,) = list(grid.push_messages([message_for(task)]))
        self.sent[message_id] = task
        self.slots[slot] = task
        started.append(task)

    def step(self, grid: Grid, message_for: Callable[[Task], Message]) -> Step:
        out = Step([], self.now(), self.now())
        buffer = out.arrivals
        if not self.opened:
            self.opened = True
            self.refill = list(range(self.c))
        for slot in self.refill:  # pushed now that the last step's model is the current version
            self.fill(slot, grid, message_for, out.started)
        self.waiting = admit_waiting(self.waiting, buffer, self.k, self.version, out.start)
        refill = self.refill = []
        while len(buffer) < self.k:
            for slot, task in enumerate(self.slots):  # given up: no reply `timeout` seconds after its push
                if task is None and slot not in refill:
                    self.fill(slot, grid, message_for, out.started)  # a slot nobody could take: try again
                elif task is not None and self.now() - task.start > self.timeout:
                    self.sent = {m: t for m, t in self.sent.items() if t is not task}
                    out.given_up.append(task)
                    self.slots[slot] = None
                    self.fill(slot, grid, message_for, out.started)
            replies = sorted(grid.pull_messages(list(self.sent)),
                             key=lambda r: self.sent[r.metadata.reply_to_message_id].number)
            if not replies:
                time.sleep(self.poll_seconds)
                continue
            when = self.now()
            for reply in replies:
                task = self.sent.pop(reply.metadata.reply_to_message_id)
                task.reply, task.finish = reply, when
                self.slots[task.slot] = None
                if len(buffer) == self.k or task.pid in {a.task.pid for a in buffer}:
                    self.waiting.append(task)  # the next buffer's
                else:
                    buffer.append(Arrival(task, when, self.version - task.version))
                if len(buffer) == self.k:
                    refill.append(task.slot)
                else:
                    self.fill(task.slot, grid, message_for, out.started)
        out.time = buffer[-1].time if buffer else out.start
        self.version += 1
        return out

    def versions_in_use(self) -> set[int]:
        return {t.version for t in self.slots if t is not None} | {t.version for t in self.waiting}

    def in_flight(self) -> int:
        return sum(t is not None for t in self.slots)
