"""One benchmark at a time on a machine: the timing benchmarks take this lock in their main.

A benchmark beside another one times the other's work as its own, so each waits for the lock
before measuring. The lock file is `fedsim-bench.lock` in the system's temp folder
(`tempfile.gettempdir()`, i.e. $TMPDIR or /tmp), found at run time rather than written into the
benchmarks, so the same command works on any machine: `.venv/bin/python benchmarks/overhead.py`.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

NAME = "fedsim-bench.lock"
# Set while a benchmark holds the lock, for its child processes: a benchmark started by another
# one (benchmarks/sweep.py runs overhead.py's loop) runs under its parent's lock instead of
# waiting for it forever.
HELD = "FEDSIM_BENCH_LOCK_HELD"


def lock_path() -> Path:
    return Path(tempfile.gettempdir()) / NAME


@contextlib.contextmanager
def bench_lock() -> Iterator[Path | None]:
    """Hold the machine's benchmark lock for the block (an exclusive `flock`); say so when waiting."""
    if os.environ.get(HELD):
        yield None
        return
    path = lock_path()
    try:  # read-only: a lock file another user created stays usable (flock needs no write access)
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for {path}: another benchmark is running", file=sys.stderr, flush=True)
            fcntl.flock(fd, fcntl.LOCK_EX)
        os.environ[HELD] = str(os.getpid())
        try:
            yield path
        finally:
            os.environ.pop(HELD, None)
    finally:
        os.close(fd)  # releases the lock
