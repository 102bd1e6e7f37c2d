"""Sweeps: one scenario file with a `sweep:` section expands into a grid of runs.

```yaml
name: tails_grid
...                                   # any scenario
sweep:
  attack.mode: [blackbox, pgd_replacement]
  defenses: [[], [{name: norm_clipping, delta: 1.0}]]
  seed: [0, 1]
```

A swept key that is not a scenario section is a *case axis*: each of its values is a mapping of
dotted scenario keys set together, with an optional `label` naming the case (a robust rule and a
defense are one case: `aggregator: fedavg, defenses: [flame]`). A value sets its key whole; one
that sets a plain section (a mapping naming no component) while the scenario sets other keys
there is refused, naming them, since they would fall back to their defaults unseen
(`federation.batch_size: 2`, not `federation: {batch_size: 2}`):

```yaml
sweep:
  defense:
    - {label: none, aggregator: fedavg, defenses: []}
    - {label: flame, aggregator: fedavg, defenses: [flame]}
    - {label: krum, aggregator: {name: krum, num_malicious: 2}}
  attack: [null, {name: alie, num_attackers: 10}]
```

A sweep file may start from another scenario with `base: relative/path.yaml`; its own keys are
merged over the base (mappings key by key, except that a component mapping with a different
`name` replaces the base's; everything else is replaced). Every combination is
validated before anything runs. Runs live in `<output.dir>/<name>/<run
name>/` with names made from the swept values, so a rerun of the sweep skips finished runs
(`summary.json` present) and resumes interrupted ones from their checkpoints.
"""

from __future__ import annotations

import copy
import itertools
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedsim.runs.atomic import write_text_atomic
from fedsim.runs.folder import RunFolder
from fedsim.scenario import ScenarioError, apply_overrides, read_yaml, validate_scenario


@dataclass(frozen=True)
class SweepRun:
    name: str
    values: dict[str, Any]  # swept key -> value
    scenario: Any


MAX_RUNS = 10_000  # combinations a sweep may expand to (each is validated, then run)


def _json(value: Any) -> str:
    """Sorted JSON of a YAML value; keys of mixed types (YAML allows them) are compared as text."""
    try:
        return json.dumps(value, sort_keys=True, default=str)
    except TypeError:
        def text_keys(v):
            if isinstance(v, dict):
                return {str(k): text_keys(x) for k, x in v.items()}
            return [text_keys(x) for x in v] if isinstance(v, list) else v
        return json.dumps(text_keys(value), sort_keys=True, default=str)


def _token(value: Any) -> str:
    """A short, file-name-safe rendering of a swept value (any YAML value: keys and names need not be strings)."""
    if isinstance(value, dict):
        text = str(value["name"]) if "name" in value else _json(value)[:60]
        extra = {str(k): v for k, v in value.items() if k != "name"}
        if extra:
            text += "-" + "-".join(f"{k}{_token(v)}" for k, v in sorted(extra.items()))
    elif isinstance(value, list):
        text = "+".join(_token(v) for v in value) or "none"
    else:
        text = str(value)
    return re.sub(r"[^A-Za-z0-9_.+-]", "", text)[:60]


def _set(raw: dict, key: str, value: Any) -> None:
    """Set a dotted key to a (structured) value, like `--set` does for text values."""
    node = raw
    parts = str(key).split(".")
    for i, part in enumerate(parts[:-1]):
        if isinstance(node.get(part), str):
            node[part] = {"name": node[part]}
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            where = ".".join(parts[: i + 1])
            raise ScenarioError("sweep", [(f"sweep.{key}", f"{where} is a {type(node).__name__}, not a section", node)])
    node[parts[-1]] = copy.deepcopy(value)


def scenario_sections() -> set[str]:
    """The scenario's top-level keys: a swept key outside them is a case axis."""
    from fedsim.scenario import scenario_model

    return set(scenario_model().model_fields)


def _case_settings(path, axis: str, case: Any) -> list[tuple[str, Any]]:
    """The (dotted key, value) pairs one value of a case axis sets."""
    if not isinstance(case, dict) or not case or not all(isinstance(k, str) for k in case):
        raise ScenarioError(str(path), [(f"sweep.{axis}", f"{axis} is not a scenario section, so each of its values must be "
                                         "a mapping of scenario keys to set together (a case), with an optional label", case)])
    return [(k, v) for k, v in case.items() if k != "label"]


def _case_label(case: dict) -> str:
    return _token(case["label"]) if "label" in case else "-".join(_token(v) for k, v in case.items())


def deep_merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in over.items():
        both_maps = isinstance(value, dict) and isinstance(out.get(key), dict)
        renamed = both_maps and "name" in value and out[key].get("name") != value["name"]
        if both_maps and not renamed:  # merge; a mapping naming another component replaces the base's
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def expand(path: str | Path, overrides: list[str] | None = None) -> tuple[str, list[SweepRun]]:
    """The sweep's name and its runs, each validated; all problems are reported together."""
    grid = Grid.read(path, overrides)
    return grid.name, grid.validated()


@dataclass
class Grid:
    """A sweep file read: the scenario its runs start from and the swept values. Reading it is
    cheap; expanding and validating the runs imports every component, torch included, so
    `fedsim sweep` starts Ray in between (fedsim/engine/shared.py)."""

    path: Path
    name: str
    base: dict  # the scenario every run starts from: the base file, the sweep's keys, the overrides
    axes: dict[str, list]  # swept key -> its values

    @classmethod
    def read(cls, path: str | Path, overrides: list[str] | None = None) -> "Grid":
        from fedsim.scenario_files import resolve_scenario_path

        path = resolve_scenario_path(path)  # a ready sweep by name, from any folder
        raw = read_yaml(path)
        if isinstance(raw, dict) and "base" in raw:
            if not isinstance(raw["base"], str):
                raise ScenarioError(str(path), [("base", "a path to the scenario this sweep starts from (text)", raw["base"])])
            base_path = Path(path).parent / raw.pop("base")
            raw = deep_merge(read_yaml(base_path), raw)
        if not isinstance(raw, dict) or not isinstance(raw.get("sweep"), dict) or not raw["sweep"]:
            raise ScenarioError(str(path), [("sweep", "a sweep file needs a `sweep:` mapping of KEY: [values]", raw.get("sweep") if isinstance(raw, dict) else raw)])
        axes = raw.pop("sweep")
        bad = [(f"sweep.{k}", "swept keys are dotted scenario paths (text)", k) for k in axes if not isinstance(k, str)]
        bad += [(f"sweep.{k}", "each swept key needs a non-empty list of values", v) for k, v in axes.items() if not isinstance(v, list) or not v]
        if bad:
            raise ScenarioError(str(path), bad)
        raw = apply_overrides(raw, list(overrides or []))
        total = 1
        for k in axes:
            total *= len(axes[k])
            if total > MAX_RUNS:
                raise ScenarioError(str(path), [("sweep", f"expands to more than {MAX_RUNS} runs; split the grid", {k: len(axes[k]) for k in axes})])
        return cls(Path(path), str(raw.get("name", Path(path).stem)), raw, axes)

    def only(self, selections: list[str]) -> "Grid":
        """The grid cut to a slice: each `AXIS=LABEL[,LABEL...]` keeps those values of one swept key
        (a case's label, or a plain value as its run name writes it). Run names are the full grid's,
        so a slice's runs land in the same folders and the whole grid, run later, skips them."""
        axes = dict(self.axes)
        for text in selections:
            axis, eq, labels = text.partition("=")
            if not eq or axis not in axes or not labels:
                raise ScenarioError(str(self.path), [("--only", f"AXIS=LABEL[,LABEL...] with AXIS one of the swept keys {sorted(self.axes)}", text)])
            known = {self.value_label(axis, v): v for v in self.axes[axis]}
            wanted = [w.strip() for w in labels.split(",")]
            missing = [w for w in wanted if w not in known]
            if missing:
                raise ScenarioError(str(self.path), [(f"--only {axis}", f"no such value; the swept values are {list(known)}", ",".join(missing))])
            axes[axis] = [known[w] for w in known if w in wanted]  # grid order
        return Grid(self.path, self.name, self.base, axes)

    def value_label(self, axis: str, value: Any) -> str:
        """How one value of a swept key appears in run names: a case's label, a plain value's token."""
        return _case_label(value) if axis.split(".")[0] not in scenario_sections() and isinstance(value, dict) else _token(value)

    def cases(self) -> list[tuple[str, dict, dict]]:
        """(run name, swept values, scenario dict) of every run, in grid order."""
        keys = list(self.axes)
        cases = {k for k in keys if k.split(".")[0] not in scenario_sections()}
        out = []
        for combo in itertools.product(*(self.axes[k] for k in keys)):
            values = dict(zip(keys, combo))
            this = copy.deepcopy(self.base)
            for k, v in values.items():
                for key, value in (_case_settings(self.path, k, v) if k in cases else [(k, v)]):
                    self._check_whole_section(this, k, v, key, value)
                    _set(this, key, value)
            name = "__".join(f"{k.split('.')[-1]}={_case_label(v) if k in cases else _token(v)}" for k, v in values.items())
            this["name"] = re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:150]
            out.append((name, values, this))
        return out

    def _check_whole_section(self, raw: dict, axis: str, case: Any, key: str, value: Any) -> None:
        """A swept value sets `key` as a whole. Where that is a plain section (a mapping naming no
        component, e.g. `federation`) and the scenario so far has keys there the value leaves out,
        those keys would silently fall back to their defaults: refused, naming them."""
        node: Any = raw
        for part in str(key).split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if not (isinstance(node, dict) and isinstance(value, dict)) or "name" in node or "name" in value:
            return
        lost = sorted(str(k) for k in node if k not in value)
        if lost:
            first = next(iter(value), "KEY")
            label = f"[{_case_label(case)}]" if isinstance(case, dict) else ""
            raise ScenarioError(str(self.path), [(f"sweep.{axis}{label}", f"sets the section `{key}` as a whole, which would drop "
                                                  f"what the scenario sets there ({', '.join(lost)}): set dotted keys "
                                                  f"instead ({key}.{first}: ...), or repeat those keys to replace it on purpose",
                                                  value)])

    def validated(self) -> list[SweepRun]:
        """Each run validated; all problems are reported together."""
        runs, problems = [], []
        for name, values, raw in self.cases():
            try:
                runs.append(SweepRun(raw["name"], values, validate_scenario(raw, f"{self.path} [{name}]")))
            except ScenarioError as err:
                problems += [(f"[{name}] {p}", m, v) for p, m, v in err.problems]
        if problems:
            raise ScenarioError(str(self.path), problems)
        return runs


def sweep_dir(name: str, runs: list[SweepRun], parent: str | Path | None) -> Path:
    base = Path(parent if parent is not None else runs[0].scenario.output.dir)
    return base / name


def prepare(run: SweepRun, folder: Path) -> Path:
    """The run's folder, with its resolved scenario (kept if already there: it may be resumed)."""
    run_dir = RunFolder.at(folder / run.name, run.scenario, replace_scenario=True).path
    write_text_atomic(run_dir / "sweep.json", _json(run.values) + "\n")
    return run_dir


def is_done(run_dir: Path) -> bool:
    return (run_dir / "summary.json").exists()


def run_sweep(folder: Path, runs: list[SweepRun], runner, on_done=None, jobs: int = 1) -> list[Path]:
    """Run every unfinished run with `runner(scenario, run_dir)`; returns all run folders, in grid order.

    An unfinished folder is handed to the runner as it is, so the runner resumes it from its
    checkpoints; a finished one (summary.json) is skipped. `jobs` > 1: that many runs in flight at
    once, each in a thread of this process (the runner shares one engine between them,
    fedsim/engine/shared.py); the first run that raises stops new runs from starting, and is
    raised once the runs in flight have ended.
    """
    todo = [run for run in runs if not is_done(folder / run.name)]
    if jobs <= 1:
        for run in todo:
            runner(run.scenario, prepare(run, folder))
            if on_done is not None:
                on_done(run)
    else:
        _run_in_threads(folder, todo, runner, on_done, jobs)
    return [folder / run.name for run in runs]


def _run_in_threads(folder: Path, todo: list[SweepRun], runner, on_done, jobs: int) -> None:
    from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

    pending, active, failure = list(todo), {}, None
    with ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="fedsim-run") as pool:
        try:
            while pending or active:
                while pending and failure is None and len(active) < jobs:
                    run = pending.pop(0)
                    active[pool.submit(runner, run.scenario, prepare(run, folder))] = run
                if not active:
                    break
                done, _ = wait(list(active), timeout=0.2, return_when=FIRST_COMPLETED)
                for future in done:
                    run = active.pop(future)
                    if future.exception() is not None:
                        failure = failure or future.exception()
                    elif on_done is not None:
                        on_done(run)
        except BaseException:  # an interrupt in this thread: the runs in flight see the sweep's stop event
            wait(list(active))
            raise
    if failure is not None:
        raise failure
