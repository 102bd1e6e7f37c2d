"""`RunFolder`: the one place a run's folder is made and its files are named.

    <run>/scenario.yaml          the resolved scenario (what `--resume` reads back)
    <run>/rounds.jsonl           one line per round (fedsim/server/record.py is its schema)
    <run>/summary.json           written when the run ends
    <run>/checkpoint/round-N.pt  server state after round N (output.checkpoints)
    <run>/checkpoint/clients/    simulated clients' own state folder (error-feedback memory)
    <run>/fedsim.log             a sweep child's output (fedsim sweep --jobs N)

Whoever starts a run makes its folder (the CLI, `simulate` for a library caller, a sweep for its
runs, the ServerApp under `flwr run` where no caller exists) and passes it down; nothing below
makes one.
"""

from __future__ import annotations

import time
from pathlib import Path

from fedsim.runs.atomic import write_text_atomic
from fedsim.scenario import dump_scenario


class RunFolder:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    @classmethod
    def create(cls, scenario, parent: str | Path | None = None) -> "RunFolder":
        """A fresh `<parent>/<name>-<timestamp>/` (parent: `output.dir`) holding the resolved scenario."""
        parent = Path(parent if parent is not None else scenario.output.dir)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path, suffix = parent / f"{scenario.name}-{stamp}", 1
        while path.exists():
            suffix += 1
            path = parent / f"{scenario.name}-{stamp}-{suffix}"
        path.mkdir(parents=True)
        folder = cls(path)
        write_text_atomic(folder.scenario_file, dump_scenario(scenario))
        return folder

    @classmethod
    def at(cls, path: str | Path, scenario, replace_scenario: bool = False) -> "RunFolder":
        """The folder at `path` for `scenario`: made if missing; one that already holds a scenario
        keeps it (a run to resume) unless `replace_scenario` (a sweep writes its runs' scenarios anew)."""
        folder = cls(path)
        folder.path.mkdir(parents=True, exist_ok=True)
        if replace_scenario or not folder.scenario_file.exists():
            write_text_atomic(folder.scenario_file, dump_scenario(scenario))
        return folder

    @classmethod
    def of(cls, run: "str | Path | RunFolder") -> "RunFolder":
        """An existing folder, as a RunFolder (callers may hand down a path)."""
        return run if isinstance(run, RunFolder) else cls(run)

    @property
    def scenario_file(self) -> Path:
        return self.path / "scenario.yaml"

    @property
    def rounds_file(self) -> Path:
        return self.path / "rounds.jsonl"

    @property
    def summary_file(self) -> Path:
        return self.path / "summary.json"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoint"

    @property
    def client_states(self) -> Path:
        """The simulated clients' state folder: on a device, a node's own `state-dir` plays this part."""
        return self.checkpoints / "clients"

    @property
    def log_file(self) -> Path:
        return self.path / "fedsim.log"

    def __repr__(self) -> str:
        return f"RunFolder({str(self.path)!r})"
