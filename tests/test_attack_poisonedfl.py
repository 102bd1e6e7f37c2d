"""PoisonedFL (Xie, Fang & Gong 2025), against independent oracles: a line-by-line port of the
official `poisonedfl` and its driver loop (float64 numpy), the hand formula λ·v⊙s, the official
binomial thresholds, the rule for c, that nothing of the honest updates is read, its state through
a pipeline checkpoint, and whole rounds on digits through the in-process grid."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import quick_scenario, round_context, run_local

from fedsim.attacks.poisonedfl import PoisonedFL, PoisonedFLParams, aligned_threshold
from fedsim.registry import ATTACKS
from fedsim.scenario import ScenarioError, load_scenario
from fedsim.server.pipeline import RoundPipeline
from fedsim.updates import UpdateBatch

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def official_rounds(thetas: list[np.ndarray], s: np.ndarray, sf: float, period: int, k99: int) -> tuple[list, list]:
    """The official code's fake-client update in iterations e = 0, 1, ... (test_agr.py's loop with
    `poisonedfl` of byzantine.py), written out in numpy: thetas[e] is the model received in e."""
    history = last_50 = None
    last_grad = np.zeros_like(thetas[0])
    sent, factors = [], []
    for e, current in enumerate(thetas):
        if history is None:
            mal = np.zeros_like(current)
        else:
            scale = np.abs(history - last_grad * np.linalg.norm(history) / (np.linalg.norm(last_grad) + 1e-9))
            deviation = scale * s / (np.linalg.norm(scale) + 1e-9)
            if e % period == 0:
                total = current - last_50
                total = np.where(total == 0, current, total)
                if (np.sign(total) == s).sum() < k99 and sf * 0.7 >= 0.5:
                    sf = sf * 0.7
            mal = sf * np.linalg.norm(history) * deviation
        sent.append(mal)
        factors.append(sf)
        last_grad = mal
        if e + 1 < len(thetas):
            if e % period == 0:
                last_50 = thetas[e + 1]  # the model after this iteration's aggregation
            history = thetas[e + 1] - current
    return sent, factors


def drifting_models(rounds: int, d: int, seed: int, toward: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Global models θ_0, θ_1, ... with random steps; with `toward`, every other window of 4 rounds
    drifts along it, the others against it (so progress checks both pass and fail)."""
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(d, generator=g)
    out = [theta.clone()]
    for t in range(rounds - 1):
        step = 0.05 * torch.randn(d, generator=g)
        if toward is not None:
            step += 0.2 * toward * (1.0 if (t // 4) % 2 else -1.0)
        theta = theta + step
        out.append(theta.clone())
    return out


def test_crafted_updates_follow_the_official_code_round_by_round():
    d, rounds = 300, 14
    attack = PoisonedFL(PoisonedFLParams(check_every=4))
    honest = torch.zeros(3, d)
    attack.craft(honest, 2, round_context(global_weights=torch.zeros(d), rnd=1, seed=5))  # draws s
    s = attack.s.clone()
    attack = PoisonedFL(PoisonedFLParams(check_every=4))
    thetas = drifting_models(rounds, d, seed=1, toward=s)
    mine, factors = [], []
    for t, theta in enumerate(thetas):
        crafted = attack.craft(honest, 2, round_context(global_weights=theta, rnd=t + 1, seed=5))
        assert torch.equal(crafted.rows[0], crafted.rows[1])  # every fake client sends the same
        mine.append(crafted.rows[0].double().numpy())
        factors.append(attack.c)
    assert torch.equal(attack.s, s)  # the same s from the same first-round generator, and kept
    expected, official_factors = official_rounds([t.double().numpy() for t in thetas], s.double().numpy(), 8.0, 4,
                                                 aligned_threshold(d, 0.99))
    for got, want in zip(mine, expected):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)
    assert factors == pytest.approx(official_factors)
    assert min(factors) < 8.0 and factors[-1] < factors[4]  # the drift against s made checks fail...
    assert any(a == b for a, b in zip(factors[5:], factors[4:]))  # ...and the drift along s some pass


def test_update_is_lambda_times_magnitude_times_the_fixed_sign_by_hand():
    d = 6
    attack = PoisonedFL(PoisonedFLParams(scale=3.0))
    theta1 = torch.tensor([0.0, 1.0, -1.0, 2.0, 0.5, 0.0])
    first = attack.craft(torch.ones(2, d), 1, round_context(global_weights=theta1, rnd=1, seed=0))
    assert torch.equal(first.rows, torch.zeros(1, d)) and first.log["first"]
    s = attack.s.clone()
    assert set(s.tolist()) <= {-1.0, 1.0}
    theta2 = theta1 + torch.tensor([0.3, -0.4, 0.0, 0.1, -0.2, 0.2])
    out = attack.craft(torch.ones(2, d), 1, round_context(global_weights=theta2, rnd=2, seed=99)).rows[0].double()
    g = (theta2 - theta1).double()  # the last malicious update was 0: k = |g|
    v = g.abs() / (g.abs().norm() + 1e-9)
    np.testing.assert_allclose(out.numpy(), (3.0 * g.norm() * v * s.double()).numpy(), rtol=1e-6)
    assert torch.equal(torch.sign(out)[out != 0], s.double()[out != 0])  # the sign is s wherever it is not 0
    assert math.isclose(float(out.norm()), 3.0 * float(g.norm()), rel_tol=1e-6)  # ‖g_i‖ = c·‖g^{t-1}‖

    theta3 = theta2 + torch.tensor([0.1, 0.1, -0.3, 0.0, 0.2, -0.1])  # now the last malicious update is subtracted
    out3 = attack.craft(torch.ones(2, d), 1, round_context(global_weights=theta3, rnd=3, seed=7)).rows[0].double()
    g3 = (theta3 - theta2).double()
    k = (g3 - out * g3.norm() / (out.norm() + 1e-9)).abs()
    np.testing.assert_allclose(out3.numpy(), (3.0 * g3.norm() * k / (k.norm() + 1e-9) * s.double()).numpy(), rtol=1e-5)
    assert torch.equal(attack.s, s)  # fixed across rounds, whatever the round's generator


def test_nothing_of_the_honest_updates_is_read():
    d = 40
    thetas = drifting_models(5, d, seed=3)
    runs = []
    for honest_seed in (0, 1):
        attack = PoisonedFL(PoisonedFLParams(check_every=2))
        g = torch.Generator().manual_seed(honest_seed)
        runs.append([attack.craft(100 * torch.randn(4, d, generator=g), 3, round_context(global_weights=t, rnd=r + 1, seed=r)).rows
                     for r, t in enumerate(thetas)])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@pytest.mark.parametrize("d,k95,k99", [(1204682, 603244, 603618), (139960, 70288, 70415),
                                       (717924, 359659, 359948), (145212, 72919, 73049)])
def test_binomial_thresholds_are_the_official_constants(d, k95, k99):
    assert aligned_threshold(d, 0.99) == k99 and aligned_threshold(d, 0.95) == k95


def scripted(s: torch.Tensor, along: bool, check_every: int, rounds: int, **params) -> PoisonedFL:
    """An attack whose global models drift along s (or against it) every round."""
    attack = PoisonedFL(PoisonedFLParams(check_every=check_every, **params))
    attack.s = s.clone()
    theta = torch.zeros_like(s)
    for r in range(1, rounds + 1):
        attack.craft(torch.zeros(1, s.numel()), 1, round_context(global_weights=theta, rnd=r))
        theta = theta + (0.1 if along else -0.1) * s
    return attack


def test_scale_decays_by_beta_only_when_the_model_does_not_follow_s_and_not_below_the_floor():
    s = torch.sign(torch.randn(500, generator=torch.Generator().manual_seed(4)))
    assert scripted(s, True, 3, 10).c == 8.0  # checks at rounds 4, 7, 10 pass: c stays
    assert scripted(s, False, 3, 4).c == pytest.approx(8.0 * 0.7)  # the first check fails
    assert scripted(s, False, 3, 10).c == pytest.approx(8.0 * 0.7 ** 3)  # three failed checks
    assert scripted(s, False, 3, 3).c == 8.0  # no check before T rounds
    # the floor: c is decayed only while 0.7·c >= min_scale (official: sf*0.7 >= 0.5)
    assert scripted(s, False, 1, 30, scale=1.0).c == pytest.approx(0.7 ** 1)
    assert scripted(s, False, 1, 30, scale=1.0, min_scale=0.3).c == pytest.approx(0.7 ** 3)


def test_sparse_rounds_use_the_mean_change_per_round():
    d = 20
    thetas = drifting_models(2, d, seed=8)
    attack = PoisonedFL(PoisonedFLParams(scale=2.0))
    attack.craft(torch.zeros(1, d), 1, round_context(global_weights=thetas[0], rnd=3))
    out = attack.craft(torch.zeros(1, d), 1, round_context(global_weights=thetas[1], rnd=7))  # 4 rounds later
    g = (thetas[1] - thetas[0]).double() / 4
    assert out.log["span"] == 4
    assert math.isclose(float(out.rows[0].double().norm()), 2.0 * float(g.norm()), rel_tol=1e-6)


def test_bad_parameters_name_their_field():
    for field, value in [("decay", 1.0), ("scale", 0), ("confidence", 0.5), ("check_every", 0)]:
        with pytest.raises(ScenarioError, match=f"attack.poisonedfl.{field}"):
            load_scenario("scenarios/quickstart.yaml", [f"attack={{name: poisonedfl, {field}: {value}}}"])


def test_state_survives_a_pipeline_checkpoint(tmp_path):
    """Rounds 1-3, save, load into a fresh pipeline, rounds 4-8: the same aggregates as uninterrupted."""
    scenario = load_scenario("scenarios/quickstart.yaml", ["attack=null", "aggregator=median", "defenses=[]"])
    spec = ATTACKS.get("poisonedfl").spec_model()(name="poisonedfl", check_every=2, num_attackers=2)
    d = 30
    g = torch.Generator().manual_seed(2)
    honest = [torch.randn(4, d, generator=g) for _ in range(8)]

    def run(pipe, rounds, theta):
        out = []
        for t in rounds:
            batch = UpdateBatch(torch.cat([honest[t], torch.zeros(2, d)]), torch.ones(6), tuple(range(6)))
            agg = pipe.run(batch, {4, 5}, round_context(global_weights=theta, rnd=t + 1, seed=t)).aggregate
            theta = theta + agg
            out.append(agg)
        return out, theta

    full = RoundPipeline(scenario, ATTACKS.get("poisonedfl").obj(spec))
    expected, _ = run(full, range(8), torch.zeros(d))
    first = RoundPipeline(scenario, ATTACKS.get("poisonedfl").obj(spec))
    got, theta = run(first, range(3), torch.zeros(d))
    torch.save(first.history(), tmp_path / "history.pt")
    resumed = RoundPipeline(scenario, ATTACKS.get("poisonedfl").obj(spec))
    resumed.load_history(torch.load(tmp_path / "history.pt", weights_only=True))
    rest, _ = run(resumed, range(3, 8), theta)
    assert all(torch.equal(a, b) for a, b in zip(got + rest, expected))
    cold = RoundPipeline(scenario, ATTACKS.get("poisonedfl").obj(spec))
    assert not all(torch.equal(a, b) for a, b in zip(run(cold, range(3, 8), theta)[0], expected[3:]))


def test_whole_rounds_on_digits(tmp_path):
    scenario = quick_scenario("federation.rounds=3", "federation.clients_per_round=6", "aggregator=median",
                              attack={"name": "poisonedfl", "num_attackers": 2, "schedule": {"name": "fixed_pool"},
                                      "check_every": 1})
    rounds, summary, _ = run_local(scenario, tmp_path)
    assert [r["round"] for r in rounds] == [1, 2, 3] and summary["rounds_completed"] == 3
    first = rounds[0]
    assert first["attack"]["lambda"] == 0.0 and all(first["attacker_update_norms"][str(a)] == 0.0 for a in first["attackers"])
    for r in rounds[1:]:
        assert len(r["attackers"]) == 2 and math.isfinite(r["main_accuracy"])
        lam = r["attack"]["lambda"]
        assert lam > 0 and "aligned" in r["attack"]  # a check every round (check_every: 1)
        assert all(math.isclose(r["attacker_update_norms"][str(a)], lam, rel_tol=1e-4) for a in r["attackers"])  # ‖λ·v⊙s‖ = λ
