"""Flower's internals behind one door: every probe holds on the installed Flower, no other
module of fedsim (nor a benchmark) names a non-public Flower module, and none outside
fedsim/flower/ assigns to an attribute of Flower's or Ray's.

After a Flower upgrade, run this file first: a failing probe names what is gone and what fedsim
falls back to (docs/architecture.md, "Upgrading Flower")."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from fedsim.flower import compat as flower_compat

REPO = Path(__file__).resolve().parents[1]
# public: flwr.app, flwr.serverapp(.strategy), flwr.clientapp, flwr.simulation (run_simulation)
NON_PUBLIC = re.compile(r"flwr\.(server|superlink|supercore|supernode|common|proto|cli)(\.[\w.:]*)?"
                        r"|flwr\.(simulation|clientapp|app)\.[\w.:]+")
COMPAT = REPO / "fedsim" / "flower" / "compat.py"
DOOR = REPO / "fedsim" / "flower"  # the only folder that may write Flower's or Ray's attributes


@pytest.mark.parametrize("name", sorted(flower_compat.PROBES))
def test_probe_holds_on_the_installed_flower(name):
    probe = flower_compat.PROBES[name]
    missing = probe.missing()
    assert not missing, (f"Flower changed: {name} ({probe.what}) lacks {missing}; fedsim falls back to "
                         f"{probe.fallback}. Re-check fedsim/flower/compat.py against the new Flower.")


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
    sources = [p for d in ("fedsim", "aggregators", "attacks", "defenses", "leakage", "benchmarks")
               for p in (REPO / d).rglob("*.py") if p != COMPAT]
    offenders = []
    for path in sources:
        for text in _code_strings(ast.parse(path.read_text())):
            if NON_PUBLIC.fullmatch(text.strip()):
                offenders.append(f"{path.relative_to(REPO)}: {text}")
    assert not offenders, "non-public Flower API outside fedsim/flower/compat.py:\n" + "\n".join(offenders)


def _flower_or_ray_names(tree: ast.AST) -> set[str]:
    """Names that stand for Flower's or Ray's objects: imported from flwr or ray, or unpacked from
    a call into the compat module (`vce_api = compat.engine_modules()`, as simulate.py once did)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names if a.name.split(".")[0] in ("flwr", "ray")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ("flwr", "ray"):
            names |= {a.asname or a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module == "fedsim.flower":
            names |= {a.asname or a.name for a in node.names if a.name == "compat"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            func = node.value.func
            while isinstance(func, ast.Attribute):
                func = func.value
            if isinstance(func, ast.Name) and func.id in names:
                for target in node.targets:
                    names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
    return names


def flower_attribute_writes(source: str) -> list[str]:
    """`X.attr = ...`, `X.a.b += ...`, `setattr(X, ...)` and `del X.attr` on a Flower or Ray name X."""
    tree = ast.parse(source)
    names = _flower_or_ray_names(tree)

    def root(node):
        while isinstance(node, ast.Attribute):
            node = node.value
        return node.id if isinstance(node, ast.Name) else None

    out = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr") \
                and node.args:
            targets = [ast.Attribute(value=node.args[0], attr="?")]
        for target in targets:
            for t in (target.elts if isinstance(target, ast.Tuple) else [target]):
                if isinstance(t, ast.Attribute) and root(t) in names:
                    out.append(f"line {node.lineno}: {ast.unparse(t)}")
    return out


def test_the_guard_sees_writes_to_flower_attributes():
    """What simulate.py did before the door was closed, and the other forms of the same write."""
    before = (
        "from fedsim.flower import compat as flower_compat\n"
        "vce_api, raybackend, actor_pool = flower_compat.engine_modules()\n"
        "vce_api._register_nodes, vce_api.add_messages_to_queue = 1, 2\n"
        "import ray\nray.util.x += 1\n"
        "from flwr.serverapp import Grid\nsetattr(Grid, 'send', None)\n"
        "class Mine:\n    def __init__(self):\n        self.x = 1\n"
    )
    found = flower_attribute_writes(before)
    assert [w.split(": ")[1] for w in found] == ["vce_api._register_nodes", "vce_api.add_messages_to_queue",
                                                 "ray.util.x", "Grid.?"], found


def test_no_assignment_to_flower_or_ray_attributes_outside_the_door():
    sources = [p for d in ("fedsim", "aggregators", "attacks", "defenses", "leakage", "benchmarks")
               for p in (REPO / d).rglob("*.py") if DOOR not in p.parents]
    offenders = [f"{path.relative_to(REPO)} {write}" for path in sources
                 for write in flower_attribute_writes(path.read_text())]
    assert not offenders, "writes to Flower's or Ray's attributes outside fedsim/flower/:\n" + "\n".join(offenders)
