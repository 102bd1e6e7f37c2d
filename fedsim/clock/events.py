"""An asynchronous federation's events on the simulated clock: who trains from which model version,
who arrives when, and which updates fill each server step's buffer (FedAsync, FedBuff:
fedsim/clock/asynchrony.py).

`concurrency` slots each hold one client's task. A task starts from the model version current
at its start and finishes at start + download + compute + upload on the federation clock
(fedsim/clock/clock.py), known only once the client has really trained (its reply's bytes and the
samples it processed). So the simulation asks the exchange to train tasks in waves: before
processing the earliest known arrival it trains every untrained task that could still arrive
earlier (its `bound`, the finish time it cannot beat, is below that arrival). Events are processed
in (simulated time, task number) order: the order is the clock's and the seed's, never which
Ray actor answered first.

When a task arrives its slot takes a new client at once (sampled among the checked-in clients
not busy, seeded by the task's number), except the arrival that completes the buffer: its slot
is refilled after the server step, from the new model. A client may start again while its update
waits in the buffer, but contributes at most one update to a buffer: a second one waits for the
next buffer. A task dropping out, or still running
`timeout` seconds after its start, is given up at that point and its slot refilled.

Attackers: under the `fixed_pool` schedule they are sampled like everyone. Under the others the
first `attackers_per_round` slots are the attackers': at a step the schedule attacks, a freed
attacker slot takes the next attacker (round robin); otherwise an honest client. What an attacker
does with a finished update is `systems.attackers.reporting`: `eager` reports it, `fresh_only`
drops it when the model moved meanwhile (and starts again), `buffer_timed` also holds a fresh
one, keeping its slot, until the held attackers' updates complete the buffer together.

Pure bookkeeping: no Flower, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from fedsim.seeding import SAMPLE, numpy_rng


@dataclass
class Task:
    """One client's training from one model version."""

    number: int  # 1, 2, ...: the order tasks were started in (the tie-breaker, the seed of its draws)
    pid: int
    version: int  # the server steps applied to the model it trains from
    start: float  # simulated seconds
    slot: int
    attacker: bool
    dropped: bool = False  # disappears before reporting (given up at start + timeout)
    bound: float = 0.0  # the earliest it can finish (set when its message is sized)
    finish: float | None = None  # start + download + compute + upload, once it has trained
    reply: object = None  # what the exchange keeps of its reply
    holding: bool = False  # a buffer_timed attacker holding a finished update
    bytes_down: int = 0  # its message's serialized size
    bytes_up: int | None = None  # its reply's serialized size, once measured (the clock's upload time)
    times: list[float] | None = None  # [download, compute, upload] simulated seconds, once it has trained
    failure: str | None = None  # why it never answered (an engine failure, not a dropout)

    STATE = ("number", "pid", "version", "start", "slot", "attacker", "dropped", "bound", "finish", "holding",
             "bytes_down", "times", "failure")

    def state(self) -> dict:
        """What a checkpoint keeps of it (its reply is not kept: a resumed run trains it again)."""
        return {k: getattr(self, k) for k in self.STATE}

    @classmethod
    def from_state(cls, state: dict) -> "Task":
        return cls(**{k: state[k] for k in cls.STATE})

    def event_time(self, timeout: float) -> float | None:
        """When the server hears of it (its arrival, or giving up on it); None while untrained."""
        deadline = self.start + timeout
        if self.dropped:
            return deadline
        return None if self.finish is None else min(self.finish, deadline)

    def arrives(self, timeout: float) -> bool:
        return not self.dropped and self.finish is not None and self.finish <= self.start + timeout


@dataclass
class Arrival:
    task: Task
    time: float  # when it entered the buffer
    staleness: int  # server steps applied since its task started


@dataclass
class Step:
    """One server step's buffer and what else happened while it filled."""

    arrivals: list[Arrival]
    start: float  # the clock when the step's buffer opened
    time: float  # when the buffer was complete
    started: list[Task] = field(default_factory=list)  # tasks started while it filled
    given_up: list[Task] = field(default_factory=list)  # dropped out or past the timeout
    discarded: list[Task] = field(default_factory=list)  # attackers' stale updates they did not send
    waves: int = 0  # rounds of messages it took


def admit_waiting(waiting: list[Task], buffer: list[Arrival], k: int, version: int, at: float) -> list[Task]:
    """A new buffer opens with the updates that waited (their client was in the last one), in the
    order they arrived, one per client, up to K; returns those that wait on."""
    still = []
    for task in sorted(waiting, key=lambda t: (t.finish, t.number)):
        if len(buffer) < k and task.pid not in {a.task.pid for a in buffer}:
            buffer.append(Arrival(task, at, version - task.version))
        else:
            still.append(task)
    return still


class AttackerSlots:
    """Which slots are the attackers' and which attacker takes a freed one (module docstring)."""

    def __init__(self, attackers: list[int], attack) -> None:
        self.attackers = sorted(attackers)
        self.schedule = attack.schedule if attack is not None else None
        self.pooled = self.schedule is None or self.schedule.name == "fixed_pool"  # sampled like everyone
        self.count = 0 if self.pooled else min(self.schedule.attackers_per_round, len(self.attackers))
        self._next = 0

    def state_dict(self) -> dict:
        return {"next": self._next}

    def load_state_dict(self, state: dict) -> None:
        self._next = int(state["next"])

    def take(self, slot: int, version: int, busy: set[int]) -> int | None:
        """The attacker that starts in `slot` from `version` (round robin over those not busy), or
        None: not an attacker's slot, a step the schedule does not attack, or every attacker busy."""
        if slot >= self.count or not self.schedule.is_attack_round(version + 1):
            return None
        n = len(self.attackers)
        for i in range(n):
            candidate = self.attackers[(self._next + i) % n]
            if candidate not in busy:
                self._next = (self._next + i + 1) % n
                return candidate
        return None


class AsyncFederation:
    """The slots, the held updates and the model version of an asynchronous run."""

    def __init__(self, policy, federation, clock, attackers: list[int], attack, seed: int,
                 prepare: Callable[[Task], None]) -> None:
        self.k, self.c, self.timeout = policy.buffer_size, policy.in_flight(federation), policy.timeout
        self.clock, self.seed, self.prepare = clock, seed, prepare
        self.num_clients = federation.num_clients
        self.attacker_slots = AttackerSlots(attackers, attack)
        self.attacker_set = set(attackers)
        self.reporting = clock.systems.attackers.reporting
        self.retry = clock.systems.idle_seconds  # a slot nobody can take is tried again this much later
        self.version, self.now, self.next_number = 0, 0.0, 1
        self.slots: list[Task | None] = [None] * self.c
        self.vacant: dict[int, float] = {}  # slot -> when to try filling it again
        self.waiting: list[Task] = []  # arrived while their client was in the buffer: the next buffer's
        self.opened = False  # the first step fills every slot
        self._attacker_mask = np.zeros(self.num_clients, dtype=bool)
        self._attacker_mask[sorted(attackers)] = True

    # --- starting tasks --------------------------------------------------------------------------
    def busy(self) -> set[int]:
        """Clients training now (one whose update waits at the server for a later buffer is free)."""
        return {t.pid for t in self.slots if t is not None}

    def fill(self, slot: int, t: float, started: list[Task]) -> None:
        """Start a task in `slot` at time `t` from the current version (or mark the slot vacant)."""
        number = self.next_number
        busy = self.busy()
        pid = self.attacker_slots.take(slot, self.version, busy)
        if pid is None:
            free = self.clock.available_at(t, number).copy()
            if busy:
                free[np.fromiter(busy, dtype=np.int64)] = False
            if not self.attacker_slots.pooled:
                free &= ~self._attacker_mask
            candidates = np.flatnonzero(free)
            if len(candidates) == 0:
                self.slots[slot] = None
                self.vacant[slot] = t + self.retry
                return
            pid = int(candidates[numpy_rng(self.seed, SAMPLE, 0, number).integers(len(candidates))])
        self.next_number += 1
        attacker = pid in self.attacker_set
        kept_on = attacker and self.clock.systems.attackers.always_on
        task = Task(number, pid, self.version, t, slot, attacker, dropped=not kept_on and self.clock.drops_out(pid, number))
        self.prepare(task)
        self.slots[slot] = task
        self.vacant.pop(slot, None)
        started.append(task)

    # --- one server step ---------------------------------------------------------------------------
    def step(self, train: Callable[[list[Task]], None], server_seconds: float = 0.0) -> Step:
        """Run the clock until the buffer holds K updates; `train(tasks)` trains a wave (setting
        each task's `finish` and `reply`). The version advances; the slots freed by the arrivals
        that completed the buffer start again after the server's `server_seconds`."""
        out = Step([], self.now, self.now)
        buffer, timeout = out.arrivals, self.timeout
        if not self.opened:
            self.opened = True
            for slot in range(self.c):
                self.fill(slot, self.now, out.started)
        self.waiting = admit_waiting(self.waiting, buffer, self.k, self.version, self.now)
        refill: list[int] = []  # slots to start after the step
        while len(buffer) < self.k:
            events = [(t.event_time(timeout), 1, t.number, t) for t in self.slots
                      if t is not None and not t.holding and t.event_time(timeout) is not None]
            events += [(when, 0, slot, None) for slot, when in self.vacant.items()]
            untrained = [t for t in self.slots if t is not None and not t.dropped and t.finish is None]
            first = min(events, key=lambda e: e[:3]) if events else None
            if untrained and (first is None or min(t.bound for t in untrained) <= first[0]):
                train(untrained)
                out.waves += 1
                continue
            if first is None:
                raise RuntimeError("no client in flight and no slot to fill: the asynchronous federation stalled")
            when, kind, key, task = first
            if task is None:  # a vacant slot tries again
                self.fill(key, when, out.started)
                continue
            self.arrive(task, when, buffer, out, refill)
        out.time = buffer[-1].time if buffer else self.now
        self.version += 1
        self.now = out.time + server_seconds
        for slot in refill:
            self.fill(slot, self.now, out.started)
        return out

    def arrive(self, task: Task, when: float, buffer: list[Arrival], out: Step, refill: list[int]) -> None:
        """The server hears of `task` at `when`."""
        slot = task.slot
        self.slots[slot] = None
        if not task.arrives(self.timeout):
            out.given_up.append(task)
            self.fill(slot, when, out.started)
            return
        staleness = self.version - task.version
        timed = task.attacker and self.reporting == "buffer_timed"
        if task.attacker and self.reporting in ("fresh_only", "buffer_timed") and staleness > 0:
            out.discarded.append(task)
            self.fill(slot, when, out.started)
            return
        if timed:
            task.holding = True
            self.slots[slot] = task  # keeps its slot: it has not reported
        elif task.pid in {a.task.pid for a in buffer}:
            self.waiting.append(task)
            self.fill(slot, when, out.started)
        else:
            buffer.append(Arrival(task, when, staleness))
            if len(buffer) == self.k:
                refill.append(slot)
            else:
                self.fill(slot, when, out.started)
        held = sorted((t for t in self.slots if t is not None and t.holding), key=lambda t: (t.finish, t.number))
        if held and len(buffer) + len(held) >= self.k:  # the held attackers complete the buffer together
            for t in held[: self.k - len(buffer)]:
                t.holding = False
                self.slots[t.slot] = None
                buffer.append(Arrival(t, when, self.version - t.version))
                refill.append(t.slot)

    # --- what survives ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Plain data for a checkpoint, taken when a step has closed (its buffer applied)."""
        return {"version": self.version, "now": self.now, "next_number": self.next_number, "opened": self.opened,
                "slots": [None if t is None else t.state() for t in self.slots],
                "waiting": [t.state() for t in self.waiting], "vacant": {str(k): v for k, v in self.vacant.items()},
                "attackers": self.attacker_slots.state_dict()}

    def load_state_dict(self, state: dict) -> list[Task]:
        """Back to a checkpoint's state; returns the tasks that had trained (their replies were not
        kept: they must be trained again, from the same model version, before they are used)."""
        self.version, self.now = int(state["version"]), float(state["now"])
        self.next_number, self.opened = int(state["next_number"]), bool(state["opened"])
        self.slots = [None if t is None else Task.from_state(t) for t in state["slots"]]
        self.waiting = [Task.from_state(t) for t in state["waiting"]]
        self.vacant = {int(k): float(v) for k, v in state["vacant"].items()}
        self.attacker_slots.load_state_dict(state["attackers"])
        return [t for t in [*self.slots, *self.waiting] if t is not None and t.finish is not None and not t.dropped]

    def versions_in_use(self) -> set[int]:
        """Model versions some task in flight or waiting still trains from or was trained from."""
        return {t.version for t in self.slots if t is not None} | {t.version for t in self.waiting}

    def in_flight(self) -> int:
        return sum(t is not None for t in self.slots)
