"""Stopping a run on Ctrl-C or SIGTERM: within seconds, keeping every completed round, resumable.

A simulated run has two threads that matter: the main thread, where Flower's simulation engine
runs and owns Ray, and the ServerApp thread (Flower's, not a daemon), which spends most of a round
waiting for replies in `Grid.send_and_receive`. A `KeyboardInterrupt` in the main thread alone
stops Ray, and then the interpreter waits for the ServerApp thread, still waiting for replies
that can no longer come (up to `federation.round_timeout`, 600 s by default).

So a run carries a stop event. `on_signals` turns the first SIGINT or SIGTERM into: set the event,
raise `RunInterrupted` in the main thread (the engine unwinds and stops Ray). The ServerApp's grid
is a `StoppableGrid` (fedsim/flower/stoppable_grid.py), whose wait for replies ends with `RunStopped` once the event is set: the
round in flight is abandoned, and every completed round already has its line in rounds.jsonl and
its checkpoint. A second signal exits at once (`os._exit`), without tracebacks.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time


SIGNAL_NAMES = {signal.SIGINT: "SIGINT", signal.SIGTERM: "SIGTERM"}


class RunInterrupted(BaseException):
    """Raised in the main thread by the first SIGINT/SIGTERM. A BaseException, like
    KeyboardInterrupt, so that Flower's `except Exception` handlers let it through."""

    def __init__(self, signum: int) -> None:
        super().__init__(SIGNAL_NAMES.get(signum, str(signum)))
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # the shell's convention: 130 for SIGINT, 143 for SIGTERM


@contextlib.contextmanager
def on_signals(stop: threading.Event, signals: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)):
    """While inside, the first of `signals` sets `stop` and raises RunInterrupted in the main thread;
    a second one ends the process at once. Must be entered in the main thread.

    The yielded handle's `reinstall()` puts the handlers back after a library replaced them:
    `ray.init` installs its own SIGTERM handler, which exits with code 1 (`simulate` calls it
    right after Ray has started).
    """
    state = {"first": None}

    def handler(signum, frame):
        if state["first"] is not None:  # the user insists: no cleanup, no traceback
            os.write(2, b"\nstopped\n")
            os._exit(128 + signum)
        state["first"] = signum
        stop.set()
        raise RunInterrupted(signum)

    previous = {s: signal.getsignal(s) for s in signals}

    class Handle:
        @staticmethod
        def reinstall() -> None:
            if threading.current_thread() is threading.main_thread():
                for s in signals:
                    signal.signal(s, handler)

    Handle.reinstall()
    try:
        yield Handle
    finally:
        for s, h in previous.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)


def wait_for_threads(seconds: float) -> bool:
    """Wait up to `seconds` for the process's other non-daemon threads; True if they all ended."""
    deadline = time.monotonic() + seconds
    for thread in threading.enumerate():
        if thread is threading.current_thread() or thread.daemon:
            continue
        thread.join(max(0.0, deadline - time.monotonic()))
    return not any(t.is_alive() and not t.daemon and t is not threading.current_thread() for t in threading.enumerate())


def exit_now(code: int) -> None:
    """End the process with `code` without waiting for stuck threads (output flushed first)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
