"""Golden outputs of ByzFL's own robust rules, for tests/test_aggregators_byzfl.py.

ByzFL (`pip install byzfl`, EPFL's library by the rules' authors) is the reference for MDA, MoNNA,
Meamed, CAF, SMEA and ARC. It brings its own torch and torchvision, so it is never installed
into fedsim's environment: make a separate one outside the repository and run this file with it,
from the repository root:

    venv=$(mktemp -d)/byzfl && python3 -m venv "$venv" && "$venv/bin/pip" install byzfl==0.0.11
    "$venv/bin/python" tests/golden/make_byzfl.py      # writes tests/golden/byzfl/outputs.json

Inputs are drawn with numpy's PCG64 (`np.random.default_rng(seed)`), whose stream is the same in
every numpy version, as float32 (what fedsim's rules receive); the JSON keeps each case's recipe
(rule, kind, n, f, d, seed, parameters) and ByzFL's output, and the test rebuilds the inputs with
`make_input` below (this file imports byzfl only when run). ByzFL is given the float32 values as
float64 numpy arrays, so its arithmetic is float64.

ByzFL's CAF and SMEA estimate the largest eigenvalue with one power-method step from an unseeded
random vector, so their output can depend on the random draw. Each of their cases is run under
SEEDS_PER_CASE seeds (numpy's and torch's global seeds) and stored with `stable`: whether every
run gave the same output. The CAF cases kept are the stable ones; for SMEA the subsets ByzFL
chose under each seed are stored too (found by matching its output to a subset mean).
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import numpy as np

OUT = Path(__file__).with_name("byzfl") / "outputs.json"
SEEDS_PER_CASE = 8
KINDS = ("random", "outliers", "integer", "duplicates")


def make_input(kind: str, n: int, d: int, f: int, seed: int) -> np.ndarray:
    """[n, d] float32 inputs of one case.

    random: Gaussian rows with uneven spreads around 0.3 (no near-ties); outliers: the same with
    the last f rows pushed far away in random directions (norm ~ 100-1000); integer: entries in
    -3..3 (many exact ties in distance and value); duplicates: random rows, each of the first
    n // 3 also copied onto a later row."""
    rng = np.random.default_rng(seed)
    spread = 0.5 + 2.0 * rng.random((n, 1))
    x = rng.standard_normal((n, d)) * spread + 0.3
    if kind == "outliers" and f > 0:
        direction = rng.standard_normal((f, d))
        direction /= np.linalg.norm(direction, axis=1, keepdims=True)
        x[n - f:] += direction * rng.uniform(100.0, 1000.0, (f, 1))
    elif kind == "integer":
        x = rng.integers(-3, 4, (n, d)).astype(np.float64)
    elif kind == "duplicates":
        copies = n // 3
        x[n - copies:] = x[:copies]
    elif kind != "random" and kind != "outliers":
        raise ValueError(f"unknown kind {kind!r}")
    return x.astype(np.float32)


# (n, f, d) of each rule's cases; d = 1 is where ByzFL's one power step is exact (CAF, SMEA)
SUBSET_SIZES = [(5, 1, 4), (7, 2, 6), (9, 3, 5), (10, 4, 3), (6, 0, 3), (8, 1, 7)]
COORD_SIZES = [(5, 1, 6), (8, 3, 9), (10, 2, 5), (11, 5, 4), (6, 0, 3), (9, 4, 8)]
SPECTRAL_SIZES = [(5, 1), (7, 2), (9, 3), (10, 4), (8, 1)]
ARC_SIZES = [(9, 3, 4), (10, 3, 5), (7, 2, 6), (5, 1, 3), (6, 0, 3), (11, 5, 4), (12, 4, 3)]


def case_list() -> list[dict]:
    cases = []
    seed = 1000
    for (n, f, d), kind in itertools.product(SUBSET_SIZES, KINDS):
        seed += 1
        cases.append(dict(rule="mda", kind=kind, n=n, f=f, d=d, seed=seed, params={}))
        for anchor in (0, n // 2):
            cases.append(dict(rule="monna", kind=kind, n=n, f=f, d=d, seed=seed, params={"anchor": anchor}))
    for (n, f, d), kind in itertools.product(COORD_SIZES, ("random", "outliers", "duplicates")):
        seed += 1
        cases.append(dict(rule="meamed", kind=kind, n=n, f=f, d=d, seed=seed, params={}))
    for (n, f), kind in itertools.product(SPECTRAL_SIZES, ("random", "outliers", "duplicates")):
        for d in (1, 6):
            seed += 1
            if d > 1 and kind != "outliers":
                continue  # ByzFL's power step is random there; SMEA's random cases below
            for rule in ("caf", "smea"):
                cases.append(dict(rule=rule, kind=kind, n=n, f=f, d=d, seed=seed, params={}))
    for n, f in SPECTRAL_SIZES:  # SMEA where ByzFL's choice is random: its chosen subsets are stored
        seed += 1
        cases.append(dict(rule="smea", kind="random", n=n, f=f, d=8, seed=seed, params={}))
    for (n, f, d), kind in itertools.product(ARC_SIZES, ("random", "outliers", "duplicates")):
        seed += 1
        cases.append(dict(rule="arc", kind=kind, n=n, f=f, d=d, seed=seed, params={}))
    return cases


def subsets_with_mean(x: np.ndarray, k: int, mean: np.ndarray) -> list[list[int]]:
    """Every k-subset of rows whose mean is `mean` (ByzFL returns the mean, not the subset)."""
    return [list(s) for s in itertools.combinations(range(len(x)), k)
            if np.allclose(x[list(s)].mean(axis=0), mean, rtol=1e-12, atol=1e-12)]


def run_case(byzfl, torch, case: dict) -> dict | None:
    x = make_input(case["kind"], case["n"], case["d"], case["f"], case["seed"]).astype(np.float64)
    f = case["f"]
    rule = case["rule"]
    if rule == "mda":
        return {"output": byzfl.MDA(f)(x.copy()).tolist()}
    if rule == "monna":
        return {"output": byzfl.MoNNA(f, case["params"]["anchor"])(x.copy()).tolist()}
    if rule == "meamed":
        return {"output": byzfl.Meamed(f)(x.copy()).tolist()}
    if rule == "arc":
        return {"output": byzfl.ARC(f)(x.copy()).tolist()}  # ByzFL clips in place: give it a copy
    outputs = []
    for s in range(SEEDS_PER_CASE):
        np.random.seed(s)
        torch.manual_seed(s)
        agg = byzfl.CAF(f) if rule == "caf" else byzfl.SMEA(f)
        out = agg(x.copy())
        outputs.append(None if out is None else np.asarray(out, dtype=np.float64))
    if any(o is None for o in outputs):
        return {"output": None, "stable": True}
    stable = all(np.array_equal(o, outputs[0]) for o in outputs)
    result = {"output": outputs[0].tolist(), "stable": stable}
    if rule == "caf" and not stable:
        return None
    if rule == "smea":
        chosen = set()
        for o in outputs:
            chosen.update(tuple(s) for s in subsets_with_mean(x, case["n"] - f, o))
        result["byzfl_subsets"] = sorted(list(s) for s in chosen)
    return result


def main() -> int:
    import importlib.metadata

    import byzfl
    import torch

    cases, dropped = [], 0
    for case in case_list():
        result = run_case(byzfl, torch, case)
        if result is None:
            dropped += 1
            continue
        cases.append({**case, **result})
    doc = {"byzfl_version": importlib.metadata.version("byzfl"), "seeds_per_case": SEEDS_PER_CASE,
           "generator": "tests/golden/make_byzfl.py", "cases": cases}
    OUT.write_text(json.dumps(doc, separators=(",", ":")) + "\n")
    unstable = sum(1 for c in cases if c.get("stable") is False)
    print(f"{len(cases)} cases to {OUT.name} ({OUT.stat().st_size:,} bytes); {dropped} CAF cases dropped "
          f"(ByzFL's output depended on its random vector), {unstable} SMEA cases where it did", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
