"""Server-side Byzantine attacks against hand computations, the stdlib normal quantile and brute force."""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np
import pytest
import torch

from fedsim.attacks.base import Crafted
from fedsim.attacks.byzantine import (
    ALIE,
    IPM,
    AGRAgnosticParams,
    ALIEParams,
    GaussianAttack,
    GaussianParams,
    IPMParams,
    MinMax,
    MinSum,
    SignFlip,
    SignFlipParams,
    alie_z_max,
    halving_search,
)
from fedsim.models.layout import ModelLayout
from fedsim.registry import ATTACKS
from fedsim.updates import RoundContext


def make_ctx(d: int, seed: int = 0) -> RoundContext:
    layout = ModelLayout(names=("w", "b"), shapes=((d - 1,), (1,)))
    return RoundContext(round=1, global_weights=torch.zeros(d), layout=layout, generator=torch.Generator().manual_seed(seed))


HONEST = torch.tensor([[1.0, 2.0, -4.0], [3.0, 4.0, 0.0]])  # mean [2, 3, -2]


def test_ipm_by_hand():
    out = IPM(IPMParams(epsilon=0.1)).craft(HONEST, 3, make_ctx(3)).rows
    torch.testing.assert_close(out, torch.tensor([[-0.2, -0.3, 0.2]] * 3))


def test_sign_flip_by_hand():
    out = SignFlip(SignFlipParams(scale=100.0)).craft(HONEST, 2, make_ctx(3)).rows
    torch.testing.assert_close(out, torch.tensor([[-200.0, -300.0, 200.0]] * 2))
    assert SignFlip(SignFlipParams()).craft(HONEST, 0, make_ctx(3)).rows.shape == (0, 3)
    assert SignFlip.simulation_only is True


# ------------------------------------------------------------------------------------------- ALIE


@pytest.mark.parametrize("n,f", [(50, 10), (50, 3), (50, 12), (20, 4), (10, 1), (7, 3)])
def test_alie_z_max_formula(n, f):
    s = math.floor(n / 2 + 1) - f
    assert alie_z_max(n, f) == pytest.approx(NormalDist().inv_cdf((n - s) / n), abs=1e-9)


def test_alie_z_for_n50_f10_by_hand_and_ndss_table_is_not_this_formula():
    # s = 26 - 10 = 16, (50 - 16) / 50 = 0.68
    assert alie_z_max(50, 10) == pytest.approx(NormalDist().inv_cdf(0.68), abs=1e-12)
    assert alie_z_max(50, 10) == pytest.approx(0.4677, abs=1e-4)
    # NDSS'21 hard-codes z for n = 50; those numbers are Φ(0.52), Φ(0.54), ..., not z_max
    table = {3: 0.69847, 5: 0.7054, 8: 0.71904, 10: 0.72575, 12: 0.73891}
    for (f, z), arg in zip(table.items(), (0.52, 0.54, 0.58, 0.60, 0.64)):
        assert NormalDist().cdf(arg) == pytest.approx(z, abs=5e-6)
        assert abs(alie_z_max(50, f) - z) > 0.15
    with pytest.raises(ValueError):
        alie_z_max(10, 6)  # attackers alone are a majority


@pytest.mark.parametrize("unbiased,ddof", [(True, 1), (False, 0)])
def test_alie_is_mean_plus_z_std_per_coordinate(unbiased, ddof):
    rng = np.random.default_rng(0)
    honest = rng.normal(size=(40, 25)).astype(np.float32)
    attack = ALIE(ALIEParams(unbiased=unbiased))
    crafted = attack.craft(torch.from_numpy(honest), 10, make_ctx(25))
    out = crafted.rows.numpy()
    z = NormalDist().inv_cdf((50 - 16) / 50)
    h64 = honest.astype(np.float64)
    expected = h64.mean(axis=0) + z * h64.std(axis=0, ddof=ddof)
    assert out.shape == (10, 25) and (out == out[0]).all()
    np.testing.assert_allclose(out[0], expected, rtol=1e-5, atol=1e-6)
    assert crafted.log["z"] == pytest.approx(z)

    fixed = ALIE(ALIEParams(z=1.0)).craft(torch.from_numpy(honest), 2, make_ctx(25)).rows.numpy()
    np.testing.assert_allclose(fixed[1], h64.mean(axis=0) + h64.std(axis=0, ddof=1), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------- Min-Max, Min-Sum


def np_perturbation(x: np.ndarray, kind: str) -> np.ndarray:
    mu = x.mean(axis=0)
    return {"unit_vec": -mu / np.linalg.norm(mu), "sign": -np.sign(mu), "std": -x.std(axis=0, ddof=1)}[kind]


def np_condition(x: np.ndarray, p: np.ndarray, gammas: np.ndarray, rule: str) -> np.ndarray:
    """Direct (no Gram trick) check of the NDSS'21 condition for each γ in `gammas`."""
    mal = x.mean(axis=0)[None, :] + gammas[:, None] * p[None, :]  # [G, d]
    d2 = ((mal[:, None, :] - x[None, :, :]) ** 2).sum(axis=2)  # [G, h]
    pair = ((x[:, None, :] - x[None, :, :]) ** 2).sum(axis=2)  # [h, h]
    if rule == "min_max":
        return d2.max(axis=1) <= pair.max()
    return d2.sum(axis=1) <= pair.sum(axis=1).min()


def brute_force_gamma(x: np.ndarray, p: np.ndarray, rule: str, hi: float) -> float:
    """Largest feasible γ on [0, hi): a 0.01 grid, then a 1e-6 grid past the last feasible point."""
    coarse = np.linspace(0.0, hi, 2001)
    ok = np_condition(x, p, coarse, rule)
    last = coarse[np.nonzero(ok)[0].max()]
    fine = np.linspace(last, last + hi / 2000, 10_001)
    ok = np_condition(x, p, fine, rule)
    return float(fine[np.nonzero(ok)[0].max()])


@pytest.mark.parametrize("rule,cls", [("min_max", MinMax), ("min_sum", MinSum)])
@pytest.mark.parametrize("kind", ["std", "unit_vec", "sign"])
def test_agr_agnostic_gamma_is_maximal(rule, cls, kind):
    rng = np.random.default_rng([["min_max", "min_sum"].index(rule), ["std", "unit_vec", "sign"].index(kind)])
    x = (0.3 * rng.normal(size=(9, 30)) + rng.normal(size=(1, 30))).astype(np.float32)
    tol = 1e-5
    attack = cls(AGRAgnosticParams(perturbation=kind, gamma_init=10.0, tolerance=tol))
    crafted = attack.craft(torch.from_numpy(x), 4, make_ctx(30))
    out, gamma = crafted.rows.numpy(), crafted.log["gamma"]

    x64 = x.astype(np.float64)
    p = np_perturbation(x64, kind)
    best = brute_force_gamma(x64, p, rule, hi=20.0)
    assert 0.0 < best < 19.9  # inside the search range [0, 2 γ₀)
    assert np_condition(x64, p, np.array([gamma]), rule)[0]
    assert not np_condition(x64, p, np.array([gamma + 2 * tol + 2e-6]), rule)[0]
    assert best - 2 * tol - 2e-6 <= gamma <= best + 1e-6
    assert out.shape == (4, 30) and (out == out[0]).all()
    np.testing.assert_allclose(out[0], x64.mean(axis=0) + gamma * p, rtol=1e-5, atol=1e-5)


def test_min_sum_is_stricter_than_min_max():
    rng = np.random.default_rng(7)
    x = torch.from_numpy(rng.normal(size=(10, 20)).astype(np.float32))
    mm, ms = MinMax(AGRAgnosticParams()), MinSum(AGRAgnosticParams())
    assert ms.craft(x, 2, make_ctx(20)).log["gamma"] < mm.craft(x, 2, make_ctx(20)).log["gamma"]


def test_halving_search_brackets_the_threshold():
    for threshold in (0.0123, 3.3, 7.77777, 19.5):
        got = halving_search(lambda g: g <= threshold, 10.0, 1e-5)
        assert threshold - 2e-5 <= got <= threshold
    assert halving_search(lambda g: False, 10.0, 1e-5) == 0.0
    assert 20.0 - 2e-5 <= halving_search(lambda g: True, 10.0, 1e-5) < 20.0


# ---------------------------------------------------------------------------------------- Gaussian


def test_gaussian_is_deterministic_per_seed_and_relative_to_honest_norm():
    d = 20_000
    honest = torch.randn(6, d, generator=torch.Generator().manual_seed(1)) * 0.01
    attack = GaussianAttack(GaussianParams(sigma=2.0))
    crafted = attack.craft(honest, 3, make_ctx(d, seed=4))
    a = crafted.rows
    b = attack.craft(honest, 3, make_ctx(d, seed=4)).rows
    c = attack.craft(honest, 3, make_ctx(d, seed=5)).rows
    assert torch.equal(a, b) and not torch.equal(a, c)
    mean_norm = honest.norm(dim=1).mean().item()
    assert crafted.log["noise_std"] == pytest.approx(2.0 * mean_norm / math.sqrt(d), rel=1e-6)
    # ||N(0, s² I_d)|| concentrates at s·sqrt(d) with sd ≈ s/sqrt(2); 1% is far beyond 6 sd here
    np.testing.assert_allclose(a.norm(dim=1).numpy(), 2.0 * mean_norm, rtol=0.01)

    absolute = GaussianAttack(GaussianParams(sigma=0.5, relative=False)).craft(honest, 2, make_ctx(d)).rows
    assert absolute.double().std().item() == pytest.approx(0.5, rel=0.02)


# ----------------------------------------------------------------------------- every registration


# server attacks that train on the attackers' data through the server's runtime (RoundContext.tools):
# run for real in their own tests (tests/test_attack_threedfed.py); on bare tensors they refuse clearly
NEEDS_RUNTIME = {"threedfed"}


def test_an_attack_that_needs_the_runtime_says_so_on_bare_tensors():
    for name in NEEDS_RUNTIME:
        entry = ATTACKS.get(name)
        with pytest.raises(ValueError, match="needs the server's runtime"):
            entry.obj(entry.params()).craft(torch.randn(8, 30), 3, make_ctx(30))


@pytest.mark.parametrize("name", [e.name for e in ATTACKS.entries() if e.obj.side == "server" and e.name not in NEEDS_RUNTIME])
def test_every_server_attack_runs_from_defaults(name):
    entry = ATTACKS.get(name)
    honest = torch.randn(8, 30, generator=torch.Generator().manual_seed(12))
    attack = entry.obj(entry.params())
    crafted = attack.craft(honest, 3, make_ctx(30))
    mal, again = crafted.rows, entry.obj(entry.params()).craft(honest, 3, make_ctx(30)).rows
    assert isinstance(crafted, Crafted) and isinstance(crafted.log, dict)
    assert mal.shape == (3, 30) and mal.dtype == honest.dtype and torch.isfinite(mal).all()
    assert torch.equal(mal, again)
