"""AlignIns (defenses/alignins.py) against independent oracles: a tiny round worked by hand, a
numpy re-implementation written from the paper's definitions (loops, np.median, np.std) on random
rounds, properties (permutation, the thresholds, a sign-flipped update), and a short digits run
whose detection audit counts what AlignIns removed."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from conftest import quick_scenario, round_context, run_local, update_batch
from fedsim.defenses.alignins import AlignIns, AlignInsParams, alignins_filter, alignment_scores, mz_scores


def run_alignins(rows, global_weights, ids=None, weights=None, **params):
    rows = np.asarray(rows, dtype=np.float64)
    batch = update_batch(rows, ids, weights, weight=10.0)
    ctx = round_context(global_weights=torch.tensor(np.asarray(global_weights), dtype=torch.float32))
    return batch, *AlignIns(AlignInsParams(**params)).before(batch, ctx)


def oracle(rows: np.ndarray, theta: np.ndarray, sparsity: float, lambda_s: float, lambda_c: float):
    """The paper's steps one client at a time: (tda, mpsa, mz_tda, mz_mpsa, keep)."""
    n, d = rows.shape
    principal = np.sign(np.sign(rows).sum(axis=0))
    k = max(1, int(d * sparsity))
    tda, mpsa = [], []
    for u in rows:
        tda.append(float(u @ theta) / (np.linalg.norm(u) * np.linalg.norm(theta)))
        top = np.argsort(-np.abs(u))[:k]
        mpsa.append(sum(np.sign(u[c]) == principal[c] for c in top) / k)

    def mz(x):
        x = np.array(x)
        if np.std(x) == 0:  # fedsim's reading: nobody deviates (the official code divides 0 by 0 and removes all)
            return np.zeros_like(x)
        return np.abs(x - np.median(x)) / np.std(x)

    mz_tda, mz_mpsa = mz(tda), mz(mpsa)
    keep = [bool(mz_tda[i] < lambda_c and mz_mpsa[i] < lambda_s) for i in range(n)]
    return np.array(tda), np.array(mpsa), mz_tda, mz_mpsa, keep


# ------------------------------------------------------------------------------------- by hand

HAND = np.array([
    [3.0, -1.0, 0.5, 2.0],   # signs + - + +
    [2.0, 1.0, -0.5, 1.5],   # signs + + - +
    [-4.0, -2.0, -3.0, 0.5],  # signs - - - +
    [1.0, -3.0, -0.25, 2.5],  # signs + - - +
])
THETA = np.array([1.0, 1.0, 0.0, 0.0])


def test_alignins_by_hand():
    # principal sign: sgn(sum of signs) = sgn([2, -2, -2, 4]) = [+, -, -, +]; ρ = 0.5: k = 2
    # top-2 by magnitude: row 0 {0, 3} (+,+ agree 2/2), row 1 {0, 3} (2/2), row 2 {0, 2} (-,- : 1/2),
    # row 3 {1, 3} (-,+ : 2/2)  ->  MPSA = [1, 1, 1/2, 1], median 1, std = √3/8 (mean 7/8)
    # MZ(MPSA) = [0, 0, (1/2)/(√3/8) = 4/√3 ≈ 2.31, 0]
    # TDA = cos(Δ_i, θ) = (Δ_i0 + Δ_i1) / (||Δ_i|| √2): [2/√14.25, 3/√7.5, -6/√29.25, -2/√16.3125] / √2
    _, out, log = run_alignins(HAND, THETA, ids=(10, 11, 12, 13), sparsity=0.5)
    tda = np.array([2 / math.sqrt(14.25), 3 / math.sqrt(7.5), -6 / math.sqrt(29.25), -2 / math.sqrt(16.3125)]) / math.sqrt(2)
    mz_tda = np.abs(tda - np.median(tda)) / np.std(tda)
    np.testing.assert_allclose(list(log["tda"].values()), tda, rtol=1e-6)
    assert log["mpsa"] == {10: 1.0, 11: 1.0, 12: 0.5, 13: 1.0}
    np.testing.assert_allclose(list(log["mz_mpsa"].values()), [0, 0, 4 / math.sqrt(3), 0], rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(list(log["mz_tda"].values()), mz_tda, rtol=1e-6)
    # TDA ≈ [0.375, 0.775, -0.785, -0.350]: median (tda[0] + tda[3]) / 2 ≈ 0.012, std ≈ 0.608, MZ ≈ [0.60, 1.25, 1.31, 0.60]
    assert mz_tda[1] > 1 and mz_tda[0] < 1 and mz_tda[3] < 1  # row 1: TDA only; row 2: MPSA (and TDA)
    assert log["removed"] == [11, 12]
    # kept rows 0 and 3, norms √14.25 ≈ 3.775 and √16.3125 ≈ 4.039: torch's lower median √14.25 clips row 3
    assert log["clip_norm"] == pytest.approx(math.sqrt(14.25), rel=1e-6)
    assert log["clipped"] == {13: pytest.approx(math.sqrt(14.25 / 16.3125), rel=1e-6)}
    assert out.client_ids == (10, 13) and torch.equal(out.weights, torch.tensor([10.0, 10.0]))
    np.testing.assert_allclose(out.updates.numpy(), [HAND[0], HAND[3] * math.sqrt(14.25 / 16.3125)], rtol=1e-6)
    json.dumps(log)


def test_the_thresholds_pick_each_metric():
    # λ_c high: only MPSA filters (row 2); λ_s high: only TDA (rows 1 and 2, TDA ≈ -0.78 the far low one)
    assert run_alignins(HAND, THETA, sparsity=0.5, lambda_c=10.0)[2]["removed"] == [2]
    _, _, log = run_alignins(HAND, THETA, sparsity=0.5, lambda_s=10.0)
    assert log["removed"] == [1, 2] and log["mz_tda"][2] > 1
    # exactly at the threshold an update is removed (strict <, as the official code): MZ(MPSA) of row 2 is 4/√3
    at = log["mz_mpsa"][2]
    assert at == pytest.approx(4 / math.sqrt(3), rel=1e-12)
    assert run_alignins(HAND, THETA, sparsity=0.5, lambda_c=10.0, lambda_s=at)[2]["removed"] == [2]
    assert run_alignins(HAND, THETA, sparsity=0.5, lambda_c=10.0, lambda_s=at + 1e-9)[2]["removed"] == []


@pytest.mark.parametrize("n,d,sparsity", [(3, 7, 0.3), (5, 40, 0.3), (8, 100, 0.1), (12, 33, 0.5), (20, 64, 1.0)])
def test_alignins_matches_the_numpy_oracle(n, d, sparsity):
    rng = np.random.default_rng(n * d)
    rows = rng.normal(size=(n, d)) * rng.uniform(0.2, 2.0, size=(n, 1))
    rows[: n // 3] += rng.normal(size=d)  # a group sharing a direction, so the scores spread
    theta = rng.normal(size=d)
    tda, mpsa, mz_tda, mz_mpsa, keep = oracle(rows, theta, sparsity, 1.0, 1.0)
    got_keep, scores = alignins_filter(torch.tensor(rows), torch.tensor(theta), sparsity, 1.0, 1.0)
    np.testing.assert_allclose(scores["tda"].numpy(), tda, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(scores["mpsa"].numpy(), mpsa, rtol=0, atol=1e-12)
    np.testing.assert_allclose(scores["mz_tda"].numpy(), mz_tda, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(scores["mz_mpsa"].numpy(), mz_mpsa, rtol=1e-9, atol=1e-12)
    assert got_keep.tolist() == keep
    # then the kept rows are clipped to their median norm (lower middle value for an even count)
    batch, out, log = run_alignins(rows, theta, sparsity=sparsity)
    kept = rows[np.array(keep)].astype(np.float32).astype(np.float64)
    if len(kept):
        norms = np.sort(np.linalg.norm(kept, axis=1))
        median = norms[(len(norms) - 1) // 2]
        expected = kept * np.minimum(1.0, median / np.linalg.norm(kept, axis=1))[:, None]
        np.testing.assert_allclose(out.updates.numpy(), expected, rtol=1e-5, atol=1e-7)
        assert log["clip_norm"] == pytest.approx(median, rel=1e-6)


def test_mz_scores_edge_cases():
    assert mz_scores(torch.tensor([0.3, 0.3, 0.3])).tolist() == [0.0, 0.0, 0.0]  # std 0: nobody deviates
    assert mz_scores(torch.tensor([0.2, 0.8])).tolist() == pytest.approx([1.0, 1.0])  # n = 2: always equal
    assert mz_scores(torch.tensor([5.0])).tolist() == [0.0]
    x = torch.tensor([0.0, 0.0, 1.0])  # median 0, std √2/3
    assert mz_scores(x).tolist() == pytest.approx([0.0, 0.0, 3 / math.sqrt(2)])


def test_mpsa_keeps_at_least_one_coordinate_and_reads_the_principal_sign():
    rows = torch.tensor([[1.0, -2.0, 3.0], [1.0, 2.0, 3.0], [-1.0, 2.0, -3.0]])  # principal [+, +, +]
    _, mpsa = alignment_scores(rows, torch.ones(3), 0.01)  # ⌊0.03⌋ = 0 -> k = 1: the largest coordinate
    assert mpsa.tolist() == [1.0, 1.0, 0.0]
    _, mpsa = alignment_scores(rows, torch.ones(3), 2 / 3)  # k = 2: coordinates 2 and 1
    assert mpsa.tolist() == [0.5, 1.0, 0.5]


# ---------------------------------------------------------------------------------- properties


def honest_round(n: int, d: int, seed: int, noise: float = 0.5):
    """n honest updates: one shared direction plus noise; the global model leans the same way."""
    rng = np.random.default_rng(seed)
    common = rng.normal(size=d)
    rows = common + noise * rng.normal(size=(n, d))
    theta = 0.3 * common + rng.normal(size=d)
    return rows, theta


@pytest.mark.parametrize("seed", range(4))
def test_flags_are_permutation_equivariant(seed):
    rows, theta = honest_round(9, 50, seed, noise=1.0)
    ids = tuple(range(100, 109))
    _, out, log = run_alignins(rows, theta, ids=ids)
    perm = np.random.default_rng(seed + 10).permutation(9)
    _, out_p, log_p = run_alignins(rows[perm], theta, ids=tuple(ids[i] for i in perm))
    assert sorted(log_p["removed"]) == sorted(log["removed"])
    for key in ("tda", "mpsa", "mz_tda", "mz_mpsa"):
        assert log_p[key] == pytest.approx(log[key], rel=1e-9, abs=1e-12)
    by_id = dict(zip(out.client_ids, out.updates))
    for c, row in zip(out_p.client_ids, out_p.updates):
        torch.testing.assert_close(row, by_id[c])


@pytest.mark.parametrize("seed", range(4))
def test_without_attacker_it_keeps_exactly_the_clients_within_both_thresholds(seed):
    rows, theta = honest_round(10, 60, seed, noise=1.5)
    for lam in (1.0, 1.5, 2.0):
        _, out, log = run_alignins(rows, theta, lambda_s=lam, lambda_c=lam)
        within = [c for c in range(10) if log["mz_tda"][c] < lam and log["mz_mpsa"][c] < lam]
        assert list(out.client_ids) == within and log["removed"] == [c for c in range(10) if c not in within]
        if lam == 1.0:  # σ <= RMS deviation from the median <= the largest: someone's MZ is >= 1, honest or not
            assert log["removed"]
    # the median client of each metric has MZ 0 there; thresholds beyond every MZ-score keep everyone
    top = max(max(log["mz_tda"].values()), max(log["mz_mpsa"].values()))
    _, out, log = run_alignins(rows, theta, lambda_s=top + 0.01, lambda_c=top + 0.01)
    assert log["removed"] == [] and out.client_ids == tuple(range(10))


@pytest.mark.parametrize("seed", range(4))
def test_a_sign_flipped_update_is_flagged_by_each_metric(seed):
    rows, theta = honest_round(10, 80, seed, noise=0.5)
    rows[7] = -rows[:7].mean(axis=0)  # an update of flipped sign, of ordinary norm
    assert run_alignins(rows, theta)[2]["removed"] == [7]
    assert 7 in run_alignins(rows, theta, lambda_c=100.0)[2]["removed"]  # MPSA alone
    assert 7 in run_alignins(rows, theta, lambda_s=100.0)[2]["removed"]  # TDA alone


def test_clipping_can_be_turned_off_and_zero_updates_are_left_alone():
    rows, theta = honest_round(7, 30, 0)
    rows[3] *= 50.0  # long but aligned
    _, out, log = run_alignins(rows, theta, clip=False, lambda_s=10.0, lambda_c=10.0)
    assert "clipped" not in log and "clip_norm" not in log
    np.testing.assert_allclose(out.updates.numpy(), rows.astype(np.float32))
    _, out, log = run_alignins(np.zeros((4, 5)), np.ones(5))  # every score 0, every MZ 0: all kept
    assert log["removed"] == [] and log["clip_norm"] == 0.0 and torch.equal(out.updates, torch.zeros(4, 5))


def test_round_problem_below_three_updates():
    params = AlignInsParams()
    assert params.round_problem(3) is None and params.round_problem(20) is None
    for n in (1, 2):
        field, reason, value = params.round_problem(n)
        assert field == "" and value == n and reason.startswith("alignins") and f"n={n}" in reason


# ---------------------------------------------------------------------------------- a real run


def test_digits_run_audit_counts_what_alignins_removed(tmp_path):
    scenario = quick_scenario(
        "aggregator=fedavg", "defenses=[{name: alignins}]",
        "attack={name: sign_flip, num_attackers: 1, schedule: {name: every_round, attackers_per_round: 1}}",
        federation={"num_clients": 8, "clients_per_round": 7, "rounds": 2, "local_epochs": 1},
    )
    rounds = run_local(scenario, tmp_path).rounds
    assert [r["round"] for r in rounds] == [1, 2]
    for r in rounds:
        info, det = r["defenses"]["alignins"], r["detection"]
        assert r["skipped"] is None and len(r["attackers"]) == 1
        assert det["flagged"] == sorted(info["removed"])  # the audit reads AlignIns' removals
        assert set(r["attackers"]) <= set(info["removed"])  # -mean(honest): opposite signs, opposite cosine
        assert det["tp"] == 1 and det["fn"] == 0 and det["fp"] == len(info["removed"]) - 1
        assert {int(c) for c in info["mz_tda"]} == set(r["sampled"]) - set(r["rejected"])
