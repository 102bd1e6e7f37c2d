"""The server's privacy probe (fedsim/server/leakage.py) inside real in-process runs: what it
attacks, what it writes, that it changes nothing clients compute, and what validation refuses."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import quick_scenario, run_local
from fedsim.runs.report import runs_table
from fedsim.server.record import without_times
from fedsim.scenario import ScenarioError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SMALL = {"num_clients": 60, "clients_per_round": 4, "rounds": 2, "local_epochs": 1, "batch_size": 32, "local_steps": 1,
         "lr": 0.1}
IMPRINT = {"name": "imprint", "body": {"name": "mlp", "hidden": [16]}, "bins": 128, "mean": 0.3052, "std": 0.03325,
           "scale": 10000.0}
DATA = {"dataset": "digits", "partition": "iid"}
PRIVACY_FIELDS = ("privacy_attack", "privacy_attack_seconds")


def without_privacy(lines):
    return [{k: v for k, v in line.items() if k not in PRIVACY_FIELDS} for line in without_times(lines)]


def test_imprint_reads_inputs_back_from_a_secaggplus_sum(tmp_path):
    """Robbing the Fed through the real SecAgg+ protocol: the server holds only the sum of 4 clients'
    one-step updates, yet inputs that fell alone in a bin come back (quantisation leaves ~1e-4 of
    error, PSNR far above 60 dB), the grid is drawn, and the summary and report carry the numbers."""
    sc = quick_scenario(model=IMPRINT, federation=SMALL, data=DATA,
                        secure_aggregation={"name": "secaggplus"},
                        privacy_attacks=[{"name": "imprint", "rounds": [1], "grid": 8}])
    run = run_local(sc, tmp_path)
    entries = run.rounds[0]["privacy_attack"]
    assert [e["attack"] for e in entries] == ["imprint"] and entries[0]["target"] == "aggregate"
    entry = entries[0]
    assert sorted(entry["clients"]) == run.rounds[0]["secure_aggregation"]["summed"]
    assert entry["psnr_max"] > 60 and entry["ssim_mean"] > 0.5
    assert (run.path / entry["grid"]).stat().st_size > 1000
    assert "privacy_attack" not in run.rounds[1]  # round 2 is not attacked
    assert run.summary["leakage"]["imprint/aggregate"]["best_psnr"] == pytest.approx(entry["psnr_mean"])
    table = runs_table([run.path])
    assert "best PSNR dB" in table.headers and f"{entry['psnr_mean']:.1f}" in table.rows[0]


def test_privacy_attacks_change_nothing_the_federation_computes(tmp_path):
    """The same scenario with and without privacy attacks: every round line (less the probe's own
    fields and timings) and the final global model are identical."""
    attacks = [{"name": "loss_threshold", "rounds": [1, 2], "shadow_epochs": 1}]
    runs = {}
    for name, probes in (("with", attacks), ("without", [])):
        sc = quick_scenario(federation=SMALL, data=DATA, privacy_attacks=probes)
        runs[name] = run_local(sc, tmp_path / name, checkpoints=True)
    assert without_privacy(runs["with"].rounds) == without_privacy(runs["without"].rounds)
    games = [e for line in runs["with"].rounds for e in line["privacy_attack"]]
    assert [g["round"] for g in games] == [1, 2] and all(0 <= g["auc"] <= 1 for g in games)
    assert games[0]["members"] == games[0]["non_members"] > 0
    from fedsim.runs.checkpoint import load_server

    assert torch.equal(load_server(runs["with"].path, 2)["global"], load_server(runs["without"].path, 2)["global"])


def test_same_seed_same_leakage_numbers(tmp_path):
    sc = quick_scenario(federation=SMALL, data=DATA, privacy_attacks=[{"name": "loss_threshold", "rounds": [2], "shadow_epochs": 1}])
    a, b = run_local(sc, tmp_path / "a"), run_local(sc, tmp_path / "b")
    strip = lambda run: json.dumps([line.get("privacy_attack") for line in run.rounds], sort_keys=True)  # noqa: E731
    assert strip(a) == strip(b)


@pytest.mark.parametrize("sections, field, words", [
    ({"secure_aggregation": {"name": "secaggplus"}, "privacy_attacks": [{"name": "imprint", "observe": "upload"}],
      "model": IMPRINT}, "privacy_attacks.0.observe", "observe the aggregate"),
    ({"privacy_attacks": [{"name": "imprint"}]}, "privacy_attacks.0", "model.name=imprint"),
    ({"privacy_attacks": [{"name": "loss_threshold", "rounds": [3]}]}, "privacy_attacks.0.rounds", "never run"),
    ({"privacy_attacks": [{"name": "imprint", "observe": "upload", "clients": [99]}], "model": IMPRINT},
     "privacy_attacks.0.clients", "no such clients"),
    ({"privacy_attacks": [{"name": "loss_threshold"}], "systems": {"round": {"name": "fedbuff", "buffer_size": 2}}},
     "privacy_attacks.0", "older global models"),
])
def test_validation_names_what_a_privacy_attack_cannot_read(sections, field, words):
    with pytest.raises(ScenarioError) as err:
        quick_scenario(**sections)
    text = str(err.value)
    assert field in text and words in text, text


def test_unknown_privacy_attack_lists_the_allowed_ones():
    with pytest.raises(ScenarioError) as err:
        quick_scenario(privacy_attacks=[{"name": "dlg2"}])
    assert "imprint" in str(err.value) and "loss_threshold" in str(err.value)


def test_summary_and_report_columns_by_hand():
    """leakage_summary and the report's columns on constructed round lines."""
    from fedsim.runs.report import leakage_columns
    from fedsim.runs.results import leakage_summary

    up = lambda c, p: {"attack": "inverting_gradients", "round": 1, "target": "upload", "clients": [c],  # noqa: E731
                       "psnr_mean": p, "ssim_mean": p / 100, "label_accuracy": 1.0}
    rounds = [
        {"round": 1, "privacy_attack": [up(3, 20.0), up(5, 30.0),
                                        {"attack": "inverting_gradients", "round": 1, "target": "aggregate",
                                         "clients": [3, 5], "psnr_mean": 12.0, "ssim_mean": 0.1, "label_accuracy": 0.5}],
         "privacy_attack_seconds": {"inverting_gradients/upload/3": 1.0, "inverting_gradients/upload/5": 2.0,
                                    "inverting_gradients/aggregate/sum": 0.5},
         "local_privacy": {"epsilon": 4.0, "delta": 1e-3}},
        {"round": 2, "privacy_attack": [{"attack": "loss_threshold", "round": 2, "target": "model", "auc": 0.61,
                                         "tpr_at_1pct_fpr": 0.02}],
         "privacy_attack_seconds": {"loss_threshold": 0.25}, "local_privacy": {"epsilon": 5.0, "delta": 1e-3}},
    ]
    summary = leakage_summary(rounds)
    assert summary["inverting_gradients/upload"] == {
        "attacked": 2, "mean_psnr": 25.0, "best_psnr": 30.0, "best_ssim": 0.3, "best_label_accuracy": 1.0,
        "best_round": 1, "best_clients": [5], "seconds": 3.0}
    assert summary["inverting_gradients/aggregate"]["best_psnr"] == 12.0
    assert summary["inverting_gradients/aggregate"]["seconds"] == 0.5
    assert summary["loss_threshold/model"]["final_auc"] == 0.61 and summary["loss_threshold/model"]["seconds"] == 0.25
    cols = leakage_columns(rounds)
    assert cols["leak_upload_psnr"] == 25.0 and cols["leak_aggregate_psnr"] == 12.0 and cols["leak_psnr"] == 30.0
    assert cols["mia_auc"] == 0.61 and cols["epsilon"] == (5.0, "local")
    assert leakage_summary([{"round": 1}]) is None and leakage_columns([{"round": 1}])["leakage"] is False


def test_a_deployment_refuses_privacy_attacks():
    """On real devices the server has no clients' data to score a reconstruction against."""
    from fedsim.deploy.run_config import deployable

    with pytest.raises(ScenarioError) as err:
        deployable(quick_scenario(privacy_attacks=[{"name": "loss_threshold"}]), "x.yaml")
    assert "privacy_attacks" in str(err.value) and "only a simulation" in str(err.value)
    assert deployable(quick_scenario(), "x.yaml") is not None
