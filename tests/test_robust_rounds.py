"""Robust aggregation, defenses and Byzantine attacks through whole rounds (in-process grid)."""

from __future__ import annotations

import pytest

from conftest import QUICKSTART, quick_scenario, run_local

BASE = ["federation.rounds=3", "federation.num_clients=10", "federation.clients_per_round=7"]


def run(tmp_path, overrides, fail=()):
    result = run_local(quick_scenario(*BASE, *overrides, base=QUICKSTART), tmp_path, fail=fail)
    return result.rounds, result.summary


def test_defenses_compose_and_log_what_they_did(tmp_path):
    rounds, summary = run(tmp_path, [
        "attack.schedule.every=1", "attack.schedule.first=1",
        "defenses=[{name: norm_clipping, delta: 0.5}, {name: weak_dp, delta: 0.5, sigma: 0.001}]",
        "aggregator=median",
    ])
    assert summary["rounds_completed"] == 3
    for r in rounds:
        assert set(r["defenses"]) == {"norm_clipping", "weak_dp"}
        clipped = r["defenses"]["norm_clipping"]["clipped"]
        # every update of a fresh MLP is far above 0.5 in norm: all are clipped, with factor delta/norm < 1
        assert len(clipped) == 7 and all(0 < f < 1 for f in clipped.values())
        assert r["defenses"]["weak_dp"]["noise_std"] == pytest.approx(0.001)


def test_krum_skips_rounds_it_cannot_run_and_the_run_goes_on(tmp_path):
    # Krum with f = 2 needs n >= 2f + 3 = 7 updates: all 7 clients are sampled (so the scenario
    # validates), but client 3 crashes every round, so only 6 arrive
    rounds, summary = run(tmp_path, ["aggregator={name: krum, num_malicious: 2}", "federation.num_clients=7",
                                     "attack=null"], fail=[3])
    assert summary["rounds_completed"] == 3
    assert all("krum" in r["skipped"] and "n=6" in r["skipped"] for r in rounds)
    assert len({r["main_accuracy"] for r in rounds}) == 1  # the model never moved


@pytest.mark.parametrize("attack", ["alie", "ipm", "sign_flip", "gaussian", "min_max", "min_sum"])
def test_server_side_attacks_replace_the_malicious_rows(tmp_path, attack):
    rounds, summary = run(tmp_path, [
        f"attack={{name: {attack}, num_attackers: 2, schedule: {{name: every_round, attackers_per_round: 2}}}}",
        "aggregator={name: multikrum, num_malicious: 2}",
    ])
    assert summary["rounds_completed"] == 3
    for r in rounds:
        assert len(r["attackers"]) == 2 and r["skipped"] is None
        assert r["backdoor_success"] is None  # untargeted: no backdoor metric


def test_detox_redundant_groups_vote_out_minority_attackers(tmp_path):
    rounds, summary = run(tmp_path, [
        "federation.num_clients=20", "federation.clients_per_round=15",
        "aggregator={name: detox, group_size: 3, inner: {name: median}}",
        "attack={name: alie, num_attackers: 4, schedule: {name: fixed_pool}}",
    ])
    assert summary["rounds_completed"] == 3
    for r in rounds:
        attackers = set(r["attackers"])
        vote = r["aggregator"]
        assert len(r["groups"]) == 5 and sorted(sum(r["groups"], [])) == r["sampled"]
        for group, voters in zip(r["groups"], vote["voters"]):
            bad = attackers & set(group)
            if len(bad) <= 1:  # honest majority: the honest members agree bit for bit and win
                assert set(voters) == set(group) - bad
            else:  # two attackers of three send the same ALIE vector and win the group
                assert set(voters) == bad
        assert set(vote["outvoted"]) <= set(r["sampled"])


def test_detox_without_redundancy_is_group_mean_then_robust_rule(tmp_path):
    rounds, summary = run(tmp_path, ["aggregator={name: detox, group_size: 3, redundancy: false, inner: median}"])
    assert summary["rounds_completed"] == 3
    assert all(r["aggregator"]["outvoted"] == [] and r["aggregator"]["surviving_groups"] == 2 for r in rounds)


def test_krum_selection_is_logged_by_client_id(tmp_path):
    rounds, _ = run(tmp_path, ["aggregator={name: krum, num_malicious: 1}", "attack.schedule.every=1", "attack.schedule.first=1"])
    for r in rounds:
        (chosen,) = r["aggregator"]["selected"]
        assert chosen in r["sampled"]
