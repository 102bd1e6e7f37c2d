"""Defenses against independent oracles: hand computations, numpy re-implementations, statistics."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

import fedsim.defenses.flame as flame_mod
from conftest import round_context, update_batch
from fedsim.defenses.clipping import NormClipping, NormClippingParams, WeakDP, WeakDPParams
from fedsim.defenses.flame import Flame, FlameParams
from fedsim.defenses.foolsgold import FoolsGold, FoolsGoldParams
from fedsim.models.layout import ModelLayout
from fedsim.registry import DEFENSES
from fedsim.updates import RoundContext, UpdateBatch


def make_ctx(d: int, rnd: int = 1, seed: int = 0, global_weights: torch.Tensor | None = None, layout=None) -> RoundContext:
    """The shared round context, on a layout of a weight vector and a one-value bias unless given."""
    return round_context(d, rnd, seed, global_weights=global_weights, layout=layout, bias=True)


def make_batch(updates, ids=None, weights=None) -> UpdateBatch:
    """The shared update batch, each client with 10 examples unless given."""
    return update_batch(updates, ids, weights, weight=10.0)


# ---------------------------------------------------------------------------------- norm clipping


def test_norm_clipping_by_hand():
    rows = [[0.3, 0.4, 0.0, 0.0], [1.0, 2.0, 2.0, 0.0], [2.0, 4.0, 4.0, 0.0]]  # norms 0.5, 3, 6
    batch = make_batch(rows, ids=(10, 11, 12))
    out, log = NormClipping(NormClippingParams(delta=3.0)).before(batch, make_ctx(4))
    expected = np.array([[0.3, 0.4, 0, 0], [1, 2, 2, 0], [1, 2, 2, 0]])  # factors 1, 1, 0.5
    np.testing.assert_allclose(out.updates.numpy(), expected, rtol=1e-6)
    assert log["clipped"] == {12: pytest.approx(0.5)}
    assert log["norms"] == {10: pytest.approx(0.5), 11: pytest.approx(3.0), 12: pytest.approx(6.0)}
    assert out.client_ids == batch.client_ids and torch.equal(out.weights, batch.weights)
    json.dumps(log)


def test_norm_clipping_bounds_norm_and_keeps_direction():
    g = torch.Generator().manual_seed(1)
    u = torch.randn(20, 50, generator=g) * torch.logspace(-2, 1, 20)[:, None]
    out, log = NormClipping(NormClippingParams(delta=3.0)).before(make_batch(u), make_ctx(50))
    before, after = u.norm(dim=1), out.updates.norm(dim=1)
    assert (after <= 3.0 * (1 + 1e-6)).all()
    cos = torch.nn.functional.cosine_similarity(u, out.updates, dim=1)
    assert torch.allclose(cos, torch.ones(20), atol=1e-6)
    small = before <= 3.0
    assert torch.equal(out.updates[small], u[small])
    assert set(log["clipped"]) == {i for i in range(20) if not small[i]}
    for i, f in log["clipped"].items():
        assert f == pytest.approx(3.0 / before[i].item(), rel=1e-6)


def test_norm_clipping_adaptive_uses_mean_norm():
    rows = [[1.0, 0.0], [0.0, 2.0], [6.0, 0.0]]  # mean norm 3
    out, log = NormClipping(NormClippingParams(adaptive=True)).before(make_batch(rows), make_ctx(2))
    assert log["delta"] == pytest.approx(3.0)
    np.testing.assert_allclose(out.updates.numpy(), [[1, 0], [0, 2], [3, 0]], rtol=1e-6)
    assert log["clipped"] == {2: pytest.approx(0.5)}


# ---------------------------------------------------------------------------------------- weak DP


def test_weak_dp_clips_then_noise_std_matches_sigma():
    dp = WeakDP(WeakDPParams(delta=3.0, sigma=0.025))
    out, log = dp.before(make_batch([[6.0, 0.0], [1.0, 1.0]]), make_ctx(2))
    np.testing.assert_allclose(out.updates.numpy(), [[3, 0], [1, 1]], rtol=1e-6)
    assert log["clipped"] == {0: pytest.approx(0.5)}

    d = 200_000
    agg = torch.full((d,), 0.5)
    noisy, log = dp.after(agg, make_ctx(d, seed=3))
    assert log == {"noise_std": 0.025}
    noise = (noisy - agg).double()
    # sample std of d normals has relative sd 1/sqrt(2d) ≈ 0.0016; 1% is > 6 of those
    assert noise.std().item() == pytest.approx(0.025, rel=0.01)
    assert abs(noise.mean().item()) < 6 * 0.025 / math.sqrt(d)


def test_weak_dp_noise_follows_generator_seed():
    dp = WeakDP(WeakDPParams())
    agg = torch.zeros(1000)
    a, _ = dp.after(agg, make_ctx(1000, seed=7))
    b, _ = dp.after(agg, make_ctx(1000, seed=7))
    c, _ = dp.after(agg, make_ctx(1000, seed=8))
    assert torch.equal(a, b) and not torch.equal(a, c)


# ------------------------------------------------------------------------------------------ FLAME


def flame_round(noise: float = 0.05, d: int = 60, seed: int = 0):
    """7 honest updates along one direction (norms 1..7), 3 attackers pointing the opposite way."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(d, generator=g)
    base /= base.norm()
    honest = [(i + 1) * (base + noise * torch.randn(d, generator=g) / math.sqrt(d)) for i in range(7)]
    attack = [-10.0 * (base + noise * torch.randn(d, generator=g) / math.sqrt(d)) for _ in range(3)]
    ids = (3, 5, 8, 13, 21, 34, 55, 90, 91, 92)
    gw = 0.01 * torch.randn(d, generator=g)
    return make_batch(torch.stack(honest + attack), ids=ids), make_ctx(d, rnd=4, global_weights=gw)


def test_flame_removes_opposite_updates_and_clips_to_median():
    batch, ctx = flame_round()
    out, log = Flame(FlameParams()).before(batch, ctx)
    assert {90, 91, 92} <= set(log["removed"])
    assert len(out.client_ids) >= 6 and set(out.client_ids) <= {3, 5, 8, 13, 21, 34, 55}
    assert set(log["removed"]) == set(batch.client_ids) - set(out.client_ids)

    norms = batch.updates.double().norm(dim=1).numpy()
    s = float(np.median(norms))  # median over all 10, attackers included
    for row, cid in zip(out.updates, out.client_ids):
        i = batch.client_ids.index(cid)
        factor = min(1.0, s / norms[i])
        np.testing.assert_allclose(row.numpy(), batch.updates[i].numpy() * factor, rtol=1e-5, atol=1e-7)
        if factor < 1:
            assert log["clipped"][cid] == pytest.approx(factor, rel=1e-6)
        else:
            assert cid not in log["clipped"]
    assert log["norms"] == {c: pytest.approx(v, rel=1e-6) for c, v in zip(batch.client_ids, norms)}
    json.dumps(log)


def test_flame_noise_std_is_lambda_times_median_norm():
    batch, ctx = flame_round()
    fl = Flame(FlameParams(noise_lambda=0.01))
    fl.before(batch, ctx)
    s = float(np.median(batch.updates.double().norm(dim=1).numpy()))
    d = 100_000
    big_ctx = RoundContext(round=ctx.round, global_weights=torch.zeros(d), layout=ctx.layout, generator=torch.Generator().manual_seed(5))
    agg = torch.zeros(d)
    noisy, log = fl.after(agg, big_ctx)
    assert log["noise_std"] == pytest.approx(0.01 * s, rel=1e-6)
    # relative sd of the sample std is 1/sqrt(2d) ≈ 0.0022; 1.5% is > 6 of those
    assert noisy.double().std().item() == pytest.approx(0.01 * s, rel=0.015)
    with pytest.raises(RuntimeError):
        fl.after(agg, big_ctx)  # S is round-local: used once


def test_flame_keeps_everyone_when_hdbscan_finds_no_cluster(monkeypatch):
    class AllNoise:
        def __init__(self, **kw):
            pass

        def fit(self, dist):
            self.labels_ = np.full(dist.shape[0], -1)
            return self

    import sklearn.cluster

    monkeypatch.setattr(sklearn.cluster, "HDBSCAN", AllNoise)  # flame imports it at call time
    batch, ctx = flame_round()
    out, log = Flame(FlameParams()).before(batch, ctx)
    assert out.client_ids == batch.client_ids and log["removed"] == [] and "note" in log


def test_flame_clusters_models_not_updates(monkeypatch):
    seen = []
    real = flame_mod.cosine_distances
    monkeypatch.setattr(flame_mod, "cosine_distances", lambda x: seen.append(x.clone()) or real(x))
    batch, ctx = flame_round()
    Flame(FlameParams()).before(batch, ctx)
    torch.testing.assert_close(seen[0], (ctx.global_weights[None, :] + batch.updates).double())
    dist = real(seen[0])
    x = seen[0].numpy()
    xn = x / np.linalg.norm(x, axis=1, keepdims=True)
    np.testing.assert_allclose(dist, np.clip(1 - xn @ xn.T, 0, None) * (1 - np.eye(10)), atol=1e-12)


# -------------------------------------------------------------------------------------- FoolsGold


def foolsgold_oracle(hist: np.ndarray, kappa: float = 1.0) -> np.ndarray:
    """DBA's helper.FoolsGold.foolsgold with explicit loops (self-similarity exact, see the module)."""
    n = hist.shape[0]
    cs = np.zeros((n, n))
    for i in range(n):
        for j in range(n):
            ni, nj = np.linalg.norm(hist[i]), np.linalg.norm(hist[j])
            if i == j:
                cs[i, j] = (1.0 if ni > 0 else 0.0) - 1.0  # exact self-similarity
            else:
                cs[i, j] = hist[i] @ hist[j] / (ni * nj) if ni > 0 and nj > 0 else 0.0
    maxcs = cs.max(axis=1)
    for i in range(n):
        for j in range(n):
            if i != j and maxcs[i] < maxcs[j]:
                cs[i, j] = cs[i, j] * maxcs[i] / maxcs[j]
    wv = 1 - cs.max(axis=1)
    wv[wv > 1] = 1
    wv[wv < 0] = 0
    wv = wv / wv.max()
    wv[wv == 1] = 0.99
    with np.errstate(divide="ignore"):
        wv = kappa * (np.log(wv / (1 - wv)) + 0.5)
    wv[(np.isinf(wv) + wv) > 1] = 1
    wv[wv < 0] = 0
    return np.nan_to_num(wv, nan=0.0)


THREE = ModelLayout(names=("w1", "w2", "b2"), shapes=((4, 3), (3, 5), (5,)))  # d = 32, w2 = [12, 27)


def test_foolsgold_matches_loop_oracle_over_two_rounds():
    rng = np.random.default_rng(0)
    ids = (4, 9, 1, 7, 2, 8)
    fg = FoolsGold(FoolsGoldParams(kappa=1.0))
    hist = np.zeros((len(ids), 15))
    for rnd in (1, 2):
        u = rng.normal(size=(len(ids), 32))
        u[:2, 12:27] = u[0, 12:27] + 0.1 * rng.normal(size=(2, 15))  # two near-sybils
        u = u.astype(np.float32)  # what the batch holds
        hist += u[:, 12:27].astype(np.float64)
        out, log = fg.before(make_batch(u, ids=ids), make_ctx(32, rnd=rnd, layout=THREE))
        expected = foolsgold_oracle(hist)
        np.testing.assert_allclose(out.weights.numpy(), expected, rtol=1e-5, atol=1e-6)
        assert log["weights"] == {c: pytest.approx(w, abs=1e-6) for c, w in zip(ids, expected)}
        torch.testing.assert_close(out.updates, torch.as_tensor(u, dtype=torch.float32))
    state = fg.state_dict()
    assert set(state) == {str(c) for c in ids}
    np.testing.assert_allclose(np.stack([state[str(c)].numpy() for c in ids]), hist, rtol=1e-12)
    json.dumps(log)


@pytest.mark.parametrize("kappa", [0.5, 1.0, 2.0])
def test_foolsgold_weights_on_random_histories(kappa):
    rng = np.random.default_rng(int(kappa * 10))
    for _ in range(20):
        n = int(rng.integers(2, 12))
        hist = rng.normal(size=(n, 7))
        if n > 3:
            hist[1] = hist[0] * 2.0 + 0.05 * rng.normal(size=7)  # one pair of near-sybils
        fg = FoolsGold(FoolsGoldParams(kappa=kappa, layer="w"))
        full = np.concatenate([hist, np.zeros((n, 1))], axis=1)
        out, _ = fg.before(make_batch(full), make_ctx(8))
        np.testing.assert_allclose(out.weights.numpy(), foolsgold_oracle(hist, kappa), rtol=1e-5, atol=1e-6)


def test_foolsgold_sybils_get_zero_weight_honest_keep_high():
    rng = np.random.default_rng(3)
    fg = FoolsGold(FoolsGoldParams())
    for rnd in (1, 2, 3):
        honest = rng.normal(size=(5, 20))
        sybil = np.tile(rng.normal(size=(1, 20)), (3, 1))
        out, log = fg.before(make_batch(np.concatenate([honest, sybil])), make_ctx(20, rnd=rnd))
        w = out.weights.numpy()
        assert np.all(w[5:] < 1e-6) and np.all(w[:5] > 0.5)


def test_foolsgold_state_round_trip_and_default_layer():
    rng = np.random.default_rng(4)
    ids = (0, 1, 2, 3, 4)
    a = FoolsGold(FoolsGoldParams())
    a.before(make_batch(rng.normal(size=(5, 32)), ids=ids), make_ctx(32, layout=THREE))
    saved = a.state_dict()
    b = FoolsGold(FoolsGoldParams())
    b.load_state_dict(saved)
    u2 = rng.normal(size=(5, 32))
    out_a, _ = a.before(make_batch(u2, ids=ids), make_ctx(32, rnd=2, layout=THREE))
    out_b, _ = b.before(make_batch(u2, ids=ids), make_ctx(32, rnd=2, layout=THREE))
    assert torch.equal(out_a.weights, out_b.weights)
    assert a.state_dict().keys() == b.state_dict().keys()
    for k, v in a.state_dict().items():
        assert torch.equal(b.state_dict()[k], v)

    # by default only the second-to-last tensor (w2 = coordinates 12..26) is compared
    c = FoolsGold(FoolsGoldParams())
    c.load_state_dict(saved)
    u3 = u2.copy()
    u3[:, :12] += 100 * rng.normal(size=(5, 12))
    u3[:, 27:] += 100 * rng.normal(size=(5, 5))
    out_c, _ = c.before(make_batch(u3, ids=ids), make_ctx(32, rnd=2, layout=THREE))
    assert torch.equal(out_c.weights, out_b.weights)
    with pytest.raises(ValueError):
        FoolsGold(FoolsGoldParams(layer="nope")).before(make_batch(u2), make_ctx(32, layout=THREE))


def test_foolsgold_without_memory_and_all_zero_fallback():
    rng = np.random.default_rng(5)
    fg = FoolsGold(FoolsGoldParams(use_memory=False))
    fg.before(make_batch(rng.normal(size=(4, 9))), make_ctx(9))
    u = rng.normal(size=(4, 9))
    out, _ = fg.before(make_batch(u), make_ctx(9, rnd=2))
    np.testing.assert_allclose(out.weights.numpy(), foolsgold_oracle(u[:, :8]), rtol=1e-5, atol=1e-6)

    same = np.tile(rng.normal(size=(1, 9)), (4, 1))  # every client has an exact twin: DBA gives NaN
    batch = make_batch(same, weights=[1.0, 2.0, 3.0, 4.0])
    out, log = FoolsGold(FoolsGoldParams()).before(batch, make_ctx(9))
    assert torch.equal(out.weights, batch.weights) and "note" in log
    assert all(w == 0.0 for w in log["weights"].values())


# ----------------------------------------------------------------------------- every registration


@pytest.mark.parametrize("name", DEFENSES.names())
def test_every_defense_runs_from_defaults(name):
    entry = DEFENSES.get(name)
    d = 40
    g = torch.Generator().manual_seed(11)
    batch = make_batch(torch.randn(9, d, generator=g), ids=range(100, 109))
    defense = entry.obj(entry.params())
    ctx = make_ctx(d, rnd=2, global_weights=torch.randn(d, generator=g))
    out, log = defense.before(batch, ctx)
    assert out.updates.shape[1] == d and out.updates.shape[0] == len(out.client_ids) == out.weights.shape[0]
    agg = (out.weights / out.weights.sum()) @ out.updates
    new, log2 = defense.after(agg, ctx)
    assert new.shape == (d,) and torch.isfinite(new).all()
    json.dumps(log)
    json.dumps(log2)
    defense.load_state_dict(defense.state_dict())
    assert all(f.description for f in entry.params.model_fields.values())
