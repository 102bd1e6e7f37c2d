"""The ready scenarios that ship with fedsim, found from any folder.

`scenarios/` sits at the repository's top level and is installed as package data of
`fedsim.scenarios` (pyproject.toml), so `fedsim run scenarios/quickstart.yaml` and
`fedsim run quickstart.yaml` work after a regular install from any working directory.
"""

from __future__ import annotations

import re
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
    try:
        if path.exists() or path.is_absolute():
            return path
    except OSError:  # e.g. a name too long for the file system: the caller reports it
        return path
    ready = scenarios_dir()
    if ready is None:
        return path
    for candidate in _ready_candidates(path, ready):
        if candidate.is_file():
            return candidate
    return path


def _ready_candidates(path: Path, ready: Path) -> list[Path]:
    rel = Path(*path.parts[1:]) if path.parts and path.parts[0] == "scenarios" and len(path.parts) > 1 else path
    return [ready / rel, ready / rel.with_suffix(".yaml")]


def missing_file_message(path: str | Path) -> str:
    """Why `path` was not found: every place looked at, and where the ready scenarios are listed."""
    path = Path(path)
    looked = [path.resolve()]
    ready = scenarios_dir()
    if ready is not None and not path.is_absolute():
        looked += _ready_candidates(path, ready)
    return ("no such file; looked for " + ", ".join(map(str, dict.fromkeys(looked)))
            + " (`fedsim list scenarios` shows the ready scenarios)")


def description(text: str) -> str:
    """A scenario file's one-line description: the first sentence of its leading comment, and its
    `# Variant:` line when it has one (the paper scenarios share their first sentence)."""
    head = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        head.append(line.lstrip("#").strip())
    paragraph = " ".join(head).split("  ")[0]
    first = paragraph.split(". ")[0].rstrip(".")
    variant = next((line for line in head if line.startswith("Variant:")), None)
    if variant:
        first = re.sub(r",?\s*\(see the variant line\)", "", first)
    return (first + "." if first else "") + (f" {variant}" if variant else "")


def ready_scenarios() -> list[tuple[str, str, str]]:
    """(path to give `fedsim run`, the scenario's name or the sweep's grid, one-line description)
    for every ready scenario."""
    ready = scenarios_dir()
    if ready is None:
        return []
    out = []
    for file in sorted(ready.rglob("*.yaml")):
        text = file.read_text(encoding="utf-8")
        try:
            raw = yaml.safe_load(text) or {}
        except yaml.YAMLError:
            continue
        what = str(raw.get("name", file.stem)) if isinstance(raw, dict) else file.stem
        if isinstance(raw, dict) and isinstance(raw.get("sweep"), dict):
            what += " (sweep over " + ", ".join(map(str, raw["sweep"])) + ")"
        out.append((f"scenarios/{file.relative_to(ready).as_posix()}", what, description(text)))
    return out
