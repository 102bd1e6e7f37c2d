"""Closing a round: checkpoint, central evaluation, the round's line in rounds.jsonl, its timings.

With `evaluation.overlap` the central evaluation of round t runs in a background thread while
round t+1 trains (torch releases the GIL, so spare cores evaluate while the clients train), at most
one round behind: lines are written in round order, round t's checkpoint is saved before its line,
and the last round's evaluation finishes before the run ends. Per-round timings (encode, waiting
for clients, decode, aggregation, evaluation) go to the `fedsim.timing` logger, not to rounds.jsonl,
whose lines stay identical from run to run except `wall_seconds`.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

import torch

from fedsim.server.record import RoundRecord

timing_log = logging.getLogger("fedsim.timing")  # one INFO record per round, the seconds in `record.fedsim_timing`


class Background:
    """One call in its own (non-daemon) thread; `result()` joins it and re-raises its error.

    A thread per round rather than a pool: nothing is left running when a run stops halfway, and
    the interpreter still waits for a line being evaluated before it exits.
    """

    def __init__(self, fn: Callable, args: tuple) -> None:
        self.value, self.error = None, None
        self.thread = threading.Thread(target=self._run, args=(fn, args), name="fedsim-evaluation")
        self.thread.start()

    def _run(self, fn: Callable, args: tuple) -> None:
        try:
            self.value = fn(*args)
        except BaseException as err:  # handed to whoever waits for the result
            self.error = err

    def result(self):
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.value


class RoundCloser:
    """Closes each round of a driver (fedsim/server/driver.py): `close(rnd)` returns the round's
    line as numbers (None while it is written in the background)."""

    def __init__(self, driver, on_round: Callable[[dict], None] | None = None, overlap: bool | None = None,
                 defer_last_round: bool = False) -> None:
        self.driver = driver
        self.evaluation = driver.scenario.evaluation
        self.rounds = driver.scenario.federation.rounds
        self.on_round = on_round or (lambda record: None)
        self.overlap = self.evaluation.overlap if overlap is None else overlap
        self.defer_last_round = defer_last_round  # evaluate the last round in the background too (see drive_server)
        self._closing: Background | None = None  # the previous round's evaluation and line, if still running
        self._line_at: float | None = None  # when the last round line of this run was written
        # torch threads of an evaluation in line: the process's count now. Set explicitly wherever
        # an evaluation runs: torch's count is per thread, but a thread's first parallel op (and,
        # measured, some later ones) picks up the count last set by *any* thread, e.g. 1 by an
        # evaluation beside training.
        self._inline_threads = torch.get_num_threads()

    def close(self, rnd: int) -> dict | None:
        """Checkpoint round `rnd` (absolute), then evaluate the global model and write the round's line.

        With overlap the evaluation and the line are handed to a background thread and the next
        round starts at once; before that, the previous round's line is waited for, so lines stay
        in order and at most one evaluation runs beside training (the two newest checkpoints kept on
        disk then always include one whose line is written). The last round is closed before
        returning, so the run ends with every line written.
        """
        driver, ev = self.driver, self.evaluation
        last = rnd == self.rounds
        if rnd == 0 and not ev.initial:
            return None
        record = RoundRecord(0) if rnd == 0 else driver.pending
        timing = driver.timing.pop(rnd, {})
        t_wait = time.perf_counter()
        self.wait()
        timing["evaluation_wait"] = time.perf_counter() - t_wait
        if driver.report is not None:
            driver.evaluator.use_shared(driver.report[1])
            driver.report = None
        if rnd:
            driver.checkpoint(rnd)  # before the line: a written line always has its checkpoint
        evaluate = rnd == 0 or rnd % ev.every == 0 or last
        model = driver.global_model() if evaluate else None  # a snapshot: the next round replaces the global model
        # what inference-time defenses deploy by after this round (Lockdown's mask counts), snapshotted with it
        deployed = driver.pipeline.deployed_states() if evaluate and driver.pipeline is not None and rnd else None
        close = (rnd, record, model, deployed, timing, driver.started)
        if self.overlap and (not last or self.defer_last_round):
            # beside the next round: one thread by default (the client actors have the cores);
            # the last round's, deferred past the engine's shutdown: as many as in line
            threads = ev.threads or (self._inline_threads if last else 1)
            self._closing = Background(self._close_in_background, (threads, *close))
            return None
        threads = torch.get_num_threads()
        torch.set_num_threads(ev.threads or self._inline_threads)
        try:
            return self._close(*close)
        finally:
            torch.set_num_threads(threads)

    def wait(self) -> None:
        """Block until the previous round's line is written; re-raise its error, if any."""
        closing, self._closing = self._closing, None
        if closing is not None:
            closing.result()

    def _close_in_background(self, threads: int, *close) -> dict:
        # A multi-threaded evaluation beside the client actors only oversubscribes the cores they
        # already fill (measured in docs/performance.md); set here, in this thread (see _inline_threads).
        torch.set_num_threads(threads)
        return self._close(*close)

    def _close(self, rnd: int, record: RoundRecord, model, deployed: list | None, timing: dict, started: float) -> dict:
        """Evaluate (if `model` is given), then write the round's line; runs in the background thread
        or, for the last round and without overlap, in the server thread."""
        if model is not None:
            t_eval = time.perf_counter()
            record.update(self.driver.evaluator(model, rnd, deployed))
            timing["evaluate"] = time.perf_counter() - t_eval
        now = time.perf_counter()
        if rnd:
            # seconds since the previous round's line (the round's own start for the first one):
            # with overlapping evaluation, the rounds' wall_seconds add up to the run's time in rounds
            record.wall_seconds = now - (self._line_at if self._line_at is not None else started)
            self._line_at = now
        else:
            record.wall_seconds = 0.0
        line = record.to_json()
        self.on_round(line)
        timing["wall"] = record.wall_seconds
        timing_log.info("round %s timing (s): %s", rnd, ", ".join(f"{k} {v:.3f}" for k, v in timing.items()),
                        extra={"fedsim_round": rnd, "fedsim_timing": dict(timing)})
        return {k: v for k, v in line.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
