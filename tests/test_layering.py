"""The house has floors: no two rooms import each other, directly or round a loop (docs/architecture.md).

A room is a folder of fedsim/ (fedsim/server/, ...), a top-level module of fedsim/ (fedsim/wire.py),
a component folder (aggregators/, attacks/, defenses/, leakage/) or benchmarks/. Imports inside functions
count too: a lazy import still ties two rooms. Imports made by text ("module:attribute" references
in the registries, importlib) do not, by design: that is how a protocol's server and client parts
stay out of the scenario's schema."""

from __future__ import annotations

import ast
import collections
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ALIASES = {"aggregators": "fedsim.aggregators", "attacks": "fedsim.attacks", "defenses": "fedsim.defenses",
           "leakage": "fedsim.leakage"}


def module_of(path: str) -> str:
    parts = path[:-3].split("/")
    parts = ALIASES.get(parts[0], parts[0]).split(".") + parts[1:]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def room_of(path: str) -> str:
    parts = path.split("/")
    if parts[0] != "fedsim":
        return parts[0] + "/"
    return "/".join(parts[:2]) + "/" if len(parts) > 2 else path


def room_imports(files: dict[str, str]) -> dict[str, set[str]]:
    """{room: rooms it imports}, from each file's import statements (a package's __init__ is skipped:
    importing fedsim.server.x runs fedsim/server/__init__.py, which is the same room)."""
    owner = {module_of(f): f for f in files}
    edges: dict[str, set[str]] = collections.defaultdict(set)
    for path, text in files.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            for name in names:
                target = owner.get(name)
                if target is not None and room_of(target) != room_of(path):
                    edges[room_of(path)].add(room_of(target))
    return edges


def loops(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Pairs of rooms that reach each other through imports."""
    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in edges.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    reached = {room: reach(room) for room in list(edges)}
    return sorted({tuple(sorted((a, b))) for a in reached for b in reached[a] if a != b and a in reached.get(b, ())})


def test_the_check_finds_a_loop():
    files = {"fedsim/a/x.py": "from fedsim.b.y import f\n", "fedsim/b/y.py": "def f():\n    from fedsim.a.x import g\n",
             "fedsim/c.py": "import fedsim.a.x\n"}
    assert loops(room_imports(files)) == [("fedsim/a/", "fedsim/b/")]


def test_no_two_rooms_import_each_other():
    try:
        listed = subprocess.run(["git", "ls-files", "*.py"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as err:
        pytest.skip(f"needs the git checkout to list the tracked files: {err}")
    files = {f: (REPO / f).read_text() for f in listed.split()
             if f.startswith(("fedsim/", "aggregators/", "attacks/", "defenses/", "leakage/", "benchmarks/"))
             and (REPO / f).exists()}
    assert loops(room_imports(files)) == [], "rooms that import each other (an import runs back up a floor)"
