"""What the machine's CPUs did during a benchmark: busy cores from /proc/stat, the CPU seconds of a
process tree (Ray's processes included), and a wait for a quiet machine. Shared by
benchmarks/overhead.py and benchmarks/peers.py; it imports nothing of fedsim, whose engine sets
Ray's and OpenBLAS's environment defaults in the importing process (a plain loop must not inherit
them)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path


def cpu_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine since boot."""
    with open("/proc/stat") as fh:
        fields = [int(v) for v in fh.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    total = sum(fields[:8])  # guest time is already counted in user
    return total - idle, total


def cores_busy(start: tuple[int, int], end: tuple[int, int]) -> float:
    busy, total = end[0] - start[0], end[1] - start[1]
    return (os.cpu_count() or 1) * busy / max(total, 1)


class TreeCPU:
    """CPU seconds used by this process and all its descendants (Ray's processes included), sampled
    from /proc every 0.2 s, so that the machine's busy time can be split into ours and others'."""

    def __init__(self) -> None:
        self.first: dict[int, float] = {}
        self.last: dict[int, float] = {}
        self.stop = threading.Event()
        self.tick = os.sysconf("SC_CLK_TCK")
        self._sample()
        self.first = dict(self.last)
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _sample(self) -> None:
        parent, cpu = {}, {}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                parent[int(entry.name)] = int(fields[1])
                cpu[int(entry.name)] = (int(fields[11]) + int(fields[12])) / self.tick  # utime + stime
        ours, todo = set(), [os.getpid()]
        while todo:
            pid = todo.pop()
            ours.add(pid)
            todo.extend(p for p, pp in parent.items() if pp == pid and p not in ours)
        for pid in ours:
            if pid in cpu:
                self.last[pid] = cpu[pid]

    def _loop(self) -> None:
        while not self.stop.wait(0.2):
            self._sample()

    def seconds(self) -> float:
        self.stop.set()
        self.thread.join()
        self._sample()
        return sum(v - self.first.get(pid, 0.0) for pid, v in self.last.items())


def wait_for_quiet(max_seconds: float, threshold: float = 0.25) -> float:
    """Wait (up to `max_seconds`) until the machine has been under `threshold` cores busy for 5 s;
    returns the background load last seen. Other work on the machine skews both sides' times."""
    deadline, load = time.monotonic() + max_seconds, float("nan")
    while True:
        start = cpu_jiffies()
        time.sleep(5)
        load = cores_busy(start, cpu_jiffies())
        if load < threshold or time.monotonic() > deadline:
            return load
