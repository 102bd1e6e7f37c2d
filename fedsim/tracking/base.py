"""What every tracking sink shares (they register in fedsim.registry.TRACKING_SINKS): its calling convention and the flattening of a
round line, a summary or the scenario into the flat names the tracking libraries take.

A sink's parameters are validated with the scenario (clients validate it too), so this module and
the sinks' parameter models import no tracking library: each sink imports its own in `open`, on
the server, and `require` checks beforehand that it is installed.
"""

from __future__ import annotations

import importlib.util
import json
import math
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from fedsim.registry import Params

EXTRA = "pip install 'fedsim[tracking]'"


class TrackingUnavailable(RuntimeError):
    """A configured sink whose library is not installed: raised before the first round."""


def require(sink: str, modules: tuple[str, ...]) -> None:
    """Raise TrackingUnavailable naming the extra when one of `modules` cannot be imported."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise TrackingUnavailable(
            f"tracking sink {sink!r} needs {', '.join(missing)}, which is not installed: {EXTRA} "
            f"(or remove {sink} from the scenario's tracking list)")


class SinkParams(Params):
    """What every sink takes: the step its lines are logged at."""

    step: Literal["round", "sim_ms"] = Field(
        "round", description="the step of each round line: its round, or (on the federation clock, `systems:`) the "
        "simulated milliseconds since the run's start at the round's close, so curves run against simulated time")


class Sink(ABC):
    """One tracking library's side of a run. `Trackers` calls, in this order: `open` once (at the
    first round line of this start), `log_metrics` per round line, then `finish` with the summary
    and the plots, or `close` for a run that stopped early. The folder of each run is `run_dir`;
    `name` (the run folder's name) names the run in the library's own UI."""

    def __init__(self, spec, run_dir: Path, name: str, state: dict) -> None:
        self.spec, self.run_dir, self.name = spec, run_dir, name
        self.state = state  # this sink's entry of the run folder's tracking.json (ids to resume by)

    @abstractmethod
    def open(self, params: dict[str, Any], first_step: int, resumed: bool = False) -> None:
        """Start (or, from `state`, continue) the library's run; `params` is the flat scenario;
        `first_step` the step of the first line this start logs; `resumed`: this start continues
        a run (its first line is after a checkpoint)."""

    @abstractmethod
    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """One round line's numbers, at its step: its round, or its simulated milliseconds (`step: sim_ms`)."""

    @abstractmethod
    def finish(self, summary: dict[str, float], step: int, plots: list[Path]) -> None:
        """The summary's numbers (`summary/...`), the report's figures, then end the run as finished."""

    @abstractmethod
    def close(self) -> None:
        """End the run without a summary (the run stopped early; a resume may continue it)."""


def flat_metrics(record: dict, skip: frozenset[str] = frozenset()) -> dict[str, float]:
    """The finite numbers of a round line or summary, nested dicts joined with '/'
    (`detection/tpr`, `bytes_up_per_client/3`); strings, lists, booleans, None and NaN left out,
    as rounds.jsonl writes NaN as null. Top-level keys in `skip` are left out too."""
    out: dict[str, float] = {}

    def walk(node: dict, prefix: str) -> None:
        for key, value in node.items():
            name = f"{prefix}{key}"
            if isinstance(value, dict):
                walk(value, name + "/")
            elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                out[name] = float(value)

    walk({k: v for k, v in record.items() if k not in skip}, "")
    return out


def flat_params(scenario: dict) -> dict[str, Any]:
    """The resolved scenario as `section.key` parameters (the names `--set` takes); lists and
    mappings inside lists stay whole values (`defenses`: a list of components)."""
    out: dict[str, Any] = {}

    def walk(node: dict, prefix: str) -> None:
        for key, value in node.items():
            if isinstance(value, dict) and value:
                walk(value, f"{prefix}{key}.")
            else:
                out[f"{prefix}{key}"] = value

    walk(scenario, "")
    return out


def param_text(value: Any) -> str:
    """A parameter as text: strings as they are, everything else as JSON (`true`, `null`, `[64]`)."""
    return value if isinstance(value, str) else json.dumps(value)
