"""glibc malloc settings for the processes that simulate: the server process and the Ray workers.

By default glibc serves a block above 128 KiB (a conv layer's activations, a received model's
arrays: a few MB each) with a fresh mmap, and gives memory freed at the top of a heap back to the
system past a threshold. A training or evaluation loop then faults its buffers in again, page by
page, at every step; on a virtual machine each fault is expensive. Measured here (the MNIST
scenario of benchmarks/overhead.py, fedsim alone, interleaved): 62.8-66.9 s with these settings
against 73.7-78.4 s without (docs/performance.md). With the settings below, blocks up
to 32 MiB come from the heap and up to 256 MiB of freed memory stays with the process for reuse,
so a process keeps its peak footprint (the Ray workers are fedsim's own; `simulate` also sets them
in the calling process, for the rest of its life).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os

MMAP_THRESHOLD = 32 * 1024**2  # glibc's ceiling for this setting on 64-bit systems
TRIM_THRESHOLD = 256 * 1024**2
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters, from glibc's malloc.h


def tunables() -> str:
    """The settings as GLIBC_TUNABLES, read by a process at its start."""
    return f"glibc.malloc.mmap_threshold={MMAP_THRESHOLD}:glibc.malloc.trim_threshold={TRIM_THRESHOLD}"


def merged_tunables(existing: str | None) -> str:
    """GLIBC_TUNABLES with fedsim's malloc settings added; a setting already given wins."""
    given = {item.split("=", 1)[0] for item in (existing or "").split(":") if item}
    ours = [item for item in tunables().split(":") if item.split("=", 1)[0] not in given]
    return ":".join(([existing] if existing else []) + ours)


@contextlib.contextmanager
def in_child_environment():
    """While inside: GLIBC_TUNABLES carries the settings (merged_tunables), so processes started
    meanwhile (a local Ray's raylet, and through it every worker) inherit them; restored after."""
    previous = os.environ.get("GLIBC_TUNABLES")
    os.environ["GLIBC_TUNABLES"] = merged_tunables(previous)
    try:
        yield
    finally:
        if previous is None:
            del os.environ["GLIBC_TUNABLES"]
        else:
            os.environ["GLIBC_TUNABLES"] = previous


_applied = False


def apply_to_this_process() -> bool:
    """Set the thresholds in this process with mallopt (glibc only; elsewhere nothing happens).
    Settings the user gave through GLIBC_TUNABLES are left as they are. True when applied."""
    global _applied
    if _applied:
        return True
    given = os.environ.get("GLIBC_TUNABLES", "")
    if "glibc.malloc." in given:
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018  (glibc only: musl's mallopt ignores these)
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _applied = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _applied
