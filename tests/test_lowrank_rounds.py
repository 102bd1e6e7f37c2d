"""Low-rank models through whole rounds: the server factorizes the global model, the ranks travel
in the messages, clients build the same architecture, and uploads shrink to the factors."""

from __future__ import annotations

import pytest

from conftest import QUICKSTART, quick_scenario, run_local
from fedsim.server.record import without_times
from fedsim.runs.folder import RunFolder
from fedsim.scenario import ScenarioError, load_scenario

BASE = ["federation.rounds=5", "federation.num_clients=8", "federation.clients_per_round=4",
        "model.hidden=[64, 64]", "attack.schedule.every=2"]


def run(tmp_path, overrides, kill_after=None):
    scenario = quick_scenario(*BASE, *overrides, base=QUICKSTART)
    where = RunFolder(tmp_path) if (tmp_path / "scenario.yaml").exists() else tmp_path  # a run folder: resume it

    def progress(record):
        if kill_after is not None and record["round"] == kill_after:
            raise KeyboardInterrupt

    result = run_local(scenario, where, progress=progress, checkpoints=True, client_states=True)
    return result.rounds, result.path


def test_pufferfish_switches_after_warmup_and_uploads_shrink(tmp_path):
    rounds, _ = run(tmp_path, ["lowrank={name: pufferfish, rank_ratio: 0.25, warmup_rounds: 2}"])
    switch = [r for r in rounds if "lowrank" in r]
    assert [r["round"] for r in switch] == [2]
    ranks = switch[0]["lowrank"]["ranks"]
    assert ranks == {"3": 16}  # only the middle 64x64 layer; first and last stay full rank
    full, low = rounds[0]["model_params"], rounds[-1]["model_params"]
    assert low == full - 64 * 64 + 16 * (64 + 64)
    # what crosses the wire shrinks with the parameter count (4 clients x float32 factors)
    assert rounds[-1]["bytes_up"] == pytest.approx(rounds[0]["bytes_up"] * low / full, rel=0.02)
    assert rounds[-1]["main_accuracy"] > 0.5 and all(not r["rejected"] for r in rounds)


def test_cuttlefish_switches_when_rank_curves_flatten(tmp_path):
    rounds, _ = run(tmp_path, ["lowrank={name: cuttlefish, window: 2, tail: 2, min_rounds: 2, threshold: 100.0}"])
    switch = [r for r in rounds if "lowrank" in r]
    assert len(switch) == 1 and switch[0]["round"] >= 2
    assert 1 <= switch[0]["lowrank"]["ranks"]["3"] <= 64
    assert rounds[-1]["model_params"] < rounds[0]["model_params"]


def test_resume_across_the_switch_matches_uninterrupted(tmp_path):
    spec = ["lowrank={name: pufferfish, warmup_rounds: 2}", "compression={name: topk, fraction: 0.1}"]
    full, _ = run(tmp_path / "full", spec)
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "cut", spec, kill_after=3)
    cut_dir = next((tmp_path / "cut").iterdir())
    resumed, _ = run(cut_dir, spec)
    assert without_times(resumed) == without_times(full)


def test_lowrank_with_foolsgold_is_refused_at_validation():
    with pytest.raises(ScenarioError, match="foolsgold"):
        load_scenario("scenarios/quickstart.yaml", ["lowrank=pufferfish", "defenses=[foolsgold]"])


def test_a_defense_on_named_layers_is_refused_with_lowrank_and_one_on_all_layers_is_not():
    with pytest.raises(ScenarioError, match=r"defenses=\['freqfed'\]"):
        load_scenario("scenarios/quickstart.yaml", ["lowrank=pufferfish", "defenses=[{name: freqfed, layers: [net.0.weight]}]"])
    load_scenario("scenarios/quickstart.yaml", ["lowrank=pufferfish", "defenses=[freqfed, fldetector]"])

