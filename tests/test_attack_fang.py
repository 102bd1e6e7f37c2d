"""Fang et al.'s attacks on Krum and on the trimmed mean (#20), against independent oracles: a
brute-force Krum and the paper's λ bound in numpy, the paper's sampling intervals, and whole rounds
on digits (in-process grid)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import QUICKSTART, quick_scenario, round_context, run_local

from fedsim.aggregators.coordinate import median, trimmed_mean
from fedsim.attacks.byzantine import ALIE, IPM, ALIEParams, IPMParams
from fedsim.attacks.fang import FangKrum, FangKrumParams, FangTrim, FangTrimParams
from fedsim.scenario import ScenarioError, load_scenario


# ------------------------------------------------------------------------------ numpy oracles


def np_krum_pick(rows: np.ndarray, f: int) -> int:
    """Blanchard et al.'s Krum by brute force: for each row, the sum of its n - f - 2 smallest squared
    distances to the other rows; the lowest score (first on ties)."""
    n = len(rows)
    scores = []
    for i in range(n):
        d2 = sorted(float(((rows[i] - rows[j]) ** 2).sum()) for j in range(n) if j != i)
        scores.append(sum(d2[: n - f - 2]))
    return int(np.argmin(scores))


def np_fang_bound(x: np.ndarray, c: int) -> float:
    """The paper's λ bound for Krum's f = c, written out with loops (model space with w_Re = 0)."""
    h, d = x.shape
    m = h + c
    sums = []
    for i in range(h):
        dist = sorted(float(np.linalg.norm(x[i] - x[j])) for j in range(h) if j != i)
        sums.append(sum(dist[: m - c - 2]))
    return min(sums) / ((m - 2 * c - 1) * math.sqrt(d)) + max(float(np.linalg.norm(x[i])) for i in range(h)) / math.sqrt(d)


def digits_updates(num_clients: int, seed: int = 0, steps: int = 3, lr: float = 0.5) -> torch.Tensor:
    """[num_clients, d] honest updates of a small MLP on scikit-learn's digits: IID shards of equal
    size, `steps` full-batch gradient steps from a common initial model, all clients at once."""
    from sklearn.datasets import load_digits
    from torch.func import functional_call, grad, vmap

    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(seed).permutation(len(y))
    per = len(y) // num_clients
    idx = order[: per * num_clients].reshape(num_clients, per)
    xs, ys = torch.tensor(x[idx] / 16.0, dtype=torch.float32), torch.tensor(y[idx])
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    start = {k: v.detach() for k, v in net.named_parameters()}

    def loss(params, xb, yb):
        return torch.nn.functional.cross_entropy(functional_call(net, params, (xb,)), yb)

    params = {k: v.expand(num_clients, *v.shape).clone() for k, v in start.items()}
    step = vmap(grad(loss))
    for _ in range(steps):
        g = step(params, xs, ys)
        params = {k: params[k] - lr * g[k] for k in params}
    return torch.cat([(params[k] - start[k]).reshape(num_clients, -1) for k in start], dim=1)


# ---------------------------------------------------------------------------------- fang_krum


def test_fang_krum_lambda_bound_matches_the_papers_formula():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(9, 40)) * rng.uniform(0.5, 2.0, size=(9, 1))
    from fedsim.aggregators.distances import pairwise_sq_distances
    from fedsim.attacks.fang import fang_lambda_bound

    xt = torch.from_numpy(x)
    for c in (1, 2, 3):
        got = fang_lambda_bound(pairwise_sq_distances(xt), torch.linalg.vector_norm(xt, dim=1), 9 + c, c, c, 40)
        assert got == pytest.approx(np_fang_bound(x, c), rel=1e-9)


def test_fang_krum_is_selected_by_krum_in_the_papers_setting():
    """100 clients of which c = 20 compromised, Krum with f = c (Fang et al.'s MNIST setting): the
    crafted update is Krum's pick, λ is the bound halved the fewest times that makes it so, and the
    other attackers sit within ε of the first."""
    updates = digits_updates(100)
    honest = updates[:80]
    attack = FangKrum(FangKrumParams())
    crafted = attack.craft(honest, 20, round_context(honest.shape[1], seed=5))
    mal, log = crafted.rows, crafted.log
    lam = log["lambda"]
    assert log["selected"] is True and mal.shape == (20, honest.shape[1]) and mal.dtype == honest.dtype

    x = honest.double().numpy()
    rows = np.concatenate([x, mal.double().numpy()])
    assert np_krum_pick(rows, 20) >= 80  # an oracle Krum picks an attacker

    s = np.sign(x.mean(axis=0))
    np.testing.assert_allclose(mal[0].double().numpy(), -lam * s, rtol=1e-6, atol=1e-9)
    offsets = np.linalg.norm(rows[81:] - rows[80], axis=1)
    assert (offsets <= 0.01 + 1e-6).all() and (offsets > 0).all()
    bound = np_fang_bound(x, 20)
    assert lam == pytest.approx(bound / 2 ** log["halvings"], rel=1e-9)
    if log["halvings"]:  # twice this λ (the previous try) was not picked: λ is the largest on the halving grid
        tried = rows.copy()
        tried[80:] = tried[80:] + (-lam * s)  # −2λs + the same offsets
        assert np_krum_pick(tried, 20) < 80


def test_fang_krum_with_exact_copies_and_an_explicit_krum_f():
    rng = np.random.default_rng(11)
    honest = torch.from_numpy((0.2 * rng.normal(size=(12, 50)) + 0.05).astype(np.float32))
    attack = FangKrum(FangKrumParams(epsilon=0.0, krum_f=3))
    crafted = attack.craft(honest, 3, round_context(50))
    mal = crafted.rows
    assert (mal == mal[0]).all() and crafted.log["selected"]
    assert np_krum_pick(np.concatenate([honest.double().numpy(), mal.double().numpy()]), 3) >= 12


def test_fang_krum_round_too_small_for_krum_ends_at_the_stop_threshold():
    honest = torch.randn(3, 20, generator=torch.Generator().manual_seed(0))
    attack = FangKrum(FangKrumParams(stop_threshold=1e-3))
    crafted = attack.craft(honest, 2, round_context(20))  # n = 5 < 2f + 3 = 7: Krum cannot score
    mal = crafted.rows
    assert crafted.log["selected"] is False and crafted.log["lambda"] < 1e-3
    assert torch.isfinite(mal).all()


# ---------------------------------------------------------------------------------- fang_trim


@pytest.mark.parametrize("b", [2.0, 3.5])
def test_fang_trim_values_lie_past_the_honest_range_opposite_the_honest_direction(b):
    g = torch.Generator().manual_seed(2)
    honest = torch.randn(10, 400, generator=g) + 0.5 * torch.randn(400, generator=g)
    honest[:, :5] = 0.0  # untouched parameters: s = 0, everyone sends 0
    attack = FangTrim(FangTrimParams(b=b))
    mal = attack.craft(honest, 4, round_context(400, seed=9)).rows.double()
    x = honest.double()
    s, lo, hi = torch.sign(x.mean(0)), x.min(0).values, x.max(0).values
    up, down = s > 0, s < 0
    assert (mal[:, up] <= lo[up]).all() and (mal[:, down] >= hi[down]).all()
    assert (mal[:, :5] == 0).all()
    # the paper's intervals: [min/b, min] or [b·min, min] on the min side, [max, b·max] or [max/b, max] on the max side
    lo_ok = torch.where(lo > 0, mal >= lo / b - 1e-12, mal >= b * lo - 1e-12)
    hi_ok = torch.where(hi > 0, mal <= b * hi + 1e-12, mal <= hi / b + 1e-12)
    assert lo_ok[:, up].all() and hi_ok[:, down].all()
    assert len(torch.unique(mal[:, up][:, 0])) == 4  # each attacker its own draw
    again = attack.craft(honest, 4, round_context(400, seed=9)).rows.double()
    other = attack.craft(honest, 4, round_context(400, seed=10)).rows.double()
    assert torch.equal(mal, again) and not torch.equal(mal, other)


def test_fang_trim_moves_median_and_trimmed_mean_further_than_alie_and_ipm():
    """Heterogeneous honest updates (spread as large as the mean), 16 honest and 4 attackers (20 %):
    the aggregate lands further from the honest mean under fang_trim than under ALIE (z_max) or
    IPM (ε = 0.1). Not a law: with many clients ALIE's z_max grows and its median shift matches
    Fang's; with a mean far larger than the spread, IPM's -0.1·μ is below every honest value and
    moves the median exactly as much as Fang's values do."""
    for seed in range(5):
        g = torch.Generator().manual_seed(seed)
        d = 300
        honest = torch.randn(d, generator=g) + torch.randn(16, d, generator=g)
        mean = honest.mean(0)
        shift = {}
        for name, attack in (("fang", FangTrim(FangTrimParams())), ("alie", ALIE(ALIEParams())), ("ipm", IPM(IPMParams(epsilon=0.1)))):
            rows = torch.cat([honest, attack.craft(honest, 4, round_context(d, seed=seed)).rows])
            w = torch.ones(20)
            shift[name] = [float((median(rows, w) - mean).norm()), float((trimmed_mean(rows, w, num_trim=4) - mean).norm())]
        for rule in (0, 1):
            assert shift["fang"][rule] > 1.05 * max(shift["alie"][rule], shift["ipm"][rule]), (seed, rule, shift)


# --------------------------------------------------------------------------- YAML and rounds


@pytest.mark.parametrize("override,field", [
    ("attack={name: fang_trim, b: 0.5}", "attack.fang_trim.b"),
    ("attack={name: fang_krum, stop_threshold: 0}", "attack.fang_krum.stop_threshold"),
    ("attack={name: fang_krum, epsilon: -1}", "attack.fang_krum.epsilon"),
])
def test_bad_parameters_name_their_field(override, field):
    with pytest.raises(ScenarioError) as err:
        load_scenario("scenarios/quickstart.yaml", [override])
    assert field in str(err.value)


def digits_run(parent, *overrides):
    """The quickstart on digits with 10 clients, all in every round, in-process, with checkpoints."""
    scenario = quick_scenario("federation.num_clients=10", "federation.clients_per_round=10",
                              "federation.local_epochs=1", *overrides, base=QUICKSTART)
    return run_local(scenario, parent, checkpoints=True, client_states=True)


def test_fang_krum_is_picked_by_krum_every_round_on_digits(tmp_path):
    run = digits_run(tmp_path, "federation.rounds=3", "aggregator={name: krum, num_malicious: 3}",
                     "attack={name: fang_krum, num_attackers: 3, schedule: fixed_pool}")
    assert run.summary["rounds_completed"] == 3 and len(run.rounds) == 3
    for r in run.rounds:
        assert len(r["attackers"]) == 3 and r["aggregator"]["selected"][0] in r["attackers"]


def test_fang_trim_runs_whole_rounds_on_digits(tmp_path):
    run = digits_run(tmp_path, "federation.rounds=2", "aggregator={name: trimmed_mean, num_trim: 2}",
                     "attack={name: fang_trim, num_attackers: 2, schedule: fixed_pool}")
    assert run.summary["rounds_completed"] == 2
    for r in run.rounds:
        assert r["skipped"] is None and len(r["attackers"]) == 2 and math.isfinite(r["main_accuracy"])
