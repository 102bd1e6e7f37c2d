"""A run whose every round was skipped is reported as a failure, not as results."""

from __future__ import annotations

from fedsim.cli import skipped_exit_code
from fedsim.client.app import make_client_app
from fedsim.runs.folder import RunFolder
from fedsim.runs.results import every_round_skipped, read_rounds
from fedsim.scenario import load_scenario
from fedsim.server.app import run_server
from fedsim.flower.local_grid import LocalGrid


def test_every_round_skipped_only_when_no_round_was_aggregated():
    skipped = {"round": 1, "skipped": "1 valid updates, fewer than federation.min_replies=2"}
    assert every_round_skipped([]) is None
    assert every_round_skipped([{"round": 0, "skipped": None}]) is None  # only the initial evaluation
    assert "min_replies=2" in every_round_skipped([{"round": 0}, skipped, {**skipped, "round": 2}])
    assert every_round_skipped([skipped, {"round": 2, "skipped": None}]) is None
    assert skipped_exit_code([skipped]) == 1 and skipped_exit_code([skipped, {"round": 2}]) == 0


def test_a_run_of_crashing_clients_is_every_round_skipped(tmp_path):
    scenario = load_scenario("scenarios/quickstart.yaml", ["federation.rounds=2", "federation.num_clients=4",
                                                           "federation.clients_per_round=4", "attack=null"])
    run_dir = RunFolder.create(scenario, tmp_path).path
    grid = LocalGrid(make_client_app(scenario), 4, fail=range(4))
    run_server(grid, scenario, run_dir)
    reason = every_round_skipped(read_rounds(run_dir))
    assert reason is not None and "2 of 2" in reason
