"""The detection audit (fedsim/runs/detection.py): hand-counted confusion matrices for each kind of
defense (filter, choosing rule, redundancy vote, down-weighting, clipping), run totals, and the
audit in real rounds.jsonl lines and summary.json."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedsim.flower.local_grid import LocalGrid
from fedsim.client.app import make_client_app
from fedsim.runs.folder import RunFolder
from fedsim.runs.results import read_rounds
from fedsim.scenario import load_scenario
from fedsim.server.app import run_server
from fedsim.runs.detection import flagged_clients, rates, round_detection, run_detection

ROOT = Path(__file__).resolve().parents[1]


def test_rates_by_hand():
    assert rates(tp=2, fp=1, fn=1, tn=6) == {"tpr": 2 / 3, "fpr": 1 / 7, "precision": 2 / 3, "f1": 4 / 6}
    assert rates(tp=0, fp=0, fn=0, tn=5) == {"tpr": None, "fpr": 0.0, "precision": None, "f1": None}
    assert rates(tp=0, fp=2, fn=1, tn=0)["f1"] == 0.0


def test_a_filter_that_removes_one_attacker_and_one_honest_client():
    # accepted 0..5, attackers {4, 5}; FLAME-like removal of 1 and 5
    det = round_detection([0, 1, 2, 3, 4, 5], {4, 5}, [0, 2, 3, 4], None, {"flame": {"removed": [1, 5]}},
                          {0: 1.0, 2: 1.0, 3: 1.0, 4: 1.0})
    assert det["flagged"] == [1, 5] and (det["tp"], det["fp"], det["fn"], det["tn"]) == (1, 1, 1, 3)
    assert det["tpr"] == 0.5 and det["fpr"] == 0.25 and det["precision"] == 0.5
    assert det["attacker_weight_share"] == 0.25  # attacker 4 kept, one of four equal weights


def test_krum_flags_everyone_it_did_not_select():
    assert flagged_clients([3, 7, 9], [3, 7, 9], {"selected": [7]}) == {3, 9}


def test_detox_flags_outvoted_clients_and_members_of_dropped_groups():
    info = {"outvoted": [2], "dropped": [{"group": 1, "members": [4, 5, 6], "reason": "no majority"}], "voters": []}
    assert flagged_clients(range(9), range(9), info) == {2, 4, 5, 6}


def test_down_weighting_and_clipping_are_reported_without_flagging():
    det = round_detection([0, 1, 2], {2}, [0, 1, 2], None,
                          {"foolsgold": {"weights": {}}, "norm_clipping": {"clipped": {2: 0.1, 0: 0.9}}},
                          {0: 1.0, 1: 1.0, 2: 0.0})
    assert det["flagged"] == [] and det["tpr"] == 0.0 and det["attacker_weight_share"] == 0.0
    assert det["clipped"] == {"attackers": 1, "honest": 1}


def test_run_totals_add_counts_before_dividing():
    def line(tp, fp, fn, tn, share=None):
        d = {"tp": tp, "fp": fp, "fn": fn, "tn": tn, "clipped": {"attackers": 0, "honest": 0}}
        if share is not None:
            d["attacker_weight_share"] = share
        return {"round": 1, "detection": d}

    total = run_detection([line(1, 0, 0, 4, 0.1), line(0, 1, 1, 3, 0.3), line(0, 1, 0, 4)])
    assert (total["tp"], total["fp"], total["fn"], total["tn"]) == (1, 2, 1, 11)
    assert total["tpr"] == 0.5 and total["fpr"] == 2 / 13
    assert total["false_alarm_rate_without_attackers"] == 1 / 5  # the third round had no attacker
    assert total["mean_attacker_weight_share"] == pytest.approx(0.2)
    assert total["rounds_with_attackers"] == 2
    assert run_detection([{"round": 0}]) is None


def test_multikrum_audit_in_real_rounds(tmp_path):
    """In real rounds with an attacker in each, Multi-Krum (m = n - f) leaves out exactly one client;
    the lines count it against the round's attackers and the summary adds the lines up."""
    scenario = load_scenario(str(ROOT / "scenarios/quickstart.yaml"), [
        "federation.rounds=3", "federation.num_clients=8", "federation.clients_per_round=7",
        "attack.schedule.every=1", "attack.schedule.first=1",
        "aggregator={name: multikrum, num_malicious: 1}",
    ])
    run = RunFolder.create(scenario, tmp_path)
    summary = run_server(LocalGrid(make_client_app(scenario), 8), scenario, run)
    lines = [r for r in read_rounds(run) if r["round"] > 0]
    for line in lines:
        det = line["detection"]
        assert det["tp"] + det["fn"] == len(set(line["attackers"]) - set(line["rejected"]))
        assert det["tp"] + det["fp"] == len(det["flagged"]) == 1  # m = n - f leaves out exactly one
        assert set(det["flagged"]) == set(line["sampled"]) - set(line["aggregator"]["selected"])
    assert summary["detection"]["rounds"] == len(lines)
    assert summary["detection"]["tp"] == sum(r["detection"]["tp"] for r in lines)
    assert summary["backdoor_lifecycle"]["attacker_rounds"] == 3  # an attacker in every round (its own tests: test_lifecycle.py)
    from fedsim.runs.report import markdown_table

    header, _, row = markdown_table([run.path]).splitlines()[:3]
    cells = dict(zip([c.strip() for c in header.split("|")], [c.strip() for c in row.split("|")]))
    want = summary["detection"]["tpr"]
    assert cells["TPR %"] == ("-" if want is None else f"{100 * want:.1f}")
    assert cells["FPR %"] == f"{100 * summary['detection']['fpr']:.1f}"
