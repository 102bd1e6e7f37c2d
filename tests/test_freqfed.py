"""FreqFed (defenses/freqfed.py) against independent oracles: the DCT written out as the sum of its
definition, the paper's low-frequency triangle by exact fractions, and a far-away minority removed;
then FreqFed and RLR together in the round pipeline (RLR's own tests: test_rlr.py)."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
import torch

import fedsim.defenses.freqfed as freqfed_mod
from conftest import QUICKSTART, quick_scenario, round_context, update_batch
from fedsim.defenses.freqfed import FreqFed, FreqFedParams, low_frequency_features, low_frequency_mask
from fedsim.models.layout import ModelLayout
from fedsim.server.pipeline import RoundPipeline
from fedsim.updates import RoundContext, UpdateBatch

THREE = ModelLayout(names=("w1", "w2", "b2"), shapes=((4, 3), (3, 5), (5,)))  # d = 32


def make_ctx(d: int, rnd: int = 1, seed: int = 0, global_weights: torch.Tensor | None = None, layout=None) -> RoundContext:
    """The shared round context, on a layout of a weight vector and a one-value bias unless given."""
    return round_context(d, rnd, seed, global_weights=global_weights, layout=layout, bias=True)


def make_batch(updates, ids=None, weights=None) -> UpdateBatch:
    """The shared update batch, each client with 10 examples unless given."""
    return update_batch(updates, ids, weights, weight=10.0)


def dct_direct(x: np.ndarray) -> np.ndarray:
    """Orthonormal DCT-II over every axis, written out as the sum of the definition."""
    out = np.zeros(x.shape)
    for k in itertools.product(*(range(s) for s in x.shape)):
        total = 0.0
        for idx in itertools.product(*(range(s) for s in x.shape)):
            term = x[idx]
            for kk, nn, size in zip(k, idx, x.shape):
                term *= math.cos(math.pi * (2 * nn + 1) * kk / (2 * size))
            total += term
        for kk, size in zip(k, x.shape):
            total *= math.sqrt((1.0 if kk == 0 else 2.0) / size)
        out[k] = total
    return out


def kept_by_loops(shape: tuple[int, ...], cutoff: float = 0.5) -> list[tuple[int, ...]]:
    """Indices with Σ k_a / N_a ≤ cutoff, in row-major order, by exact fractions."""
    from fractions import Fraction

    return [k for k in itertools.product(*(range(s) for s in shape))
            if sum(Fraction(kk, s) for kk, s in zip(k, shape)) <= Fraction(cutoff).limit_denominator(1000)]


def test_dct_of_a_2x2_matrix_by_hand():
    # V00 = (1+2+3+4)/2 = 5; V01 = (1/√2)·((1-2)+(3-4))·(√2/2) = -1; V10 = -2; V11 = (1-2-3+4)/2 = 0
    layout = ModelLayout(names=("w",), shapes=((2, 2),))
    feats = low_frequency_features(torch.tensor([[1.0, 2.0, 3.0, 4.0]]), layout, ("w",))
    np.testing.assert_allclose(feats, [[5.0, -1.0, -2.0]], atol=1e-12)  # V11 is not low-frequency (1/2 + 1/2 > 1/2)


@pytest.mark.parametrize("shape", [(3, 4), (6,), (7,), (2, 3, 3), (5, 5), (1, 4)])
def test_low_frequency_features_match_the_dct_definition(shape):
    rng = np.random.default_rng(sum(shape))
    n = 3
    size = math.prod(shape)
    layout = ModelLayout(names=("a", "t", "z"), shapes=((2,), shape, ()))  # the tensor sits between two others
    rows = rng.normal(size=(n, 2 + size + 1))
    base = rng.normal(size=2 + size + 1)
    feats = low_frequency_features(torch.tensor(rows), layout, ("t",), base=torch.tensor(base))
    kept = kept_by_loops(shape)
    for i in range(n):
        coeffs = dct_direct((base + rows[i])[2 : 2 + size].reshape(shape))
        np.testing.assert_allclose(feats[i], [coeffs[k] for k in kept], rtol=1e-9, atol=1e-12)
    if len(shape) == 1:
        assert len(kept) == shape[0] // 2 + 1  # the first half of a vector


def test_low_frequency_mask_is_the_papers_triangle_on_square_matrices():
    for p in range(1, 10):
        i, j = np.indices((p, p))
        np.testing.assert_array_equal(low_frequency_mask((p, p)), i + j <= p // 2)
    assert low_frequency_mask((4, 6)).sum() == len(kept_by_loops((4, 6)))
    assert low_frequency_mask(()).tolist() == [True]


def attack_round(noise: float, seed: int = 0, n_bad: int = 4):
    """10 local models: honest ones close to one model, n_bad attackers close to a far-away one."""
    rng = np.random.default_rng(seed)
    d = THREE.dim
    gw = 0.01 * rng.normal(size=d)
    good, bad = rng.normal(size=d), rng.normal(size=d)
    rows = [good + noise * rng.normal(size=d) for _ in range(10 - n_bad)]
    rows += [bad + noise * rng.normal(size=d) for _ in range(n_bad)]
    ids = tuple(range(100, 110))
    return make_batch(np.stack(rows)), ids, make_ctx(d, rnd=2, global_weights=torch.tensor(gw, dtype=torch.float32), layout=THREE)


@pytest.mark.parametrize("noise", [0.0, 0.01])
@pytest.mark.parametrize("n_bad", [1, 3, 4])
def test_freqfed_removes_a_far_away_minority(noise, n_bad):
    batch, ids, ctx = attack_round(noise, n_bad=n_bad)
    batch = UpdateBatch(batch.updates, batch.weights, ids)
    out, log = FreqFed(FreqFedParams()).before(batch, ctx)
    attackers = list(ids[10 - n_bad :])
    kept = [c for c in ids if c not in log["removed"]]
    assert set(attackers) <= set(log["removed"]) and "note" not in log
    assert out.client_ids == tuple(kept) and len(kept) >= 10 // 2 + 1  # at least min_cluster_size, all honest
    rows = [ids.index(c) for c in kept]
    assert torch.equal(out.updates, batch.updates[rows]) and torch.equal(out.weights, batch.weights[rows])
    if noise == 0.0:  # exact copies: the honest group is one point, kept whole
        assert log["removed"] == attackers
    # with noise, HDBSCAN (min_cluster_size > n/2, allow_single_cluster) may also drop fringe honest models, as in FLAME
    assert log["features"] == len(kept_by_loops((4, 3))) + len(kept_by_loops((3, 5))) + 3
    json.dumps(log)


def test_freqfed_removes_nobody_when_all_models_are_identical():
    rng = np.random.default_rng(5)
    batch = make_batch(np.tile(rng.normal(size=(1, THREE.dim)), (7, 1)))
    out, log = FreqFed(FreqFedParams()).before(batch, make_ctx(THREE.dim, layout=THREE))
    assert log["removed"] == [] and out.client_ids == batch.client_ids
    assert torch.equal(out.updates, batch.updates)


def test_freqfed_is_deterministic_and_ignores_the_round_generator():
    batch, ids, ctx = attack_round(0.3, seed=7, n_bad=3)
    results = []
    for seed in (0, 0, 1):
        c = RoundContext(ctx.round, ctx.global_weights, ctx.layout, torch.Generator().manual_seed(seed))
        out, log = FreqFed(FreqFedParams()).before(batch, c)
        results.append((out.client_ids, log["removed"], out.updates.clone()))
    for ids_, removed, upd in results[1:]:
        assert ids_ == results[0][0] and removed == results[0][1] and torch.equal(upd, results[0][2])


def test_freqfed_clusters_the_local_models_dct(monkeypatch):
    seen = []
    real = freqfed_mod.cosine_distances
    monkeypatch.setattr(freqfed_mod, "cosine_distances", lambda x: seen.append(x.clone()) or real(x))
    batch, _, ctx = attack_round(0.01)
    FreqFed(FreqFedParams()).before(batch, ctx)
    models = (ctx.global_weights.double()[None, :] + batch.updates.double()).numpy()
    expected = []
    for m in models:
        parts = []
        for name, shape in zip(THREE.names, THREE.shapes):
            coeffs = dct_direct(m[THREE.slice(name)].reshape(shape))
            parts += [coeffs[k] for k in kept_by_loops(shape)]
        expected.append(parts)
    np.testing.assert_allclose(seen[0].numpy(), np.array(expected), rtol=1e-9, atol=1e-12)


def test_freqfed_layers_restrict_the_comparison():
    batch, ids, ctx = attack_round(0.0, n_bad=3)
    u = batch.updates.clone()
    u[:, THREE.slice("w1")] = 100.0 * torch.randn(10, 12, generator=torch.Generator().manual_seed(0))  # w1 scattered
    u[:, THREE.slice("b2")] = -u[:, THREE.slice("b2")]
    changed = UpdateBatch(u, batch.weights, batch.client_ids)
    outs = [FreqFed(FreqFedParams(layers=("w2",))).before(b, ctx) for b in (batch, changed)]
    assert outs[0][1] == outs[1][1] == {"removed": [7, 8, 9], "features": len(kept_by_loops((3, 5)))}
    assert outs[1][0].client_ids == tuple(range(7)) and torch.equal(outs[1][0].updates, u[:7])
    with pytest.raises(ValueError):
        FreqFed(FreqFedParams(layers=("nope",))).before(batch, ctx)


def test_freqfed_keeps_everyone_when_too_few_to_cluster():
    out, log = FreqFed(FreqFedParams()).before(make_batch([[1.0, 0.0], [0.0, 1.0]]), make_ctx(2))
    assert out.client_ids == (0, 1) and log["removed"] == [] and "note" in log


# ------------------------------------------------------------------------------- through the seams


def test_pipeline_runs_rlr_after_freqfed_by_client_id():
    sc = quick_scenario("attack=null", "aggregator=fedavg", "defenses=[{name: freqfed}, {name: rlr, threshold: 4}]",
                        base=QUICKSTART)
    batch, ids, ctx = attack_round(0.01, n_bad=3)
    out = RoundPipeline(sc).run(batch, set(), ctx)
    removed = out.defenses["freqfed"]["removed"]
    assert out.skipped is None and {7, 8, 9} <= set(removed)
    assert out.aggregated == [c for c in range(10) if c not in removed] and len(out.aggregated) >= 6
    kept = batch.updates[out.aggregated]
    agg = kept.mean(dim=0)  # equal example counts
    votes = np.abs(np.sign(kept.numpy()).sum(axis=0))
    expected = agg.numpy() * np.where(votes >= 4, 1.0, -1.0)
    np.testing.assert_allclose(out.aggregate.numpy(), expected, rtol=1e-6, atol=1e-7)
    assert out.defenses["rlr"]["flipped"] == int((votes < 4).sum())
