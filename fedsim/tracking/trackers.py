"""`Trackers`: the scenario's tracking sinks, fed by the server as the run folder is written.

The server hands each round line to `log_round` as it appends it to rounds.jsonl, and the summary
to `finish` once summary.json is written (or calls `close` when the run stops early). Tracking is
a copy of what the run folder holds, never a part of the run: a sink that raises is warned about
once and dropped for the rest of the run, which goes on (a tracking server gone away must not
cost a day of training, nor stall every round in the library's retries).
"""

from __future__ import annotations

import json
import logging
import tempfile
import threading
from pathlib import Path
from typing import Callable

from fedsim.runs.folder import RunFolder
from fedsim.scenario import scenario_dict
from fedsim.registry import TRACKING_SINKS
from fedsim.tracking.base import Sink, flat_metrics, flat_params, require

log = logging.getLogger("fedsim.tracking")

STATE_FILE = "tracking.json"  # in the run folder: the sinks' run ids, so a resumed run continues them
# summary.json entries that are not results: the scenario goes as parameters, the rest is bookkeeping
NOT_SUMMARY_METRICS = frozenset({"scenario", "versions", "seed", "name", "run_dir", "attackers"})


class Trackers:
    """The run's sinks: opened at the first round line of a start, finished with the summary."""

    def __init__(self, sinks: list[Sink], params: dict, run_dir: RunFolder, state: dict) -> None:
        self.params, self.run_dir = params, run_dir
        self.state = state  # {sink name: its ids}, each sink holding its own entry; saved to STATE_FILE
        self.waiting = list(sinks)  # not opened yet: opened at the first round line of this start
        self.live: list[Sink] = []
        self.last_step: int | None = None  # the round of the last line logged
        self.last_steps: dict[str, int] = {}  # sink name -> the step of the last line it logged
        # lines arrive from the evaluation thread; a run stopped by an error closes from the server's
        self._lock = threading.Lock()

    @classmethod
    def of(cls, scenario, run_dir: Path | RunFolder) -> "Trackers":
        """The sinks the scenario's `tracking` names, for this run folder; nothing is opened yet.
        Raises TrackingUnavailable for a sink whose library is not installed: before any round,
        rather than at validation, which the clients (without tracking libraries) also run."""
        folder = RunFolder.of(run_dir)
        require_libraries(scenario)
        entries = [TRACKING_SINKS.get(spec.name) for spec in scenario.tracking]
        state = read_state(folder) if entries else {}
        for spec in scenario.tracking:
            if not isinstance(state.get(spec.name), dict):
                state[spec.name] = {}
        sinks = [entry.obj(spec, folder.path, folder.path.name, state[spec.name]) for entry, spec in zip(entries, scenario.tracking)]
        return cls(sinks, flat_params(scenario_dict(scenario)) if sinks else {}, folder, state)  # no sink: no work

    def __bool__(self) -> bool:
        return bool(self.waiting or self.live)

    def log_round(self, record: dict) -> None:
        """One rounds.jsonl line: its numbers at its step, each sink's (opening the sinks at the first)."""
        with self._lock:
            if not self:
                return
            rnd = int(record["round"])
            if self.waiting:
                self._open(rnd, record)
            metrics = flat_metrics(record, skip=frozenset({"round"}))
            self._each(f"log round {rnd}", lambda sink: sink.log_metrics(metrics, step_of(sink, record)))
            self.last_step = rnd
            self.last_steps = {sink.spec.name: step_of(sink, record) for sink in self.live}

    def finish(self, summary: dict) -> None:
        """The summary's numbers and the report's figures; ends every sink's run as finished."""
        with self._lock:
            step = summary.get("rounds_completed") or self.last_step or 0
            if self.waiting:  # resumed after its last line, before its summary: no line to open them at
                self._open(step + 1, {"round": step + 1})
            if not self.live:
                return
            metrics = flat_metrics(summary, skip=NOT_SUMMARY_METRICS)
            with tempfile.TemporaryDirectory(prefix="fedsim-plots-") as tmp:
                plots = self._plots(Path(tmp))
                self._each("log the summary", lambda sink: sink.finish(metrics, self.last_steps.get(sink.spec.name, step), plots))
            self.live = []

    def close(self) -> None:
        """End the sinks' runs without a summary: the run stopped early (a resume continues them)."""
        with self._lock:
            for sink in self.live:
                try:
                    sink.close()
                except Exception as err:
                    log.warning("tracking sink %s failed to close: %s: %s", sink.spec.name, type(err).__name__, err)
            self.live, self.waiting = [], []

    def _open(self, first_round: int, record: dict) -> None:
        sinks, self.waiting = self.waiting, []
        self.live = sinks
        self._each("start", lambda sink: sink.open(self.params, step_of(sink, record), resumed=first_round > 1))
        ids = {name: entry for name, entry in self.state.items() if entry}
        try:
            if ids:
                self.run_dir.path.joinpath(STATE_FILE).write_text(json.dumps(ids, indent=2) + "\n")
        except OSError as err:
            log.warning("tracking: could not write %s (a resumed run will start new tracking runs): %s", STATE_FILE, err)

    def _plots(self, out: Path) -> list[Path]:
        """The report's per-run figures (fedsim report's curves), drawn from rounds.jsonl; none if that fails."""
        try:
            from fedsim.runs.report import plot_curves

            return plot_curves([self.run_dir.path], out)
        except Exception as err:  # a figure is a nicety: the summary is still logged
            log.warning("tracking: could not draw the run's curves, logging none: %s: %s", type(err).__name__, err)
            return []

    def _each(self, what: str, call: Callable[[Sink], None]) -> None:
        """`call` on every live sink; one that raises is warned about once and dropped."""
        for sink in list(self.live):
            try:
                call(sink)
            except Exception as err:
                self.live.remove(sink)
                log.warning("tracking sink %s failed to %s and logs nothing more in this run (the run goes on): %s: %s",
                            sink.spec.name, what, type(err).__name__, err)
                try:  # let go of what it holds (W&B's service, an MLflow run left RUNNING)
                    sink.close()
                except Exception as more:
                    log.debug("tracking sink %s: close after the failure also failed: %r", sink.spec.name, more)


def step_of(sink: Sink, record: dict) -> int:
    """The step a sink logs a round line at: its round, or its simulated milliseconds at the round's
    close (`step: sim_ms`; the run's start for round 0 and for a line that has none)."""
    if getattr(sink.spec, "step", "round") == "sim_ms":
        return int(round(1000.0 * float(record.get("sim_time") or 0.0)))
    return int(record["round"])


def require_libraries(scenario) -> None:
    """Raise TrackingUnavailable, naming the extra, when a sink the scenario names lacks its library."""
    for spec in scenario.tracking:
        entry = TRACKING_SINKS.get(spec.name)
        require(entry.name, entry.traits.requires)


def read_state(folder: RunFolder) -> dict:
    """The sinks' ids from an earlier start of this run folder ({} when none or unreadable)."""
    try:
        state = json.loads((folder.path / STATE_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}
