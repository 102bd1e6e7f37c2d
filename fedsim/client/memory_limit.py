"""`federation.client_memory_gb`: the most memory a client's process may hold while it runs a message.

Why a watchdog, and not something Ray or the kernel offers: Ray's `memory` resource only schedules
(Ray places no more actors on a node than their declared memory fits there, and never looks at
what an actor then uses); Ray's memory monitor kills a worker only when the whole node runs short,
and the client is then a lost actor, not a failed message; RLIMIT_AS caps address space, which
torch and its thread pools reserve far beyond what they touch, so a cap that means anything breaks
the import. So the client's process watches itself: while a message runs, a thread samples the
process's resident set size (/proc/self/statm) every `SAMPLE_SECONDS`; over the limit, it raises
`ClientMemoryExceeded` in the thread running the message (CPython's asynchronous exception,
delivered at that thread's next Python bytecode, i.e. once the torch operation in progress
returns). The message then fails with a reason naming the limit and the peak measured, the
memory its frames held is freed and handed back to the system, and the process answers its next
message as usual. The simulation also declares the limit to Ray as each client actor's `memory`
(fedsim/engine/ray_start.py), so that a node hosts no more clients than their limits fit.

What is measured: the whole process's resident memory, the interpreter, torch, the data and the
model it keeps between messages included (a quickstart client holds ~0.4 GB before it trains);
not swap, not GPU memory. It is sampled, so a spike shorter than a sample can pass unseen, and a
single allocation larger than the machine's memory meets the OOM killer first (a lost actor,
recorded as such). In a cohort (several clients' messages in one actor task,
fedsim/engine/cohorts.py) the limit is still the process's: the cohort's vectorised training
(fedsim/client/cohort.py) runs under it, and a cohort that goes over it trains its clients one by
one instead, each message then under the limit on its own.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import threading
from typing import Callable, TypeVar

T = TypeVar("T")

SAMPLE_SECONDS = 0.005
GB = 1024**3
_PAGE = os.sysconf("SC_PAGE_SIZE")


def resident_bytes() -> int:
    """This process's resident set size now (bytes)."""
    with open("/proc/self/statm", "rb") as fh:
        return int(fh.read().split()[1]) * _PAGE


class ClientMemoryExceeded(MemoryError):
    """Raised asynchronously in the thread running a message whose process went over the limit."""


class MemoryLimitExceeded(MemoryError):
    """The message failed: its process went over `federation.client_memory_gb`."""


def _raise_in(thread_id: int, exc: type[BaseException] | None) -> None:
    """Raise `exc` in thread `thread_id` at its next bytecode (None: withdraw one not yet delivered)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(exc) if exc else None)


class Watch:
    """Samples this process's resident memory while armed; over `limit` bytes, raises
    `ClientMemoryExceeded` once in `thread_id`."""

    def __init__(self, limit: int, thread_id: int) -> None:
        self.limit, self.thread_id = limit, thread_id
        self.peak = resident_bytes()
        self.over = self.peak > limit
        self.raised = False
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._sample, name="fedsim-memory-limit", daemon=True)

    def _sample(self) -> None:
        while not self.stopped.wait(SAMPLE_SECONDS):
            self.note(resident_bytes())

    def note(self, rss: int) -> None:
        with self.lock:
            if self.stopped.is_set():
                return
            self.peak = max(self.peak, rss)
            if rss > self.limit:
                self.over = True
                if not self.raised:
                    self.raised = True
                    _raise_in(self.thread_id, ClientMemoryExceeded)

    def stop(self) -> None:
        """Disarm (idempotent): no exception is raised after this returns, and one not yet delivered is withdrawn."""
        with self.lock:
            if not self.stopped.is_set():
                self.stopped.set()
                if self.raised:
                    _raise_in(self.thread_id, None)
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join()

    def reason(self, limit_gb: float) -> str:
        return f"client exceeded federation.client_memory_gb={limit_gb:g} (peak {self.peak / GB:.2f} GB)"


def run_limited(limit_gb: float | None, fn: Callable[[], T]) -> T:
    """`fn()`, with this process's resident memory held under `limit_gb` GB while it runs (None: no
    limit). Over it, `fn` is interrupted (or, if it finished inside one long native call, its
    result dropped) and `MemoryLimitExceeded` is raised with the limit and the peak measured."""
    if not limit_gb:
        return fn()
    watch = Watch(int(limit_gb * GB), threading.get_ident())
    interrupted = False
    try:
        try:
            if not watch.over:  # already over: the message does not start
                watch.thread.start()
                result = fn()
        finally:
            watch.stop()
    except ClientMemoryExceeded:
        interrupted = True  # fn's frames, and the memory they held, go with this handler
    if interrupted:
        watch.stop()
    if interrupted or watch.over:
        result = None
        release_memory()
        raise MemoryLimitExceeded(watch.reason(limit_gb))
    return result


def release_memory() -> None:
    """Collect what the interrupted message left and hand freed heap memory back to the system
    (glibc keeps up to fedsim's trim threshold for reuse: fedsim/engine/allocator.py)."""
    gc.collect()
    libc = ctypes.util.find_library("c")
    if libc:
        try:
            ctypes.CDLL(libc).malloc_trim(0)
        except (OSError, AttributeError):  # not glibc
            pass
