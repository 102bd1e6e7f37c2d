"""End to end through Flower's simulation engine on Ray: the quickstart, and two identical runs."""

from __future__ import annotations

import json

import pytest

from fedsim.server.record import without_times
from fedsim.runs.results import read_rounds
from fedsim.scenario import load_scenario
from fedsim.engine.simulate import simulate

pytestmark = pytest.mark.simulation


def test_quickstart_end_to_end(tmp_path):
    scenario = load_scenario("scenarios/quickstart.yaml")
    run_dir = simulate(scenario, run_dir=tmp_path / "run")
    rounds = read_rounds(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert len(rounds) == scenario.federation.rounds
    assert summary["final_main_accuracy"] > 0.85
    assert all(r["backdoor_success"] is not None for r in rounds)
    # the attacker strikes in rounds 3, 6, ...: the backdoor is measurably inserted
    assert summary["peak_backdoor_success"] > 0.3
    assert all(r["bytes_up"] > 0 and r["bytes_down"] > 0 for r in rounds)
    assert [r["round"] for r in rounds if r["attackers"]] == [3, 6, 9, 12, 15]


def test_two_runs_same_seed_identical_metrics(tmp_path):
    overrides = ["federation.rounds=4", "attack.schedule.first=2"]
    runs = []
    for name in ("a", "b"):
        run_dir = simulate(load_scenario("scenarios/quickstart.yaml", overrides), run_dir=tmp_path / name)
        runs.append(without_times(read_rounds(run_dir)))
    assert runs[0] == runs[1]


def test_a_client_raising_inside_ray_is_reported_and_the_round_goes_on(tmp_path):
    """Failure injection through the real Ray backend: partition 2's ClientApp raises every time."""
    from failing_app import client_app_with_failures

    scenario = load_scenario("scenarios/quickstart.yaml", ["federation.rounds=2", "federation.num_clients=6",
                                                           "federation.clients_per_round=6", "attack=null"])

    def fail(pid, _rnd):
        if pid == 2:
            raise RuntimeError("injected failure")

    app = client_app_with_failures(scenario, fail)
    run_dir = simulate(scenario, run_dir=tmp_path / "run", client_app=app)
    rounds = read_rounds(run_dir)
    assert len(rounds) == 2
    for r in rounds:
        assert "injected failure" in r["rejected"]["2"] and 2 not in r["aggregated"] and len(r["aggregated"]) == 5


def test_fedbuff_on_ray_gives_the_same_lines_with_other_actors_and_order(tmp_path):
    """Asynchronous steps follow the simulated clock, never the order Ray's actors finish in: on
    Ray, largest client first or not, the lines are those of the in-process grid."""
    from conftest import run_local
    from fedsim.flower.options import EngineOptions

    overrides = ["federation.rounds=4", "federation.num_clients=10", "federation.clients_per_round=4",
                 "attack.schedule={name: every_round}", "systems={round: {name: fedbuff, buffer_size: 3}, jitter: 0.5}"]
    runs = []
    scenario = load_scenario("scenarios/quickstart.yaml", overrides)
    for name, options in (("first", EngineOptions()), ("unordered", EngineOptions(largest_first=False))):
        runs.append(without_times(read_rounds(simulate(scenario, run_dir=tmp_path / name, options=options))))
    local = without_times(run_local(scenario, tmp_path / "local").rounds)
    assert runs[0] == runs[1] == local
    assert all(len(r["sampled"]) == 3 for r in runs[0])
