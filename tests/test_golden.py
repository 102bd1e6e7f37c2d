"""Golden metrics (issue #17): small in-process runs whose rounds.jsonl lines must not change.

Each scenario of tests/golden/make_golden.py (the quickstart; multikrum + norm clipping; top-k with
error feedback; Cuttlefish low-rank; DETOX; FedMA; a top-k run killed after round 2 and resumed)
is rerun here on the in-process LocalGrid and its lines (without the wall-clock times) compared
with tests/golden/<scenario>.json, recorded from commit 8f604e1, before the refactors of #16/#17.

Comparison, recursive over the lines: keys, ints, bools, strings, None and lists (client ids,
groups, widths) must be exactly equal; floats must agree to math.isclose(rel_tol=1e-6,
abs_tol=1e-9): the same code gives bit-identical numbers on one machine, but on another x86 CPU
(another SIMD path in BLAS / PyTorch kernels) the last bits of sums may differ. Anything beyond that
is a change in behaviour. If a change is meant to alter metrics, regenerate with
tests/golden/make_golden.py and say so in the commit; otherwise fix the regression, not the goldens.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

GOLDEN = Path(__file__).resolve().parent / "golden"

_spec = importlib.util.spec_from_file_location("make_golden", GOLDEN / "make_golden.py")
make_golden = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_golden)

REL_TOL, ABS_TOL = 1e-6, 1e-9
# Cuttlefish trains the factorized model (U V^T layers) after its switch in round 2: there the last-bit
# differences of another CPU's kernels grow round by round (measured on an AMD EPYC against the
# recording machine: 1.6e-6 relative in round 3's loss, 1.1e-3 in an update norm of round 5). Its
# ints, ranks, parameter counts and client lists stay exact; a change in behaviour moves its floats
# by far more than this.
REL_TOL_OF = {"cuttlefish": 1e-2}
# Fields added to rounds.jsonl after the recording, each checked by its own tests:
# `detection` (issue #19's detection audit: tests/test_detection.py), `backdoor_success_beyond_clean`
# (issue #20: tests/test_central_evaluation.py), `rounds_since_attack` (issue #20: tests/test_lifecycle.py).
ADDED_SINCE = {"detection", "backdoor_success_beyond_clean", "rounds_since_attack"}


def differences(want, got, path: str, rel_tol: float = REL_TOL) -> list[str]:
    """Every place where `got` differs from `want`, as 'path: golden X, now Y'."""
    if isinstance(want, dict):
        if not isinstance(got, dict):
            return [f"{path}: golden a dict, now {got!r}"]
        out = [f"{path}.{k}: missing now (golden {want[k]!r})" for k in want if k not in got]
        out += [f"{path}.{k}: new key (now {got[k]!r})" for k in got if k not in want]
        for k in want:
            if k in got:
                out += differences(want[k], got[k], f"{path}.{k}", rel_tol)
        return out
    if isinstance(want, list):
        if not isinstance(got, list):
            return [f"{path}: golden a list, now {got!r}"]
        if len(want) != len(got):
            return [f"{path}: golden {len(want)} items {want!r}, now {len(got)} items {got!r}"]
        return [d for i, (w, g) in enumerate(zip(want, got)) for d in differences(w, g, f"{path}[{i}]", rel_tol)]
    if isinstance(want, float) and isinstance(got, float) and not isinstance(got, bool):
        same = (math.isnan(want) and math.isnan(got)) or math.isclose(want, got, rel_tol=rel_tol, abs_tol=ABS_TOL)
        return [] if same else [f"{path}: golden {want!r}, now {got!r}"]
    if type(want) is not type(got) or want != got:  # ints, bools, strings, None: exact, type included
        return [f"{path}: golden {want!r}, now {got!r}"]
    return []


@pytest.mark.parametrize("name", list(make_golden.SCENARIOS))
def test_metrics_equal_the_golden_run(tmp_path, name):
    golden = json.loads((GOLDEN / f"{name}.json").read_text())
    rounds = make_golden.run_scenario(name, tmp_path)
    # round trip through JSON as the golden file was (tuples -> lists, int keys -> str)
    rounds = json.loads(json.dumps(rounds))
    rounds = [{k: v for k, v in r.items() if k not in ADDED_SINCE} for r in rounds]
    problems = []
    if [r.get("round") for r in rounds] != [r["round"] for r in golden]:
        problems.append(f"rounds: golden {[r['round'] for r in golden]}, now {[r.get('round') for r in rounds]}")
    for want, got in zip(golden, rounds):
        problems += differences(want, got, f"round {want['round']}", REL_TOL_OF.get(name, REL_TOL))
    assert not problems, f"scenario {name}: {len(problems)} difference(s) from tests/golden/{name}.json\n  " + \
        "\n  ".join(problems[:30])


def test_comparison_reports_scenario_paths():
    assert differences({"a": [1.0, {"b": 2}]}, {"a": [1.0 + 1e-9, {"b": 2}]}, "round 1") == []
    assert differences({"a": [1.0, {"b": 2}]}, {"a": [1.1, {"b": 3}]}, "round 1") == [
        "round 1.a[0]: golden 1.0, now 1.1", "round 1.a[1].b: golden 2, now 3"]
    assert differences({"x": 1}, {"x": 1.0}, "r") == ["r.x: golden 1, now 1.0"]
    assert differences({"x": True}, {"x": 1}, "r") == ["r.x: golden True, now 1"]
    assert differences({"x": [1, 2]}, {"x": [2, 1]}, "r") == ["r.x[0]: golden 1, now 2", "r.x[1]: golden 2, now 1"]
    assert differences({"x": 1}, {"y": 1}, "r") == ["r.x: missing now (golden 1)", "r.y: new key (now 1)"]
