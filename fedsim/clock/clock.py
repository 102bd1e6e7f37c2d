"""The federation clock: when each round starts and closes, who is there, and what each client's
part of a round costs in simulated seconds.

A client's part of a round (`ClientTime`):
    download = bytes of the message it received · 8 / its downlink + its latency
    compute  = samples it trained on · the model's training FLOPs per sample / its FLOP/s
    upload   = bytes of the reply it sent · 8 / its uplink + its latency
Bytes are the serialized records that crossed the wire (fedsim/wire.py), samples what its
training really processed (every epoch's batches, an attacker's extra passes included), FLOPs
counted once per model shape (fedsim/clock/cost.py). The round policy (fedsim/clock/config.py)
closes the round from the clients' finish times; the server then takes `systems.server_seconds`
before the next round starts. Nothing here reads this machine's clock unless `server_seconds:
measured` asks for it, so the same scenario and seed give the same times anywhere.

With `systems.jitter` each of a client's three times is also multiplied by a factor drawn for that
client and round, exp(jitter · N(0, 1)): random straggling on top of the fixed device differences.

Availability at a round's start: a client is checked in unless its local hour is outside the
diurnal window or it drew `offline` this round; a selected client drops out with probability
`dropout`. Draws are seeded by the round, for all clients at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fedsim.clock.adacomm import AdaCommPeriod
from fedsim.clock.profiles import draw_profiles
from fedsim.seeding import CLOCK, numpy_rng


@dataclass(frozen=True)
class ClientTime:
    down: float
    compute: float
    up: float

    @property
    def total(self) -> float:
        return self.down + self.compute + self.up


class FederationClock:
    def __init__(self, systems, num_clients: int, attackers: list[int], seed: int) -> None:
        self.systems, self.num_clients, self.seed = systems, num_clients, seed
        self.attackers = np.asarray(sorted(attackers), dtype=np.int64)
        self.profiles = draw_profiles(systems, num_clients, attackers, seed)
        self.now = 0.0  # simulated seconds since the run's start: the next round starts here
        self.starts: dict[int, float] = {}  # round -> its start (kept: a resumed run re-samples earlier rounds)
        self.adacomm = AdaCommPeriod(systems.adacomm) if systems.adacomm is not None else None
        self._mask: tuple[int, np.ndarray] | None = None  # the last round's checked-in mask
        self._slowdown: tuple[int, np.ndarray] | None = None  # the last round's jitter factors

    # --- who is there ----------------------------------------------------------------------------
    def start_of(self, rnd: int) -> float:
        """When round `rnd` starts (the clock's present for the round about to open)."""
        return self.starts.setdefault(rnd, self.now)

    def checked_in(self, rnd: int) -> np.ndarray:
        """A boolean mask over all clients: checked in at round `rnd`'s start."""
        if self._mask is not None and self._mask[0] == rnd:
            return self._mask[1]
        mask = self._available(self.start_of(rnd), (1 + rnd, 0))
        self._mask = (rnd, mask)
        return mask

    def available_at(self, t: float, task: int) -> np.ndarray:
        """Asynchronous protocols: who could start task number `task` at simulated time `t` (the
        diurnal window at `t`; the `offline` draw is the task's own)."""
        return self._available(t, (0, task, 0))

    def _available(self, t: float, key: tuple[int, ...]) -> np.ndarray:
        avail = self.systems.availability
        mask = np.ones(self.num_clients, dtype=bool)
        if avail.diurnal is not None:
            d = avail.diurnal
            hour_utc = (self.systems.start_hour + t / 3600.0) % 24.0
            local = (hour_utc + self.profiles.timezone) % 24.0
            mask &= ((local - d.start_hour) % 24.0) < d.hours
        if avail.offline > 0:
            mask &= numpy_rng(self.seed, CLOCK, *key).random(self.num_clients) >= avail.offline
        if self.systems.attackers.always_on and len(self.attackers):
            mask[self.attackers] = True
        return mask

    def dropouts(self, rnd: int, selected: list[int]) -> list[int]:
        """The selected clients that disappear during round `rnd` (their work never arrives)."""
        p = self.systems.availability.dropout
        if p <= 0 or not selected:
            return []
        draws = numpy_rng(self.seed, CLOCK, 1 + rnd, 1).random(self.num_clients)  # by client id: order-free
        keep_on = set(self.attackers.tolist()) if self.systems.attackers.always_on else set()
        return [c for c in selected if draws[c] < p and c not in keep_on]

    def drops_out(self, pid: int, task: int) -> bool:
        """Asynchronous protocols: whether client `pid` disappears during task number `task`."""
        p = self.systems.availability.dropout
        return p > 0 and bool(numpy_rng(self.seed, CLOCK, 0, task, 1).random() < p)

    # --- what a client's part costs --------------------------------------------------------------
    def client_time(self, pid: int, bytes_down: int, samples: int, flops_per_sample: float, bytes_up: int,
                    rnd: int | None = None, task: int | None = None) -> ClientTime:
        """Client `pid`'s download, compute and upload seconds; with `systems.jitter`, each scaled by
        that client's factor for round `rnd` (asynchronous protocols: for task number `task`)."""
        prof = self.profiles
        latency = float(prof.latency_s[pid])
        slow = 1.0
        if self.systems.jitter > 0 and task is not None:
            slow = float(np.exp(self.systems.jitter * numpy_rng(self.seed, CLOCK, 0, task, 2).standard_normal()))
        elif self.systems.jitter > 0 and rnd is not None:
            slow = self.slowdown(rnd)[pid]
        return ClientTime(
            down=(bytes_down * 8.0 / float(prof.down_bps[pid]) + latency) * slow,
            compute=samples * flops_per_sample / (float(prof.gflops[pid]) * 1e9) * slow,
            up=(bytes_up * 8.0 / float(prof.up_bps[pid]) + latency) * slow,
        )

    def slowdown(self, rnd: int) -> np.ndarray:
        """Every client's factor exp(jitter · N(0, 1)) in round `rnd` (seeded by the round)."""
        if self._slowdown is None or self._slowdown[0] != rnd:
            z = numpy_rng(self.seed, CLOCK, 1 + rnd, 2).standard_normal(self.num_clients)
            self._slowdown = (rnd, np.exp(self.systems.jitter * z))
        return self._slowdown[1]

    def close_round(self, rnd: int, duration: float, server_seconds: float) -> float:
        """The round closed `duration` seconds after its start; the next starts after the server's
        time. Returns the simulated time at the close."""
        closed = self.start_of(rnd) + duration
        self.now = closed + server_seconds
        return closed

    def local_period(self, rnd: int, last_loss: float | None, lr: float) -> int | None:
        """AdaComm's τ for round `rnd` (None without AdaComm)."""
        return None if self.adacomm is None else self.adacomm.period(self.start_of(rnd), last_loss, lr)

    # --- what survives a restart -----------------------------------------------------------------
    def state_dict(self) -> dict:
        state = {"now": self.now, "starts": {str(k): v for k, v in self.starts.items()}}
        if self.adacomm is not None:
            state["adacomm"] = self.adacomm.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.now = float(state["now"])
        self.starts = {int(k): float(v) for k, v in state["starts"].items()}
        if self.adacomm is not None and "adacomm" in state:
            self.adacomm.load_state_dict(state["adacomm"])
