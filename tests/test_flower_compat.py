"""Flower's internals behind one door: every probe holds on the installed Flower, and no other
module of fedsim (nor a benchmark) names a non-public Flower module.

After a Flower upgrade, run this file first: a failing probe names what is gone and what fedsim
falls back to (docs/architecture.md, "Upgrading Flower")."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from fedsim.engine import flower_compat

REPO = Path(__file__).resolve().parents[1]
# public: flwr.app, flwr.serverapp(.strategy), flwr.clientapp, flwr.simulation (run_simulation)
NON_PUBLIC = re.compile(r"flwr\.(server|superlink|supercore|supernode|common|proto|cli)(\.[\w.:]*)?"
                        r"|flwr\.(simulation|clientapp|app)\.[\w.:]+")
COMPAT = REPO / "fedsim" / "engine" / "flower_compat.py"


@pytest.mark.parametrize("name", sorted(flower_compat.PROBES))
def test_probe_holds_on_the_installed_flower(name):
    probe = flower_compat.PROBES[name]
    missing = probe.missing()
    assert not missing, (f"Flower changed: {name} ({probe.what}) lacks {missing}; fedsim falls back to "
                         f"{probe.fallback}. Re-check fedsim/engine/flower_compat.py against the new Flower.")


def test_a_missing_name_is_reported_with_its_fallback(monkeypatch):
    probe = flower_compat.Probe("gone", "a test", ("flwr.app:NoSuchThing", "no_such_module:x"), "the stock behaviour")
    assert probe.missing() == ["flwr.app:NoSuchThing", "no_such_module:x"] and not probe.holds()
    monkeypatch.setitem(flower_compat.PROBES, "gone", probe)
    with pytest.raises(flower_compat.FlowerCompatError, match="fallback: the stock behaviour"):
        flower_compat.require("gone")


def _code_strings(tree: ast.AST) -> list[str]:
    """Imported module names and string constants that are not docstrings."""
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.append(node.module)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            out.append(node.value)
    return out


def test_non_public_flower_names_appear_only_in_flower_compat():
    sources = [p for d in ("fedsim", "aggregators", "attacks", "defenses", "benchmarks")
               for p in (REPO / d).rglob("*.py") if p != COMPAT]
    offenders = []
    for path in sources:
        for text in _code_strings(ast.parse(path.read_text())):
            if NON_PUBLIC.fullmatch(text.strip()):
                offenders.append(f"{path.relative_to(REPO)}: {text}")
    assert not offenders, "non-public Flower API outside fedsim/engine/flower_compat.py:\n" + "\n".join(offenders)
