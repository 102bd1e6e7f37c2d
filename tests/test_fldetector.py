"""FLDetector (defenses/fldetector.py): the compact L-BFGS product against the explicit BFGS matrix,
the gap statistic on clear cases, detection on a synthetic problem whose honest updates are exactly
predictable, and a checkpoint taken mid-run that continues identically."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedsim.defenses.fldetector import FLDetector, FLDetectorParams, gap_statistic_k, kmeans_1d, lbfgs_hvp
from fedsim.models.layout import ModelLayout
from fedsim.updates import RoundContext, UpdateBatch


def explicit_bfgs(s: np.ndarray, y: np.ndarray) -> np.ndarray:
    """B from B0 = σI (σ = y_mᵀs_m / s_mᵀs_m) and the BFGS update for each pair in order."""
    d, m = s.shape
    b = (y[:, -1] @ s[:, -1]) / (s[:, -1] @ s[:, -1]) * np.eye(d)
    for k in range(m):
        sk, yk = s[:, k], y[:, k]
        bs = b @ sk
        b = b - np.outer(bs, bs) / (sk @ bs) + np.outer(yk, yk) / (yk @ sk)
    return b


@pytest.mark.parametrize("seed", range(4))
def test_compact_lbfgs_equals_the_explicit_bfgs_matrix(seed):
    rng = np.random.default_rng(seed)
    d, m = 7, 4
    a = rng.normal(size=(d, d))
    hessian = a @ a.T + d * np.eye(d)  # positive definite: every pair has sᵀy > 0
    s = rng.normal(size=(d, m))
    y = hessian @ s
    v = rng.normal(size=d)
    got = lbfgs_hvp(torch.tensor(s), torch.tensor(y), torch.tensor(v)).numpy()
    np.testing.assert_allclose(got, explicit_bfgs(s, y) @ v, rtol=1e-9, atol=1e-9)


def test_gap_statistic_on_clear_cases():
    rng = np.random.default_rng(0)
    two = np.concatenate([rng.normal(0.1, 0.005, 16), rng.normal(0.9, 0.005, 4)])
    assert gap_statistic_k(two, np.random.default_rng(1)) == 2
    assert gap_statistic_k(np.full(10, 0.3), np.random.default_rng(1)) == 1


@pytest.mark.parametrize("seed", range(6))
def test_exact_1d_kmeans_against_brute_force(seed):
    """Every way to cut the sorted points into k runs (optimal 1-D clusters are contiguous runs)."""
    from itertools import combinations

    x = np.random.default_rng(seed).normal(size=9)
    v = np.sort(x)
    for k in (1, 2, 3, 4):
        best = min(
            sum(((part - part.mean()) ** 2).sum() for part in np.split(v, list(cuts)))
            for cuts in combinations(range(1, len(v)), k - 1)
        )
        sse, labels = kmeans_1d(x, k)
        assert sse == pytest.approx(best, abs=1e-9)
        assert sum(((x[labels == q] - x[labels == q].mean()) ** 2).sum() for q in range(k)) == pytest.approx(best, abs=1e-9)


class Quadratic:
    """Client i's gradient at w is A(w − c_i): honest updates are exactly what FLDetector predicts."""

    def __init__(self, d=12, n=10, seed=0):
        rng = np.random.default_rng(seed)
        q = rng.normal(size=(d, d))
        self.a = torch.tensor(q @ q.T / d + np.eye(d))
        self.c = torch.tensor(rng.normal(size=(n, d)))
        self.w = torch.zeros(d, dtype=torch.float64)
        self.layout = ModelLayout(names=("w",), shapes=((d,),))

    def updates(self, rnd, attackers=()):
        u = -0.1 * (self.w[None, :] - self.c) @ self.a.T
        for i in attackers:
            u[i] = torch.tensor(np.random.default_rng(rnd * 100 + i).normal(size=u.shape[1]))
        return u


def run_rounds(defense, problem, rounds, attackers=(), start_attack=1, first=1):
    log = []
    for t in range(first, first + rounds):
        bad = attackers if t >= start_attack else ()
        u = problem.updates(t, bad)
        batch = UpdateBatch(u.float(), torch.ones(len(u)), tuple(range(len(u))))
        ctx = RoundContext(t, problem.w.float(), problem.layout, torch.Generator().manual_seed(t))
        kept, info = defense.before(batch, ctx)
        agg = kept.updates.mean(dim=0)
        agg, _ = defense.after(agg, ctx)
        problem.w = problem.w + agg.double()
        log.append(info)
    return log


def test_attackers_are_detected_and_honest_clients_are_not():
    fld = FLDetector(FLDetectorParams(window=3))
    log = run_rounds(fld, Quadratic(), rounds=9, attackers=(2, 7), start_attack=6)
    assert all("removed" not in info for info in log[:5])  # no attacker yet, no false alarm
    detected = [set(info.get("detected", [])) for info in log[5:]]
    assert {2, 7} in detected and all(d <= {2, 7} for d in detected)
    assert fld.banned == {2, 7}
    assert set(log[-1]["removed"]) == {2, 7}


def test_a_checkpoint_mid_run_continues_identically():
    full = FLDetector(FLDetectorParams(window=3))
    full_log = run_rounds(full, Quadratic(), rounds=9, attackers=(4,), start_attack=5)

    first = FLDetector(FLDetectorParams(window=3))
    problem = Quadratic()
    cut_log = run_rounds(first, problem, rounds=5, attackers=(4,), start_attack=5)
    state = first.state_dict()
    import io

    buf = io.BytesIO()
    torch.save(state, buf)  # as the server's checkpoint does
    buf.seek(0)
    resumed = FLDetector(FLDetectorParams(window=3))
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    cut_log += run_rounds(resumed, problem, rounds=4, attackers=(4,), start_attack=5, first=6)
    assert cut_log == full_log


def test_the_product_takes_several_vectors_as_columns():
    rng = np.random.default_rng(9)
    s, y, v = (torch.tensor(rng.normal(size=shape)) for shape in ((6, 3), (6, 3), (6, 4)))
    y = y + 3 * s  # sᵀy > 0
    together = lbfgs_hvp(s, y, v)
    for k in range(4):
        assert torch.allclose(together[:, k], lbfgs_hvp(s, y, v[:, k]))
