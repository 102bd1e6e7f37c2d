"""Membership inference (leakage/membership.py, issue #36) against independent oracles: the metrics
by counting pairs and sweeping thresholds by brute force, LiRA's Gaussian tail by hand and its
whole pipeline against a numpy/scipy port of the official scoring, the null case (a model that
trained on no target: AUC ≈ 0.5), a model overfit on a few digits (AUC well above 0.5), seeded
reproducibility, and both attacks inside a real digits federation."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from conftest import quick_scenario, run_local
from pydantic import ValidationError

from fedsim.data.digits import DigitsParams, load_digits
from fedsim.leakage.base import LocalTraining, MembershipQuery
from fedsim.leakage.membership import (
    LiraOffline,
    LiraOfflineParams,
    LossThreshold,
    LossThresholdParams,
    example_losses,
    lira_offline_scores,
    logit_confidence,
    membership_metrics,
)
from fedsim.models.nets import MlpParams, mlp
from fedsim.registry import PRIVACY_ATTACKS
from fedsim.training import TrainConfig, train

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CPU = torch.device("cpu")


def digits():
    d = load_digits(None, DigitsParams())
    return (torch.from_numpy(d.x_train), torch.from_numpy(d.y_train)), (torch.from_numpy(d.x_test), torch.from_numpy(d.y_test))


def build(hidden: int = 64):
    return lambda: mlp((1, 8, 8), 10, MlpParams(hidden=[hidden]))


def query(model, x, y, population, seed: int = 5, lr: float = 0.1, epochs: int = 1, members: int = 1) -> MembershipQuery:
    training = LocalTraining(lr=lr, epochs=epochs, batch_size=10, max_steps=None, momentum=0.9, weight_decay=0.0,
                             num_examples=members)
    return MembershipQuery(round=1, model=model, x=x, y=y, population=population, build_model=build(),
                           training=training, generator=torch.Generator().manual_seed(seed), device=CPU)


# ---- the metrics ---------------------------------------------------------------------------------


def brute_auc(s: np.ndarray, m: np.ndarray) -> float:
    """P(member score > non-member score) + ½ P(tie), by counting every pair."""
    pos, neg = s[m], s[~m]
    wins = sum(float(a > b) + 0.5 * float(a == b) for a in pos for b in neg)
    return wins / (len(pos) * len(neg))


def brute_tpr_at(s: np.ndarray, m: np.ndarray, level: float) -> float:
    """The largest TPR of the decisions `score ≥ t` over every threshold t whose FPR ≤ level."""
    best = 0.0
    for t in [*np.unique(s), np.inf]:
        d = s >= t
        if d[~m].mean() <= level:
            best = max(best, d[m].mean())
    return best


def test_metrics_on_a_hand_computed_vector():
    s = torch.tensor([0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2])
    m = torch.tensor([1, 1, 0, 1, 0, 1, 0, 0], dtype=torch.bool)
    out = membership_metrics(s, m, threshold=0.55)
    # concordant pairs: 0.9 and 0.8 beat all 4 non-members, 0.6 beats 3, 0.4 beats 2 -> 13 of 16
    assert out["auc"] == pytest.approx(13 / 16)
    # no false positive allowed at 1% of 4 non-members: the members above the best non-member (0.7)
    assert out["tpr_at_1pct_fpr"] == pytest.approx(2 / 4)
    assert out["tpr_at_0.1pct_fpr"] is None  # 4 non-members cannot resolve 0.1%
    assert (out["members"], out["non_members"]) == (4, 4)
    # at 0.55: members 0.9, 0.8, 0.6 and non-member 0.7 are called members
    assert out["tpr_at_threshold"] == pytest.approx(3 / 4) and out["fpr_at_threshold"] == pytest.approx(1 / 4)
    assert out["advantage_at_threshold"] == pytest.approx(1 / 2) and out["accuracy_at_threshold"] == pytest.approx(6 / 8)


def test_metrics_match_brute_force_with_ties_and_low_fpr():
    g = np.random.default_rng(0)
    m = np.zeros(1400, dtype=bool)
    m[:400] = True
    s = np.round(g.normal(size=1400) + 0.8 * m, 1)  # rounded: many ties
    out = membership_metrics(torch.from_numpy(s), torch.from_numpy(m))
    assert out["auc"] == pytest.approx(brute_auc(s, m), abs=1e-12)
    assert out["tpr_at_1pct_fpr"] == pytest.approx(brute_tpr_at(s, m, 0.01))
    assert out["tpr_at_0.1pct_fpr"] == pytest.approx(brute_tpr_at(s, m, 0.001))
    assert out["non_members"] == 1000 and out["members"] == 400


def test_metrics_without_one_class_say_so():
    out = membership_metrics(torch.ones(3), torch.ones(3, dtype=torch.bool))
    assert out["auc"] is None and out["note"] == "one class is empty"


# ---- the statistics -------------------------------------------------------------------------------


def test_logit_confidence_is_the_official_logit_where_it_does_not_saturate_and_exact_beyond():
    g = torch.Generator().manual_seed(0)
    z = 3 * torch.randn(50, 10, generator=g)
    y = torch.randint(0, 10, (50,), generator=g)
    # score.py's computation: max-subtracted float64 softmax, log(p_y + 1e-45) - log(sum of the others + 1e-45)
    p = np.exp(z.double().numpy() - z.double().numpy().max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    py = p[np.arange(50), y.numpy()]
    official = np.log(py + 1e-45) - np.log(p.sum(1) - py + 1e-45)
    np.testing.assert_allclose(logit_confidence(z, y).numpy(), official, rtol=1e-9, atol=1e-9)
    # a confident logit: the official value saturates near -log(1e-45) = 103.6, the stable one is exact
    phi = logit_confidence(torch.tensor([[200.0, 0.0, 0.0]]), torch.tensor([0]))
    assert float(phi) == pytest.approx(200 - math.log(2), abs=1e-9)
    assert float(example_losses(torch.tensor([[0.0, 0.0]]), torch.tensor([1]))) == pytest.approx(math.log(2))


def upper_tail(z: float) -> float:
    return 0.5 * math.erfc(z / math.sqrt(2))  # Pr[N(0, 1) > z]


def test_lira_score_is_the_gaussian_upper_tail_by_hand():
    phi_out = torch.tensor([[1.0, -1.0], [2.0, 0.0], [3.0, 0.0], [4.0, 3.0]], dtype=torch.float64)  # K = 4 shadows, 2 targets
    phi = torch.tensor([4.0, -2.0], dtype=torch.float64)
    # per-example: target 0 median 2.5, sd sqrt(1.25); target 1 median 0, sd 1.5 (mean 0.5, var 9/4)
    z0, z1 = (4 - 2.5) / math.sqrt(1.25), (-2 - 0) / 1.5
    got = lira_offline_scores(phi, phi_out, fixed_variance=False)
    assert got.tolist() == pytest.approx([-math.log(upper_tail(z0)), -math.log(upper_tail(z1))], rel=1e-12)
    # fixed variance: one sd of all 8 values (np.std of the whole array, as plot.py's fix_variance)
    sd = float(np.std(phi_out.numpy()))
    got = lira_offline_scores(phi, phi_out, fixed_variance=True)
    assert got.tolist() == pytest.approx([-math.log(upper_tail(1.5 / sd)), -math.log(upper_tail(-2 / sd))], rel=1e-12)
    # far above the OUT distribution: Λ = Φ(z) rounds to 1, the score still orders the targets
    far = lira_offline_scores(torch.tensor([30.0, 40.0]), torch.tensor([[0.0, 0.0], [1.0, 1.0]]), fixed_variance=True)
    assert torch.isfinite(far).all() and far[1] > far[0] > 0


# ---- the attacks on real models -------------------------------------------------------------------


def test_both_attacks_are_at_chance_on_a_model_that_trained_on_no_target():
    """Null oracle: a randomly initialised model has seen neither half, so members and non-members
    are exchangeable and the AUC is a draw from the null, 0.5 ± sqrt((n₁+n₂+1)/(12 n₁ n₂)) = 0.5 ±
    0.017 for 600 + 600 targets; the tolerance 0.07 is over 4 standard deviations (seeds fixed)."""
    (x, y), (xt, yt) = digits()
    g = torch.Generator().manual_seed(0)
    pick = torch.randperm(len(x), generator=g)[:1200]
    is_member = torch.zeros(1200, dtype=torch.bool)
    is_member[torch.randperm(1200, generator=g)[:600]] = True
    torch.manual_seed(100)
    model = build()().eval()
    for attack in (LossThreshold(LossThresholdParams(threshold="none")),
                   LiraOffline(LiraOfflineParams(shadow_epochs=5)),
                   LiraOffline(LiraOfflineParams(shadow_epochs=5, fixed_variance=False))):
        s = attack.scores(query(model, x[pick], y[pick], (xt[:200], yt[:200])))
        assert len(torch.unique(s)) >= 1150  # no ties that would pin the AUC to 0.5 by themselves
        out = membership_metrics(s, is_member)
        assert abs(out["auc"] - 0.5) < 0.07, (type(attack).__name__, out)
        assert out["tpr_at_1pct_fpr"] < 0.05, (type(attack).__name__, out)


def overfit_game(seed: int = 0, members: int = 25, non_members: int = 1000):
    """A 64-unit MLP trained 100 epochs on `members` digits; non-members: other training-split
    digits; the attacker's population: 200 test-split digits."""
    (x, y), (xt, yt) = digits()
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    mem, non = perm[:members], perm[members : members + non_members]
    torch.manual_seed(seed + 1)
    model = build()()
    stats = train(model, x[mem].numpy(), y[mem].numpy(), TrainConfig(epochs=100, batch_size=10, lr=0.1, momentum=0.9), 3)
    is_member = torch.cat([torch.ones(members, dtype=torch.bool), torch.zeros(non_members, dtype=torch.bool)])
    q = query(model.eval(), torch.cat([x[mem], x[non]]), torch.cat([y[mem], y[non]]), (xt[:200], yt[:200]),
              epochs=100, members=members)
    return q, is_member, stats


def fresh(q: MembershipQuery, seed: int = 5) -> MembershipQuery:
    return dataclasses.replace(q, generator=torch.Generator().manual_seed(seed))


def test_both_attacks_find_the_members_of_an_overfit_model():
    """Measured (seed 0, this test): loss AUC 0.887, TPR@1%FPR 0.00; LiRA offline (8 shadows, fixed
    variance) AUC 0.881, TPR@1%FPR 0.12. Over seeds 0-5 (docs/leakage.md has the command) both AUCs
    were 0.83-0.94 and LiRA's TPR at 1% FPR was at least the loss attack's in all six (mean 0.13 vs
    0.05): its gain is at low FPR, as the paper reports; its AUC is not higher here, with 8 offline
    shadows trained centrally."""
    q, is_member, stats = overfit_game()
    assert stats["loss"] < 0.01  # the target memorised its 25 examples
    loss_attack = LossThreshold(LossThresholdParams(shadow_epochs=30))
    lira = LiraOffline(LiraOfflineParams(shadow_epochs=30))
    loss_out = membership_metrics(loss_attack.scores(q), is_member, loss_attack.info["decision_threshold"])
    lira_out = membership_metrics(lira.scores(fresh(q)), is_member)  # its own generator, as the harness gives each attack
    assert loss_out["auc"] > 0.8 and lira_out["auc"] > 0.8, (loss_out, lira_out)
    assert lira_out["tpr_at_1pct_fpr"] >= loss_out["tpr_at_1pct_fpr"] and lira_out["tpr_at_1pct_fpr"] > 0.05
    assert lira_out["tpr_at_0.1pct_fpr"] is not None  # 1000 non-members resolve 0.1%
    # Yeom's decision at the estimated expected training loss beats guessing
    assert loss_out["advantage_at_threshold"] > 0
    assert loss_attack.info["predicted_members"] == int((-loss_attack.scores(fresh(q)) <= loss_attack.info["threshold_loss"]).sum())


def test_loss_scores_are_the_negative_cross_entropy():
    q, _, _ = overfit_game(members=10, non_members=30)
    ref = -torch.nn.functional.cross_entropy(q.model(q.x), q.y, reduction="none").double()
    got = LossThreshold(LossThresholdParams(threshold="none", eval_batch_size=7)).scores(q)  # several batches
    torch.testing.assert_close(got, ref.detach(), rtol=1e-5, atol=1e-6)


def test_lira_pipeline_matches_a_numpy_port_of_the_official_scoring():
    """The attack's scores against φ recomputed from its own shadow models the official way
    (score.py's softmax) and the Gaussian tail from scipy (norm.logsf), median and np.std as plot.py."""
    from scipy.stats import norm

    q, _, _ = overfit_game(members=10, non_members=40)
    lira = LiraOffline(LiraOfflineParams(shadow_models=4, shadow_epochs=3, fixed_variance=False, eval_batch_size=16))
    got = lira.scores(q).numpy()

    def official_phi(model) -> np.ndarray:
        with torch.no_grad():
            z = model.eval()(q.x).double().numpy()
        p = np.exp(z - z.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        py = p[np.arange(len(z)), q.y.numpy()]
        return np.log(py + 1e-45) - np.log(p.sum(1) - py + 1e-45)

    shadows = lira._shadows[1]
    assert len(shadows) == 4
    out = np.stack([official_phi(m) for m in shadows])
    want = -norm.logsf(official_phi(q.model), np.median(out, 0), np.std(out, 0) + 1e-30)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-9)
    # each population example trained exactly half of the shadows (train.py's keep construction)
    assert lira.info["shadow_train_size"] == 100


def test_same_generator_seed_same_scores_and_the_shadows_are_cached():
    q, _, _ = overfit_game(members=10, non_members=40)
    params = LiraOfflineParams(shadow_models=2, shadow_epochs=2)
    a = LiraOffline(params).scores(q)
    q2 = query(q.model, q.x, q.y, q.population, seed=5)
    b = LiraOffline(params).scores(q2)
    assert torch.equal(a, b)
    other = LiraOffline(params).scores(query(q.model, q.x, q.y, q.population, seed=6))
    assert not torch.equal(a, other)
    loss_params = LossThresholdParams(shadow_epochs=2)
    t1, t2 = LossThreshold(loss_params), LossThreshold(loss_params)
    t1.scores(query(q.model, q.x, q.y, q.population, seed=5))
    t2.scores(query(q.model, q.x, q.y, q.population, seed=5))
    assert t1.info["threshold_loss"] == t2.info["threshold_loss"]
    # a second round on the same population reuses the shadows; another population trains anew
    attack = LiraOffline(params)
    first = attack.scores(q2)
    assert not attack.info["shadow_cached"]
    again = attack.scores(query(q.model, q.x, q.y, q.population, seed=9))
    assert attack.info["shadow_cached"] and torch.equal(first, again)
    px, py = q.population
    attack.scores(query(q.model, q.x, q.y, (px[:150], py[:150]), seed=9))
    assert not attack.info["shadow_cached"]


def test_bad_parameters_name_the_field():
    with pytest.raises(ValidationError, match="shadow_models"):
        LiraOfflineParams(shadow_models=1)
    with pytest.raises(ValidationError, match="threshold"):
        LossThresholdParams(threshold="average")
    with pytest.raises(ValidationError, match="shadow_epochs"):
        LossThresholdParams(shadow_epochs=0)


def test_registered_as_membership_attacks():
    for name in ("loss_threshold", "lira_offline"):
        assert PRIVACY_ATTACKS.get(name).traits.kind == "membership"


def test_both_attacks_in_a_digits_federation(tmp_path):
    """The server's harness (fedsim/server/leakage.py) runs both on the global model of a real
    2-round federation, in process, and writes their AUC/TPR to rounds.jsonl and the summary."""
    sc = quick_scenario(privacy_attacks=[
        {"name": "loss_threshold", "rounds": [1, 2], "shadow_epochs": 2},
        {"name": "lira_offline", "rounds": [2], "shadow_models": 2, "shadow_epochs": 2},
    ])
    run = run_local(sc, tmp_path)
    last = {line["attack"]: line for line in run.rounds[-1]["privacy_attack"]}
    assert set(last) == {"loss_threshold", "lira_offline"}
    for line in last.values():
        assert 0 <= line["auc"] <= 1 and line["members"] > 0 and line["non_members"] > 0
    assert [a["attack"] for a in run.rounds[0]["privacy_attack"]] == ["loss_threshold"]
