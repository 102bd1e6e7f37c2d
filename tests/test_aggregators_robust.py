"""Robust aggregation rules against independent oracles.

Three kinds of oracle: Flower's own strategies (the `flwr.serverapp.strategy` classes driven through
`aggregate_train`, and the legacy helpers in `flwr.server.strategy.aggregate`), slow plain-loop
references written here, and properties every rule must have.
"""

from __future__ import annotations

import itertools
import statistics

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
from flwr.app.message import arrayrecord as flwr_arrayrecord
from flwr.app.metadata import Metadata
from flwr.server.strategy import aggregate as flwr_legacy
from flwr.serverapp import strategy as flwr_strategy
from flwr.serverapp.strategy.multikrum import select_multikrum
from pydantic import ValidationError

from update_samples import make_updates
from fedsim.aggregators.base import call_rule, vector_rule_names
import fedsim.aggregators.columns as columns
from fedsim.aggregators import AggregationError
from fedsim.aggregators.bulyan import bulyan, bulyan_select
from fedsim.aggregators.coordinate import TrimmedMeanParams, median, trimmed_mean
from fedsim.aggregators.distances import pairwise_sq_distances
from fedsim.aggregators.krum import krum, krum_scores, multikrum, multikrum_select
from fedsim.aggregators.rfa import rfa
from fedsim.models.layout import ModelLayout
from fedsim.registry import AGGREGATORS
from fedsim.server.tools import GivenServerUpdate
from fedsim.updates import RoundContext

# ---------------------------------------------------------------- inputs




def as_layers(row: np.ndarray) -> list[np.ndarray]:
    """Split a flat row into two 'layers' so Flower's per-layer code paths are exercised."""
    cut = row.shape[0] // 3
    return [row[:cut].reshape(1, cut).copy(), row[cut:].copy()]


def flat(layers: list[np.ndarray]) -> np.ndarray:
    return np.concatenate([np.asarray(a).ravel() for a in layers])


def flower_replies(updates: torch.Tensor, weights: torch.Tensor) -> list[Message]:
    """Fresh reply Messages (Flower's strategies pop arrays out of them, so never reuse)."""
    replies = []
    for i, (row, w) in enumerate(zip(updates.numpy(), weights.tolist())):
        content = RecordDict(
            {"arrays": ArrayRecord(as_layers(row)), "metrics": MetricRecord({"num-examples": w})}
        )
        meta = Metadata(
            run_id=0, message_id="", src_node_id=i + 1, dst_node_id=0, reply_to_message_id="r",
            group_id="", created_at=0.0, ttl=60.0, message_type="train",
        )
        replies.append(Message(content=content, metadata=meta))
    return replies


@pytest.fixture
def no_flower_gc(monkeypatch):
    """Flower's ArrayRecord.to_numpy_ndarrays(keep_input=False), used by its Bulyan, calls
    gc.collect() per record (~0.2 s each in a process holding torch): memory housekeeping, not
    aggregation, so skip it to keep this file fast."""
    monkeypatch.setattr(flwr_arrayrecord.gc, "collect", lambda *args: 0)


def flower_aggregate(strategy, updates: torch.Tensor, weights: torch.Tensor) -> np.ndarray:
    arrays, _ = strategy.aggregate_train(1, flower_replies(updates, weights))
    return flat(arrays.to_numpy_ndarrays())


def legacy_results(updates: torch.Tensor, weights: torch.Tensor) -> list:
    """The `results` list of (layers, num_examples) pairs that flwr's legacy helpers take."""
    return [(as_layers(row), int(w)) for row, w in zip(updates.numpy(), weights.tolist())]


def close(ours: torch.Tensor, theirs: np.ndarray, rtol: float = 1e-5, atol: float = 1e-5) -> None:
    np.testing.assert_allclose(ours.numpy(), theirs, rtol=rtol, atol=atol)


# ---------------------------------------------------------------- agreement with Flower

KRUM_SIZES = [(7, 1), (10, 2), (12, 0), (15, 3)]


@pytest.mark.parametrize("n,f", KRUM_SIZES)
def test_krum_matches_flower(n, f):
    updates, weights = make_updates(n, 30, seed=n * 10 + f)
    ours = krum(updates, weights, num_malicious=f)
    close(ours, flower_aggregate(flwr_strategy.Krum(num_malicious_nodes=f), updates, weights))
    legacy = flwr_legacy.aggregate_krum(legacy_results(updates, weights), f, to_keep=0)
    close(ours, flat(legacy))


@pytest.mark.parametrize("n,f", KRUM_SIZES)
def test_multikrum_matches_flower(n, f):
    # Flower's MultiKrum defaults to num_nodes_to_select=1 (Krum); set it to our default m = n - f.
    # Both average the selection weighted by example count.
    updates, weights = make_updates(n, 30, seed=n * 10 + f + 1)
    m = n - f
    ours = multikrum(updates, weights, num_malicious=f)
    strategy = flwr_strategy.MultiKrum(num_malicious_nodes=f, num_nodes_to_select=m)
    close(ours, flower_aggregate(strategy, updates, weights))
    legacy = flwr_legacy.aggregate_krum(legacy_results(updates, weights), f, to_keep=m)
    close(ours, flat(legacy))

    contents = [msg.content for msg in flower_replies(updates, weights)]
    flower_picked = [
        next(i for i, c in enumerate(contents) if c is picked)
        for picked in select_multikrum(contents, f, m - 2)
    ]
    assert multikrum_select(updates, f, m - 2).tolist() == flower_picked


@pytest.mark.parametrize("n", [5, 8, 11, 12])
def test_median_matches_flower(n):
    # Even n included: Flower's np.median averages the two middle values, torch.median would not.
    updates, weights = make_updates(n, 40, seed=n)
    ours = median(updates, weights)
    close(ours, flower_aggregate(flwr_strategy.FedMedian(), updates, weights), rtol=1e-6, atol=1e-6)
    close(ours, flat(flwr_legacy.aggregate_median(legacy_results(updates, weights))))


@pytest.mark.parametrize("n", [5, 10, 13])
@pytest.mark.parametrize("beta", [0.0, 0.1, 0.2, 0.29, 0.3, 0.45])
def test_trimmed_mean_matches_flower(n, beta):
    updates, weights = make_updates(n, 40, seed=n + int(beta * 100))
    ours = trimmed_mean(updates, weights, beta=beta)
    close(ours, flower_aggregate(flwr_strategy.FedTrimmedAvg(beta=beta), updates, weights))
    close(ours, flat(flwr_legacy.aggregate_trimmed_avg(legacy_results(updates, weights), beta)))
    # The count Flower cuts is int(beta * n); num_trim with that count is the same rule.
    assert torch.equal(ours, trimmed_mean(updates, weights, num_trim=int(beta * n)))


@pytest.mark.parametrize("n,f", [(5, 0), (7, 1), (11, 2), (13, 2), (16, 3)])
def test_bulyan_matches_both_flower_versions(n, f, no_flower_gc):
    # The paper's iterative Krum selection is the legacy flwr aggregate_bulyan; the newer
    # serverapp Bulyan selects the n - 2f lowest scores of one pass: our selection="multikrum".
    updates, weights = make_updates(n, 30, seed=100 + n)
    legacy = flwr_legacy.aggregate_bulyan(
        legacy_results(updates, weights), num_malicious=f,
        aggregation_rule=flwr_legacy.aggregate_krum, to_keep=0,
    )
    close(bulyan(updates, weights, num_malicious=f), flat(legacy))
    serverapp = flower_aggregate(flwr_strategy.Bulyan(num_malicious_nodes=f), updates, weights)
    close(bulyan(updates, weights, num_malicious=f, selection="multikrum"), serverapp)


def test_bulyan_selection_variants_really_differ(no_flower_gc):
    """Guard that the Flower comparison above can tell the two selections apart."""
    updates, weights = make_updates(11, 30, seed=7)
    updates[:3] += 4.0  # a loose cluster: iterative Krum and one-pass ranking disagree on it
    picks = {s: sorted(bulyan_select(updates, 2, s).tolist()) for s in ("krum", "multikrum")}
    assert picks["krum"] != picks["multikrum"]
    legacy = flwr_legacy.aggregate_bulyan(
        legacy_results(updates, weights), num_malicious=2,
        aggregation_rule=flwr_legacy.aggregate_krum, to_keep=0,
    )
    close(bulyan(updates, weights, num_malicious=2), flat(legacy))
    serverapp = flower_aggregate(flwr_strategy.Bulyan(num_malicious_nodes=2), updates, weights)
    close(bulyan(updates, weights, num_malicious=2, selection="multikrum"), serverapp)


# ---------------------------------------------------------------- plain-loop references


def slow_sq_dist(a: np.ndarray, b: np.ndarray) -> float:
    return float(sum((float(x) - float(y)) ** 2 for x, y in zip(a, b)))


def slow_krum_scores(rows: np.ndarray, f: int, neighbours: int | None = None) -> list[float]:
    n = len(rows)
    k = n - f - 2 if neighbours is None else neighbours
    dist = {(i, j): slow_sq_dist(rows[i], rows[j]) for i, j in itertools.permutations(range(n), 2)}
    return [sum(sorted(dist[i, j] for j in range(n) if j != i)[:k]) for i in range(n)]


def slow_lowest(scores: list[float], count: int) -> list[int]:
    return sorted(range(len(scores)), key=lambda i: (scores[i], i))[:count]


def slow_bulyan(rows: np.ndarray, f: int, selection: str) -> np.ndarray:
    n = len(rows)
    if selection == "krum":
        remaining, chosen = list(range(n)), []
        for _ in range(n - 2 * f):
            scores = slow_krum_scores(rows[remaining], f, max(1, len(remaining) - f - 2))
            winner = remaining[slow_lowest(scores, 1)[0]]
            chosen.append(winner)
            remaining.remove(winner)
    else:
        theta = n - 2 * f if selection == "multikrum" else n - f - 2
        chosen = slow_lowest(slow_krum_scores(rows, f), theta)
    beta = len(chosen) - 2 * f
    out = []
    for coord in range(rows.shape[1]):
        values = [float(rows[i, coord]) for i in chosen]
        centre = statistics.median(values)
        out.append(statistics.fmean(sorted(values, key=lambda v: abs(v - centre))[:beta]))
    return np.array(out)


def slow_trimmed_mean(rows: np.ndarray, k: int) -> np.ndarray:
    n = len(rows)
    columns = [sorted(float(v) for v in rows[:, c]) for c in range(rows.shape[1])]
    return np.array([statistics.fmean(column[k : n - k]) for column in columns])


def slow_rfa(rows: np.ndarray, counts: np.ndarray, max_iter: int, nu: float, ftol: float):
    """The RFA reference loop (as in the OOD_FL / DBA ports), in float64 numpy."""
    points = [r.astype(np.float64) for r in rows]
    alphas = counts.astype(np.float64) / counts.sum()

    def average(coeffs):
        total = sum(coeffs)
        return sum(c / total * p for c, p in zip(coeffs, points))

    def objective(z):
        return sum(a * np.linalg.norm(z - p) for a, p in zip(alphas, points))

    z = average(alphas)
    obj = objective(z)
    for _ in range(max_iter):
        coeffs = [a / max(nu, np.linalg.norm(z - p)) for a, p in zip(alphas, points)]
        z = average(coeffs)
        prev, obj = obj, objective(z)
        if abs(prev - obj) < ftol * obj:
            break
    return z


@pytest.mark.parametrize("n,f", [(5, 1), (8, 2), (9, 0)])
def test_krum_scores_and_selection_match_loops(n, f):
    updates, weights = make_updates(n, 12, seed=200 + n)
    rows = updates.numpy()
    expected = slow_krum_scores(rows, f)
    np.testing.assert_allclose(krum_scores(updates, f).numpy(), expected, rtol=1e-4)
    assert torch.equal(krum(updates, weights, f), updates[slow_lowest(expected, 1)[0]])
    for m in (1, n - 2 * f - 2 or 1, n - f):
        picked = slow_lowest(expected, m)
        assert multikrum_select(updates, f, m).tolist() == picked
        w = weights.numpy()[picked].astype(np.float64)
        reference = (w[:, None] * rows[picked]).sum(0) / w.sum()
        close(multikrum(updates, weights, f, m), reference)


@pytest.mark.parametrize("selection", ["krum", "multikrum", "krum_single_pass"])
@pytest.mark.parametrize("n,f", [(4, 0), (7, 1), (12, 2)])
def test_bulyan_matches_loops(selection, n, f):
    updates, weights = make_updates(n, 9, seed=300 + n)
    close(bulyan(updates, weights, f, selection), slow_bulyan(updates.numpy(), f, selection))


@pytest.mark.parametrize("n,k", [(5, 0), (5, 2), (10, 3), (11, 1)])
def test_trimmed_mean_matches_loops(n, k):
    updates, weights = make_updates(n, 10, seed=400 + n + k)
    close(trimmed_mean(updates, weights, num_trim=k), slow_trimmed_mean(updates.numpy(), k))


@pytest.mark.parametrize("max_iter,ftol", [(1, 1e-6), (4, 1e-6), (200, 1e-9)])
def test_rfa_matches_numpy_weiszfeld(max_iter, ftol):
    updates, weights = make_updates(9, 16, seed=500 + max_iter)
    updates[0] += 50.0
    reference = slow_rfa(updates.numpy(), weights.numpy(), max_iter, 1e-5, ftol)
    close(rfa(updates, weights, max_iter=max_iter, ftol=ftol), reference, rtol=1e-4, atol=1e-4)


def test_pairwise_distances_match_loops_despite_large_common_offset():
    # Rows = a large shared vector + small differences: a plain float32 Gram product would lose
    # the differences to cancellation; the shift by the smallest-norm row keeps them.
    updates, _ = make_updates(6, 200, seed=9)
    updates = updates * 1e-3 + 100.0
    rows = updates.numpy()
    expected = [[slow_sq_dist(rows[i], rows[j]) for j in range(6)] for i in range(6)]
    ours = pairwise_sq_distances(updates).numpy()
    np.testing.assert_allclose(ours, expected, rtol=1e-3, atol=1e-9)


def test_column_blocks_do_not_change_results(monkeypatch):
    updates, weights = make_updates(11, 97, seed=11)
    rules = {
        "median": lambda: median(updates, weights),
        "trimmed": lambda: trimmed_mean(updates, weights, beta=0.2),
        "bulyan": lambda: bulyan(updates, weights, 2),
    }
    whole = {name: rule() for name, rule in rules.items()}
    monkeypatch.setattr(columns, "BLOCK_ELEMENTS", 11 * 8)  # 8 columns per block
    for name, rule in rules.items():  # equal up to float summation order
        np.testing.assert_allclose(rule().numpy(), whole[name].numpy(), rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------- properties


def run_with_defaults(entry, updates, weights, **overrides):
    """The rule with its defaults (and `overrides`), called as the server calls it (`call_rule`)."""
    d = updates.shape[1]  # a seeded round context; the server's own update: the mean
    ctx = RoundContext(1, torch.zeros(d), ModelLayout(names=("w",), shapes=((d,),)),
                       torch.Generator().manual_seed(0), tools=GivenServerUpdate(updates.mean(dim=0)))
    return call_rule(entry.spec_model()(name=entry.name, **overrides), updates, weights, ctx)[0]


# Iterative Krum (Bulyan's default selection) rescores the last few survivors with
# max(1, n' - f - 2) neighbours; with one neighbour the two mutually nearest survivors always tie
# and, as in Flower, the lower index wins. That happens whenever f <= 2, so the order-free check
# uses f = 3 (n' - f - 2 >= 2 down to the last step). The one-pass selections are checked too.
# Rules whose groups are positions in the batch by definition: not expected to be order-free.
# DETOX votes inside groups of consecutive rows (clients that trained on the same data); MoNNA
# averages around the row at `anchor` (its order-free check is in test_aggregators_byzfl.py).
POSITIONAL_RULES = {"detox", "monna"}
# Rules that draw a random permutation of the rows: the permutation depends on the row order by
# design (checked against a loop reference with the same permutation in its own test file).
RANDOMIZED_RULES = {"bucketing"}

PERMUTATION_CASES = [
    (name, {}) for name in vector_rule_names() if name not in POSITIONAL_RULES | RANDOMIZED_RULES | {"bulyan"}
] + [
    ("bulyan", {"num_malicious": 3}),
    ("bulyan", {"num_malicious": 1, "selection": "multikrum"}),
    ("bulyan", {"num_malicious": 1, "selection": "krum_single_pass"}),
]


@pytest.mark.parametrize("name,overrides", PERMUTATION_CASES)
def test_every_rule_is_permutation_invariant(name, overrides):
    entry = AGGREGATORS.get(name)
    updates, weights = make_updates(15, 20, seed=600)
    perm = torch.randperm(15, generator=torch.Generator().manual_seed(1))
    np.testing.assert_allclose(
        run_with_defaults(entry, updates[perm], weights[perm], **overrides).numpy(),
        run_with_defaults(entry, updates, weights, **overrides).numpy(),
        rtol=1e-5, atol=1e-6,
    )


@pytest.mark.parametrize("n,f", [(7, 1), (11, 3), (20, 4)])
def test_krum_never_picks_far_outliers(n, f):
    updates, weights = make_updates(n, 25, seed=700 + n)
    outliers = torch.arange(n - f, n)
    updates[outliers] = 1e3 + updates[outliers]
    weights[outliers] = 1e6  # large claimed datasets must not help
    picked = krum(updates, weights, f)
    assert any(torch.equal(picked, updates[i]) for i in range(n - f))
    assert not set(multikrum_select(updates, f).tolist()) & set(outliers.tolist())
    if n >= 4 * f + 3:
        # Bulyan's selection may admit one of a tight outlier cluster once few rows remain; its
        # trimming around the coordinate median is what keeps the output among the honest values.
        honest = updates[: n - f]
        for selection in ("krum", "multikrum", "krum_single_pass"):
            out = bulyan(updates, weights, f, selection)
            assert torch.all(out >= honest.min(0).values) and torch.all(out <= honest.max(0).values)


def test_selection_rules_never_pick_non_finite_rows():
    updates, weights = make_updates(11, 25, seed=42)
    updates[3, 5] = float("nan")
    updates[8] = float("inf")
    bad = {3, 8}
    assert int(torch.argmin(krum_scores(updates, 2))) not in bad
    assert not set(multikrum_select(updates, 2).tolist()) & bad
    assert not set(bulyan_select(updates, 2).tolist()) & bad
    for rule in (krum, multikrum, bulyan):
        assert torch.isfinite(rule(updates, weights, 2)).all()


@pytest.mark.parametrize("n,f", [(11, 5), (10, 4), (3, 1)])
def test_median_stays_within_honest_range(n, f):
    updates, weights = make_updates(n, 50, seed=800 + n)
    gen = torch.Generator().manual_seed(n)
    signs = torch.randint(0, 2, (f, 50), generator=gen).float() * 2 - 1
    updates[:f] = signs * 1e30
    honest = updates[f:]
    out = median(updates, weights)
    assert torch.all(out >= honest.min(0).values) and torch.all(out <= honest.max(0).values)


def test_rfa_objective_not_above_weighted_mean():
    updates, weights = make_updates(10, 40, seed=900)
    updates[:2] *= 30.0
    alphas = weights.double() / weights.double().sum()

    def objective(z):
        return float(alphas @ torch.linalg.vector_norm(updates - z, dim=1).double())

    mean = (weights / weights.sum()) @ updates
    for max_iter in (1, 4, 50):
        assert objective(rfa(updates, weights, max_iter=max_iter)) <= objective(mean)


def test_too_few_updates_raise():
    updates, weights = make_updates(8, 10, seed=1)
    with pytest.raises(AggregationError, match=r"krum.*n=8, f=3"):
        krum(updates, weights, num_malicious=3)
    with pytest.raises(AggregationError, match=r"multikrum.*n=8, f=3"):
        multikrum(updates, weights, num_malicious=3)
    for selection in ("krum", "multikrum", "krum_single_pass"):
        with pytest.raises(AggregationError, match=r"bulyan.*n=8, f=2"):
            bulyan(updates, weights, num_malicious=2, selection=selection)
    with pytest.raises(AggregationError, match=r"trimmed_mean.*n=8"):
        trimmed_mean(updates, weights, num_trim=4)
    with pytest.raises(AggregationError, match="not both"):
        trimmed_mean(updates, weights, beta=0.1, num_trim=1)
    with pytest.raises(ValidationError):
        TrimmedMeanParams(beta=0.1, num_trim=1)
    assert krum(updates[:5], weights[:5], num_malicious=1).shape == (10,)  # n = 2f + 3 is enough
    assert bulyan(updates[:7], weights[:7], num_malicious=1).shape == (10,)  # n = 4f + 3


@pytest.mark.parametrize("name", vector_rule_names())
def test_every_registered_rule_runs_from_default_params(name):
    entry = AGGREGATORS.get(name)
    for n in (12, 15):
        updates, weights = make_updates(n, 50, seed=1000 + n)
        if name in POSITIONAL_RULES:  # redundant groups of 3 send bit-identical updates
            updates = updates[torch.arange(n) // 3 * 3]
        try:
            out = run_with_defaults(entry, updates, weights)
        except AggregationError:
            continue
        assert out.shape == (50,) and out.dtype == torch.float32
        assert torch.isfinite(out).all()
        return
    pytest.fail(f"{name} ran on neither n=12 nor n=15")
