"""Central evaluation overlapped with the next round's training (evaluation.overlap).

Round t's evaluation and line move to a background thread while round t+1 trains. What must not
change: the metrics (identical with and without the overlap), the order of the lines, every line
having its checkpoint, an interrupted run keeping the lines it computed, the last round's line
being written before the run returns, and errors in the evaluation surfacing in the run.
Runs on the in-process grid (no Ray), with a slowed-down evaluator where timing matters.
"""

from __future__ import annotations

import gc
import threading
import time

import pytest

from fedsim.server.record import without_times
from fedsim.client.app import make_client_app
from fedsim.server.evaluation import CentralEvaluator
from fedsim.runs.folder import RunFolder
from fedsim.runs.results import read_rounds
from fedsim.scenario import load_scenario
from fedsim.server.app import run_server
from fedsim.server.strategy import ScenarioStrategy
from fedsim.flower.local_grid import LocalGrid

QUICK = ["federation.rounds=4", "federation.num_clients=8", "federation.clients_per_round=4",
         "attack.schedule.every=2", "attack.schedule.first=1"]


def run(tmp_path, progress=None, checkpoints=False, overrides=(), overlap=True):
    scenario = load_scenario("scenarios/quickstart.yaml", QUICK + list(overrides) + [f"evaluation.overlap={str(overlap).lower()}"])
    run_dir = RunFolder.create(scenario, tmp_path).path
    grid = LocalGrid(make_client_app(scenario), scenario.federation.num_clients)
    summary = run_server(grid, scenario, run_dir, progress, checkpoints=checkpoints)
    return read_rounds(run_dir), summary, run_dir


def metrics(rounds):
    return without_times(rounds)


@pytest.mark.parametrize("extra", [[], ["evaluation.every=3", "evaluation.initial=true"]])
def test_overlap_gives_the_same_lines_as_evaluating_in_line(tmp_path, monkeypatch, extra):
    overlapped, _, _ = run(tmp_path / "a", overrides=extra)
    in_line, _, _ = run(tmp_path / "b", overrides=extra, overlap=False)
    assert metrics(overlapped) == metrics(in_line)
    assert [r["round"] for r in overlapped] == ([0] if extra else []) + [1, 2, 3, 4]


def test_evaluation_really_overlaps_and_lines_stay_ordered_with_checkpoints(tmp_path, monkeypatch):
    """With a slow evaluation, round t's line is written after round t+1 has started (the overlap
    is real), still in round order, each with its checkpoint on disk, and the last one before the
    run returns; wall_seconds add up to the time between the first round's start and the last line."""
    events = []
    slow = CentralEvaluator.__call__

    def slow_evaluation(self, model, rnd=None, deployed=None):
        time.sleep(0.3)
        return slow(self, model, rnd, deployed)

    started = ScenarioStrategy.configure_train

    def configure_train(self, server_round, *args):
        events.append(("start", server_round + self.driver.offset, time.perf_counter()))
        return started(self, server_round, *args)

    monkeypatch.setattr(CentralEvaluator, "__call__", slow_evaluation)
    monkeypatch.setattr(ScenarioStrategy, "configure_train", configure_train)
    checkpoints_seen = {}
    holder = {}

    def progress(record):
        events.append(("line", record["round"], time.perf_counter()))
        checkpoints_seen[record["round"]] = (holder["dir"] / "checkpoint" / f"round-{record['round']}.pt").exists()

    scenario = load_scenario("scenarios/quickstart.yaml", QUICK + ["evaluation.overlap=true"])
    holder["dir"] = run_dir = RunFolder.create(scenario, tmp_path).path
    run_server(LocalGrid(make_client_app(scenario), 8), scenario, run_dir, progress, checkpoints=True)
    t_returned = time.perf_counter()
    lines = [(r, t) for kind, r, t in events if kind == "line"]
    starts = {r: t for kind, r, t in events if kind == "start"}
    assert [r for r, _ in lines] == [1, 2, 3, 4]
    assert all(t_line > starts[r + 1] for r, t_line in lines[:-1])  # round t's line after round t+1 began
    assert all(checkpoints_seen.values())
    assert lines[-1][1] <= t_returned
    rounds = read_rounds(run_dir)
    total = sum(r["wall_seconds"] for r in rounds)
    assert total == pytest.approx(lines[-1][1] - starts[1], abs=0.05)


def test_an_interrupted_run_keeps_the_line_being_evaluated(tmp_path, monkeypatch):
    """Round 3's aggregation fails while round 2 is still being evaluated in the background:
    the run stops with that error, and round 2's line is written all the same."""
    slow = CentralEvaluator.__call__

    def slow_evaluation(self, model, rnd=None, deployed=None):
        time.sleep(0.5)
        return slow(self, model, rnd, deployed)

    aggregate = ScenarioStrategy.aggregate_train

    def failing_aggregate(self, server_round, replies):
        if server_round == 3:
            raise RuntimeError("server crashed in round 3")
        return aggregate(self, server_round, replies)

    monkeypatch.setattr(CentralEvaluator, "__call__", slow_evaluation)
    monkeypatch.setattr(ScenarioStrategy, "aggregate_train", failing_aggregate)
    scenario = load_scenario("scenarios/quickstart.yaml", QUICK + ["evaluation.overlap=true"])
    run_dir = RunFolder.create(scenario, tmp_path).path
    with pytest.raises(RuntimeError, match="server crashed in round 3"):
        run_server(LocalGrid(make_client_app(scenario), 8), scenario, run_dir)
    deadline = time.monotonic() + 10  # the evaluation thread finishes round 2 on its own
    while len(read_rounds(run_dir)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [r["round"] for r in read_rounds(run_dir)] == [1, 2]
    assert read_rounds(run_dir)[1]["main_accuracy"] is not None


def test_an_error_in_the_background_evaluation_stops_the_run(tmp_path, monkeypatch):
    ok = CentralEvaluator.__call__
    calls = {"n": 0}

    def failing_evaluation(self, model, rnd=None, deployed=None):
        calls["n"] += 1
        if calls["n"] == 2:
            raise ValueError("evaluation blew up in round 2")
        return ok(self, model, rnd, deployed)

    monkeypatch.setattr(CentralEvaluator, "__call__", failing_evaluation)
    scenario = load_scenario("scenarios/quickstart.yaml", QUICK + ["evaluation.overlap=true"])
    run_dir = RunFolder.create(scenario, tmp_path).path
    with pytest.raises(ValueError, match="round 2"):
        run_server(LocalGrid(make_client_app(scenario), 8), scenario, run_dir)
    assert [r["round"] for r in read_rounds(run_dir)] == [1]
    gc.collect()
    deadline = time.monotonic() + 5  # the evaluation thread is stopped, not left waiting for work
    while any(t.name.startswith("fedsim-evaluation") for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [t for t in threading.enumerate() if t.name.startswith("fedsim-evaluation")]


@pytest.mark.parametrize("overrides, expected", [
    ([], {1: 1, 2: 1, 3: 1, 4: "server"}),  # overlapped: one thread beside the clients; the last round in line
    (["evaluation.threads=3"], {1: 3, 2: 3, 3: 3, 4: 3}),
    (["evaluation.overlap=false"], {r: "server" for r in (1, 2, 3, 4)}),
    (["evaluation.overlap=false", "evaluation.threads=1"], {r: 1 for r in (1, 2, 3, 4)}),
])
def test_evaluation_threads(tmp_path, monkeypatch, overrides, expected):
    """The evaluation runs on `evaluation.threads` torch threads (default: 1 when overlapped, the
    server's own count in line), and the server thread's own count is left as it was."""
    import torch

    seen = {}
    ok = CentralEvaluator.__call__
    server_threads = torch.get_num_threads()

    def recording(self, model, rnd=None, deployed=None):
        seen[len(seen) + 1] = torch.get_num_threads()
        return ok(self, model, rnd, deployed)

    monkeypatch.setattr(CentralEvaluator, "__call__", recording)
    overlap = "evaluation.overlap=false" not in overrides
    run(tmp_path, overrides=[o for o in overrides if "overlap" not in o], overlap=overlap)
    assert seen == {r: server_threads if v == "server" else v for r, v in expected.items()}
    assert torch.get_num_threads() == server_threads


def test_deferred_last_evaluation_completes_after_return(tmp_path, monkeypatch):
    """fedsim's simulation lets the ServerApp return while the last round is evaluated (the engine
    shuts down meanwhile): `drive_server` returns before the last line, and its completion call
    writes it and the summary, the same as `run_server`'s. Without the overlap nothing is deferred."""
    from fedsim.server.app import drive_server

    import torch

    slow = CentralEvaluator.__call__
    threads = []

    def slow_evaluation(self, model, rnd=None, deployed=None):
        time.sleep(0.4)
        threads.append(torch.get_num_threads())
        return slow(self, model, rnd, deployed)

    monkeypatch.setattr(CentralEvaluator, "__call__", slow_evaluation)
    scenario = load_scenario("scenarios/quickstart.yaml", QUICK)
    run_dir = RunFolder.create(scenario, tmp_path / "deferred").path
    # the process's count when the run starts: 3, a count nothing else in the run sets (the
    # in-process grid's clients train in the server thread on one thread, evaluations beside
    # training run on one)
    server_threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        complete = drive_server(LocalGrid(make_client_app(scenario), 8), scenario, run_dir, defer_last_evaluation=True)
        assert [r["round"] for r in read_rounds(run_dir)] == [1, 2, 3]
        assert not (run_dir / "summary.json").exists()
        summary = complete()
    finally:
        torch.set_num_threads(server_threads)
    assert [r["round"] for r in read_rounds(run_dir)] == [1, 2, 3, 4] and (run_dir / "summary.json").exists()
    assert threads == [1, 1, 1, 3]  # beside training: one; the deferred last one: as many as in line
    reference, summary_in_line, _ = run(tmp_path / "in_line")
    assert metrics(read_rounds(run_dir)) == metrics(reference)

    def same(d):  # the summary without its wall-clock values
        out = {k: v for k, v in d.items() if k not in ("run_dir", "wall_seconds")}
        out["backdoor_lifecycle"] = {k: v for k, v in out["backdoor_lifecycle"].items() if k != "attacker_train_seconds"}
        return out

    assert same(summary) == same(summary_in_line)

    scenario = load_scenario("scenarios/quickstart.yaml", QUICK + ["evaluation.overlap=false"])
    run_dir = RunFolder.create(scenario, tmp_path / "no_overlap").path
    complete = drive_server(LocalGrid(make_client_app(scenario), 8), scenario, run_dir, defer_last_evaluation=True)
    assert [r["round"] for r in read_rounds(run_dir)] == [1, 2, 3, 4]
    complete()
