"""Backdoor lifecycle numbers (fedsim/runs/lifecycle.py) on hand-made success curves."""

from __future__ import annotations

import pytest

from fedsim.runs.lifecycle import backdoor_lifecycle


def lines(success, attack_rounds, bytes_each=100):
    out = [{"round": 0, "backdoor_success": 0.9, "attackers": []}]  # a pre-trained model's value never counts
    for t, s in enumerate(success, start=1):
        attackers = [7] if t in attack_rounds else []
        out.append({"round": t, "backdoor_success": s, "attackers": attackers,
                    "bytes_up_per_client": {"7": bytes_each, "3": 5} if attackers else {"3": 5}})
    return out


def test_implant_lifespan_half_life_and_area_by_hand():
    #        round:  1    2    3    4    5    6    7    8
    success = [0.1, 0.4, 0.7, 0.8, 0.6, 0.45, 0.3, 0.2]
    got = backdoor_lifecycle(lines(success, {2, 3, 4}), threshold=0.5)
    assert got["first_attack_round"] == 2 and got["last_attack_round"] == 4
    assert got["rounds_to_implant"] == 2  # 0.7 in round 3, the attack's 2nd round
    assert got["lifespan"] == 1  # round 5 still 0.6, round 6 below 0.5
    assert got["half_life"] == 3  # 0.8 at the last attack round; 0.3 <= 0.4 in round 7
    assert got["auc"] == pytest.approx(sum(success) / 8)
    assert got["auc_after_attack"] == pytest.approx((0.6 + 0.45 + 0.3 + 0.2) / 4)
    assert got["attacker_rounds"] == 3 and got["attacker_bytes_up"] == 300 and got["rounds_after"] == 4


def test_a_backdoor_that_outlives_the_run_and_one_never_implanted():
    alive = backdoor_lifecycle(lines([0.6, 0.9, 0.9, 0.8], {1, 2}), threshold=0.5)
    assert alive["rounds_to_implant"] == 1 and alive["lifespan"] is None and alive["half_life"] is None
    never = backdoor_lifecycle(lines([0.1, 0.2, 0.1], {1}), threshold=0.5)
    assert never["rounds_to_implant"] is None and never["lifespan"] is None and never["half_life"] is None  # 0.1 never halves


def test_without_attack_or_backdoor_metric():
    quiet = backdoor_lifecycle(lines([0.1, 0.1], set()), threshold=0.5)
    assert quiet["first_attack_round"] is None and quiet["auc"] == pytest.approx(0.1)
    assert backdoor_lifecycle([{"round": 1, "backdoor_success": None}], 0.5) is None


def test_attack_cost_adds_the_attackers_reported_training_seconds():
    got = lines([0.1, 0.6, 0.7], {1, 3})
    got[1]["attacker_train_seconds"] = {"7": 1.5}
    got[3]["attacker_train_seconds"] = {"7": 2.0, "9": 0.25}
    assert backdoor_lifecycle(got, threshold=0.5)["attacker_train_seconds"] == pytest.approx(3.75)
