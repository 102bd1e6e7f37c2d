"""The ready scenarios that ship with fedsim, found from any folder.

`scenarios/` sits at the repository's top level and is installed as package data of
`fedsim.scenarios` (pyproject.toml), so `fedsim run scenarios/quickstart.yaml` and
`fedsim run quickstart.yaml` work after a regular install from any working directory.
"""

from __future__ import annotations

from pathlib import Path

import yaml


def scenarios_dir() -> Path | None:
    """The ready scenarios: the installed copy inside the package, else the source tree's."""
    package = Path(__file__).resolve().parent
    for candidate in (package / "scenarios", package.parent / "scenarios"):
        if (candidate / "quickstart.yaml").is_file():
            return candidate
    return None


def resolve_scenario_path(path: str | Path) -> Path:
    """`path` itself when it exists; else, for a relative path, the ready scenario of that name
    (with or without a leading `scenarios/`); else `path` unchanged (the caller reports it missing)."""
    path = Path(path)
    if path.exists() or path.is_absolute():
        return path
    ready = scenarios_dir()
    if ready is None:
        return path
    rel = Path(*path.parts[1:]) if path.parts and path.parts[0] == "scenarios" and len(path.parts) > 1 else path
    for candidate in (ready / rel, ready / rel.with_suffix(".yaml")):
        if candidate.is_file():
            return candidate
    return path


def ready_scenarios() -> list[tuple[str, str]]:
    """(path to give `fedsim run`, the scenario's name or the sweep's grid) for every ready scenario."""
    ready = scenarios_dir()
    if ready is None:
        return []
    out = []
    for file in sorted(ready.rglob("*.yaml")):
        try:
            raw = yaml.safe_load(file.read_text()) or {}
        except yaml.YAMLError:
            continue
        what = str(raw.get("name", file.stem)) if isinstance(raw, dict) else file.stem
        if isinstance(raw, dict) and isinstance(raw.get("sweep"), dict):
            what += " (sweep over " + ", ".join(map(str, raw["sweep"])) + ")"
        out.append((f"scenarios/{file.relative_to(ready).as_posix()}", what))
    return out
