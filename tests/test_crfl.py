"""CRFL against independent oracles: the clipping bound by hand, noise statistics, Clopper–Pearson
against scipy's Beta quantiles and the binomial tail, votes against a loop, the radius by hand,
and one run through the central evaluator."""

from __future__ import annotations

import copy
import json
import math

import numpy as np
import pytest
import torch
from scipy import stats

from conftest import QUICKSTART, quick_scenario, round_context, run_local
from fedsim.defenses.crfl import (
    CRFL,
    CRFLParams,
    certified_radius,
    certify,
    certify_counts,
    clip_bound,
    contraction,
    noisy_weights,
    probability_bounds,
    top_two,
    vote_counts,
)
from fedsim.registry import DEFENSES
from fedsim.seeding import derive_seed
from fedsim.updates import RoundContext


def make_ctx(global_weights: torch.Tensor, rnd: int = 1, seed: int = 0) -> RoundContext:
    """The shared round context around `global_weights`, on a layout of a weight vector and a one-value bias."""
    return round_context(rnd=rnd, seed=seed, global_weights=global_weights, bias=True)


def tiny_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3))


# ------------------------------------------------------------------------------------ training


def test_registered_with_certify_capability():
    entry = DEFENSES.get("crfl")
    assert entry.obj is CRFL and entry.load("certify") is certify
    p = CRFLParams()
    assert (p.rho_max, p.rho_slope, p.rho_intercept, p.sigma) == (15.0, 0.1, 2.0, 0.01)  # paper's MNIST row
    assert (p.sigma_test, p.alpha, p.certify_every) == (0.01, 0.001, None)


def test_clip_bound_by_hand():
    # MNIST: min(15, 0.1 t + 2)
    assert clip_bound(1, 15, 0.1, 2) == pytest.approx(2.1)
    assert clip_bound(10, 15, 0.1, 2) == pytest.approx(3.0)
    assert clip_bound(100, 15, 0.1, 2) == pytest.approx(12.0)
    assert clip_bound(130, 15, 0.1, 2) == pytest.approx(15.0)
    assert clip_bound(500, 15, 0.1, 2) == 15.0
    # EMNIST: min(100, 0.25 t + 4)
    assert clip_bound(8, 100, 0.25, 4) == pytest.approx(6.0)
    assert clip_bound(1000, 100, 0.25, 4) == 100.0


@pytest.mark.parametrize("rnd,rho", [(1, 2.1), (3, 2.3), (200, 15.0)])
def test_after_clips_the_new_global_model_without_noise(rnd, rho):
    g = torch.Generator().manual_seed(1)
    gw = torch.randn(500, generator=g)  # norm ≈ 22, above every ρ_t here
    agg = 0.3 * torch.randn(500, generator=g)
    crfl = CRFL(CRFLParams(sigma=0.0))
    out, info = crfl.after(agg, make_ctx(gw, rnd=rnd))
    new = (gw + out).double()
    before = (gw + agg).double()
    assert new.norm().item() <= rho * (1 + 1e-6)
    assert new.norm().item() == pytest.approx(rho, rel=1e-5)
    cos = torch.nn.functional.cosine_similarity(new, before, dim=0).item()
    assert cos == pytest.approx(1.0, abs=1e-6)
    assert info["rho"] == pytest.approx(rho)
    assert info["norm_before_clip"] == pytest.approx(before.norm().item(), rel=1e-6)
    assert info["clip_factor"] == pytest.approx(rho / (before.norm().item() + 1e-6), rel=1e-6)
    assert info["noise_std"] == 0.0 and "clipped" not in info  # "clipped" is the per-client audit key
    json.dumps(info)


def test_after_leaves_a_model_inside_the_bound_unchanged():
    gw = torch.full((100,), 0.1)  # norm 1
    agg = torch.full((100,), 0.05)  # new global norm 1.5 < ρ_1 = 2.1
    out, info = CRFL(CRFLParams(sigma=0.0)).after(agg, make_ctx(gw))
    torch.testing.assert_close(out, agg, rtol=0, atol=1e-7)
    assert info["clip_factor"] == 1.0


def test_after_noise_std_matches_sigma():
    d = 200_000
    gw = torch.zeros(d)
    agg = torch.full((d,), 1e-3)  # norm 0.45, never clipped
    out, info = CRFL(CRFLParams(sigma=0.01)).after(agg, make_ctx(gw, seed=3))
    noise = (out - agg).double()
    # the sample std of d normals has relative sd 1/sqrt(2d) ≈ 0.0016; 1% is > 6 of those
    assert noise.std().item() == pytest.approx(0.01, rel=0.01)
    assert abs(noise.mean().item()) < 6 * 0.01 / math.sqrt(d)
    assert info["noise_std"] == 0.01


def test_after_clips_before_the_noise():
    d = 50_000
    gw = torch.ones(d)  # norm 223.6, clipped to ρ_1 = 2.1
    out, _ = CRFL(CRFLParams(sigma=0.05)).after(torch.zeros(d), make_ctx(gw, seed=4))
    new = (gw + out).double()
    clipped_value = 2.1 / (math.sqrt(d) + 1e-6)
    noise = new - clipped_value
    assert noise.mean().item() == pytest.approx(0.0, abs=6 * 0.05 / math.sqrt(d))
    assert noise.std().item() == pytest.approx(0.05, rel=0.02)


def test_after_follows_the_generator_seed():
    crfl = CRFL(CRFLParams())
    gw, agg = torch.zeros(1000), torch.full((1000,), 0.01)
    a, _ = crfl.after(agg, make_ctx(gw, seed=7))
    b, _ = crfl.after(agg, make_ctx(gw, seed=7))
    c, _ = crfl.after(agg, make_ctx(gw, seed=8))
    assert torch.equal(a, b) and not torch.equal(a, c)


# ------------------------------------------------------------------------------- certification


def test_hoeffding_bounds_by_hand():
    m, alpha = 20, 0.001
    margin = math.sqrt(math.log(1000) / 40)  # sqrt(ln(1/α) / (2 m)) ≈ 0.416
    lower, upper = probability_bounds(np.array([20, 15, 5]), np.array([0, 5, 1]), m, alpha, "hoeffding")
    np.testing.assert_allclose(lower, [1 - margin, 0.75 - margin, 1e-8])  # the last one clamped up to 1e-8
    np.testing.assert_allclose(upper, [margin, 0.25 + margin, 0.05 + margin])


def test_clopper_pearson_bounds_against_beta_quantiles_and_binomial_tails():
    m, alpha = 50, 0.001
    n_a = np.array([50, 40, 26, 1, 0])
    n_b = np.array([0, 10, 24, 49, 50])
    lower, upper = probability_bounds(n_a, n_b, m, alpha, "clopper_pearson")
    for k, lo in zip(n_a, lower):
        want = 0.0 if k == 0 else stats.beta.ppf(alpha, k, m - k + 1)
        assert lo == pytest.approx(want, rel=1e-12, abs=1e-15)
        if k > 0:  # the exact one-sided bound: P(X >= k | p = lower) = α
            assert stats.binom.sf(k - 1, m, lo) == pytest.approx(alpha, rel=1e-6)
    for k, up in zip(n_b, upper):
        want = 1.0 if k == m else stats.beta.ppf(1 - alpha, k + 1, m - k)
        assert up == pytest.approx(want, rel=1e-12)
        if k < m:  # P(X <= k | p = upper) = α
            assert stats.binom.cdf(k, m, up) == pytest.approx(alpha, rel=1e-6)
    assert lower[0] == pytest.approx(alpha ** (1 / m))  # all votes: (α)^(1/m) in closed form
    assert upper[0] == pytest.approx(1 - alpha ** (1 / m))


def test_top_two_matches_bincount_and_argmax_as_in_the_code():
    rng = np.random.default_rng(0)
    preds = rng.integers(0, 4, size=(30, 9))  # 30 inputs, 9 votes each: many ties
    counts = np.stack([np.bincount(p, minlength=4) for p in preds])
    vote, n_a, n_b = top_two(counts)
    for i, p in enumerate(preds):
        bc = np.bincount(p, minlength=4)
        k_a = np.argmax(bc)
        assert vote[i] == k_a and n_a[i] == bc[k_a]
        bc[k_a] = 0
        assert n_b[i] == bc[np.argmax(bc)]


def test_noisy_copies_do_not_depend_on_batching_and_have_the_test_std():
    model = torch.nn.Linear(300, 100)  # 30 100 parameters
    a = noisy_weights(model, 0.02, seed=5, start=0, stop=6)
    b = noisy_weights(model, 0.02, seed=5, start=2, stop=4)
    for name in a:
        assert torch.equal(a[name][2:4], b[name])
    noise = (a["weight"] - model.weight.detach()[None]).double()
    assert noise.std().item() == pytest.approx(0.02, rel=0.01)
    corr = torch.corrcoef(noise.reshape(6, -1))
    assert (corr - torch.eye(6, dtype=corr.dtype)).abs().max().item() < 0.03  # copies independent


@pytest.mark.parametrize("model_batch", [1, 4, 25])
def test_vote_counts_match_a_loop_over_copies(model_batch):
    model = tiny_model()
    x = np.random.default_rng(1).normal(size=(30, 4)).astype(np.float32)
    m, sigma, seed = 25, 0.5, 11  # a large σ, so that the copies disagree
    got = vote_counts(model, x, m, sigma, seed, model_batch)
    want = np.zeros((30, 3), dtype=np.int64)
    for i in range(m):
        copy_i = copy.deepcopy(model)
        copy_i.load_state_dict({n: w[0] for n, w in noisy_weights(model, sigma, seed, i, i + 1).items()})
        with torch.no_grad():
            logits = copy_i(torch.from_numpy(x))
        for j in range(len(x)):
            want[j, int(torch.argmax(logits[j]))] += 1
    np.testing.assert_array_equal(got, want)
    assert (got.sum(1) == m).all() and (got.max(1) < m).any()  # the noise really changed some votes


class _Untraceable(torch.nn.Module):
    """A net whose forward reads a Python number from its weights, which vmap cannot trace."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)

    def forward(self, x):
        return self.lin(x) * (1.0 + 0.0 * float(self.lin.bias.sum()))


def test_vote_counts_fall_back_to_one_copy_at_a_time():
    torch.manual_seed(0)
    model = _Untraceable()
    x = np.random.default_rng(2).normal(size=(20, 4)).astype(np.float32)
    got = vote_counts(model, x, 12, 0.5, 3, model_batch=5)
    np.testing.assert_array_equal(got, _loop_counts(model, x, 12, 0.5, 3))
    assert (got.max(1) < 12).any()


def _loop_counts(model, x, m, sigma, seed):
    counts = np.zeros((len(x), 3), dtype=np.int64)
    for i in range(m):
        copy_i = copy.deepcopy(model)
        copy_i.load_state_dict({n: w[0] for n, w in noisy_weights(model, sigma, seed, i, i + 1).items()})
        with torch.no_grad():
            pred = copy_i(torch.from_numpy(x)).argmax(1).numpy()
        counts[np.arange(len(x)), pred] += 1
    return counts


def test_radius_by_hand_with_contraction():
    p = CRFLParams(sigma=1.0, sigma_test=2.0, rho_max=2.5, rho_slope=0.1, rho_intercept=2.0,
                   radius_attack_round=3, radius_attackers=1, radius_clients=20, radius_local_iters=30,
                   radius_lipschitz_rho=3.0, radius_scale=100, radius_lr=0.001, radius_poison_ratio=0.05)

    def two_phi_minus_one(z):
        return math.erf(z / math.sqrt(2))

    # rounds 4, 5, 6 at σ = 1 (ρ = 2.4, 2.5 capped, 2.5), round T = 7 at σ_T = 2 (ρ = 2.5)
    contract = two_phi_minus_one(2.4) * two_phi_minus_one(2.5) ** 2 * two_phi_minus_one(2.5 / 2)
    assert contraction(p, 7) == pytest.approx(contract, rel=1e-12)
    assert contraction(p, None) == 1.0

    p_a, p_b = 0.9, 0.05
    numerator = -math.log(1 - (math.sqrt(0.9) - math.sqrt(0.05)) ** 2) * 1.0 ** 2
    # 2 R τ² L_z² (R p²) γ² η² (q/n)² with L_z² = 2 + 6 + 9 = 17, p = 1/20
    denominator = 2 * 1 * 900 * 17 * (1 * (1 / 20) ** 2) * 1e4 * 1e-6 * 0.0025
    want = math.sqrt(numerator / (denominator * contract))
    got = certified_radius(np.array([p_a]), np.array([p_b]), p, contraction(p, 7))
    assert got[0] == pytest.approx(want, rel=1e-12)
    # two attackers with weights p: R appears twice, once as the count and once in Σ p_i²
    two = certified_radius(np.array([p_a]), np.array([p_b]), p.model_copy(update={"radius_attackers": 2}), contract)
    assert two[0] == pytest.approx(want / 2, rel=1e-12)


def test_radius_with_the_code_constants_for_a_clear_vote():
    # the code's MNIST constants, Hoeffding at N_m = 1000: n_A = 1000 → p_A = 1 − 0.0587, p_B = 0.0587
    p = CRFLParams(num_models=1000)
    margin = math.sqrt(math.log(1000) / 2000)
    res = certify_counts(np.array([[1000, 0, 0], [500, 500, 0]]), p)
    assert res["certified"].tolist() == [True, False]  # a tie is never certified
    pa, pb = 1 - margin, margin
    numerator = -math.log(1 - (math.sqrt(pa) - math.sqrt(pb)) ** 2) * 0.01 ** 2
    denominator = 2 * 2 * 30 ** 2 * 17 * 2 * (1 / 20) ** 2 * 100 ** 2 * 0.001 ** 2 * 0.05 ** 2
    assert res["radius"][0] == pytest.approx(math.sqrt(numerator / denominator), rel=1e-9)
    assert res["radius"][1] == 0.0


def test_certify_reports_shares_and_is_deterministic():
    model = tiny_model(2)
    rng = np.random.default_rng(3)
    x = rng.normal(size=(80, 4)).astype(np.float32)
    with torch.no_grad():
        y = model(torch.from_numpy(x)).argmax(1).numpy()  # labels = the clean model's predictions
    y[:10] = (y[:10] + 1) % 3  # ten wrong
    sets = {"main": (x, y), "backdoor": (x[:20], np.full(20, 1, dtype=np.int64))}
    spec = CRFLParams(num_models=40, certify_subset=50, sigma_test=0.05, model_batch=7)
    a = certify(spec, model, sets, seed=9)
    b = certify(spec, model, sets, seed=9)
    assert a == b
    json.dumps(a)
    main, bd = a["main"], a["backdoor"]
    assert main["n"] == 50 and bd["n"] == 20
    for key in ("smoothed_accuracy", "certified_accuracy", "certified_share"):
        assert 0.0 <= main[key] <= 1.0
    for key in ("smoothed_success", "certified_success", "certified_not_target", "certified_share"):
        assert 0.0 <= bd[key] <= 1.0
    assert main["certified_accuracy"] <= min(main["smoothed_accuracy"], main["certified_share"])
    assert bd["certified_success"] + bd["certified_not_target"] == pytest.approx(bd["certified_share"])
    assert main["certified_share"] > 0.5 and main["mean_radius"] > 0  # small σ_T: most votes unanimous
    # oracle on the same subset: certified ⇔ Hoeffding bounds separate
    keep = np.sort(np.random.default_rng(derive_seed(0xCE75, 80)).choice(80, 50, replace=False))
    counts = vote_counts(model, x[keep], 40, 0.05, 9, 40)
    vote, n_a, n_b = top_two(counts)
    margin = math.sqrt(math.log(1000) / 80)
    cert = (n_a / 40 - margin) > (n_b / 40 + margin)
    assert main["certified_share"] == pytest.approx(cert.mean())
    assert main["smoothed_accuracy"] == pytest.approx((vote == y[keep]).mean())
    assert main["certified_accuracy"] == pytest.approx((cert & (vote == y[keep])).mean())


def test_certify_through_the_evaluator_on_a_two_round_quickstart(tmp_path):
    scenario = quick_scenario(
        "federation.rounds=2", "federation.num_clients=8", "federation.clients_per_round=5",
        "attack.schedule.every=1", "attack.schedule.first=1",
        "defenses=[{name: crfl, num_models: 20, certify_subset: 50}]", base=QUICKSTART,
    )
    rounds = run_local(scenario, tmp_path).rounds
    assert [r["round"] for r in rounds] == [1, 2]
    assert "certification" not in rounds[0]  # certify_every None: the last round only
    for r in rounds:
        assert r["defenses"]["crfl"]["rho"] == pytest.approx(0.1 * r["round"] + 2)
        # ||clipped + noise|| <= ρ_t + ||noise||, and ||noise|| ≈ σ sqrt(d) for the 4810-parameter MLP
        assert r["global_norm"] <= r["defenses"]["crfl"]["rho"] + 1.1 * 0.01 * math.sqrt(4810)
    cert = rounds[-1]["certification"]["crfl"]
    assert cert["num_models"] == 20 and cert["main"]["n"] == 50
    for key in ("smoothed_accuracy", "certified_accuracy", "certified_share"):
        assert 0.0 <= cert["main"][key] <= 1.0, key
    for key in ("smoothed_success", "certified_success", "certified_not_target", "certified_share"):
        assert 0.0 <= cert["backdoor"][key] <= 1.0, key
