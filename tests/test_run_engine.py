"""`fedsim run` starts Ray while it validates the scenario (the shared engine of a sweep,
fedsim/engine/shared.py), runs on the client actors it warmed meanwhile, computes what the run
computes on an in-process grid, and shuts Ray down only once its outcome is printed."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from fedsim.client.app import make_client_app
from fedsim.flower.local_grid import LocalGrid
from fedsim.runs.folder import RunFolder
from fedsim.runs.results import read_rounds
from fedsim.server.app import run_server
from fedsim.server.record import without_times

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "scenarios/quickstart.yaml"
SMALL = ["federation.rounds=2", "federation.num_clients=8", "federation.clients_per_round=4",
         "attack.schedule.first=2", "attack.num_edge=20", "attack.num_clean=20"]


def ray_thread_alive() -> bool:
    return any(t.name == "fedsim-ray" for t in threading.enumerate())


def record_engine(monkeypatch, events: list) -> dict:
    """Wrap SharedEngine's start and close: the actors it prestarted, and those alive at its close."""
    from fedsim.engine.shared import SharedEngine

    seen: dict = {}
    start, close = SharedEngine.start, SharedEngine.close

    def recording_start(self, scenario=None):
        out = start(self, scenario)
        if scenario is not None:
            seen["prestarted"] = [a for s in self.shapes.values() for a in s.actors]
        return out

    def recording_close(self):
        if "at_close" not in seen:
            seen["at_close"] = [a for s in self.shapes.values() for a in s.actors]
        events.append("closed")
        close(self)

    monkeypatch.setattr(SharedEngine, "start", recording_start)
    monkeypatch.setattr(SharedEngine, "close", recording_close)
    return seen


@pytest.mark.simulation
def test_run_validates_while_ray_starts_and_borrows_the_warmed_actors(tmp_path, monkeypatch):
    import ray

    import fedsim.scenario as scenarios
    from fedsim.cli import main
    from fedsim.scenario import load_scenario

    events: list = []
    validate = scenarios.validate_scenario

    def validating(*args, **kwargs):
        events.append(("validate", ray_thread_alive()))
        return validate(*args, **kwargs)

    monkeypatch.setattr(scenarios, "validate_scenario", validating)
    seen = record_engine(monkeypatch, events)
    code = main(["run", str(QUICKSTART), *sum((["--set", s] for s in SMALL), []), "--output", str(tmp_path / "run")])
    assert code == 0
    assert ("validate", True) in events  # Ray was starting while the scenario was validated
    assert seen["prestarted"] and seen["at_close"] == seen["prestarted"]  # the run made no actor of its own
    assert not ray.is_initialized() and not ray_thread_alive()

    monkeypatch.setattr(scenarios, "validate_scenario", validate)
    scenario = load_scenario(QUICKSTART, SMALL)
    alone = RunFolder.create(scenario, tmp_path / "local").path
    run_server(LocalGrid(make_client_app(scenario), scenario.federation.num_clients), scenario, alone)
    (run_dir,) = (tmp_path / "run").iterdir()
    assert without_times(read_rounds(run_dir)) == without_times(read_rounds(alone))


@pytest.mark.simulation
def test_a_wrong_scenario_is_reported_before_ray_is_shut_down(tmp_path, monkeypatch):
    import ray

    import fedsim.cli as cli

    events: list = []
    record_engine(monkeypatch, events)
    printed = cli.err_console.print
    monkeypatch.setattr(cli.err_console, "print", lambda *a, **k: (events.append("error printed"), printed(*a, **k)))
    code = cli.main(["run", str(QUICKSTART), "--set", "federation.rounds=0", "--output", str(tmp_path)])
    assert code == 2
    assert events[:2] == ["error printed", "closed"]
    assert not ray.is_initialized() and not ray_thread_alive() and not any(tmp_path.iterdir())
