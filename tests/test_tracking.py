"""Tracking sinks (issue #22): a small in-process run copied into TensorBoard, MLflow and W&B, read
back through each library's own reader and compared with rounds.jsonl and summary.json; the
scenario schema's refusals; a missing library refused before any round; a sink that raises warned
about once while the run goes on; a resumed run continuing its tracking runs; a real `mlflow server`.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import quick_scenario, run_local
from fedsim.runs.folder import RunFolder
from fedsim.runs.results import read_rounds
from fedsim.scenario import ScenarioError, load_scenario
from fedsim.tracking.base import TrackingUnavailable
from fedsim.tracking.trackers import Trackers
from fedsim.tracking.base import flat_metrics, flat_params
from fedsim.tracking.tensorboard_sink import TensorBoardSink

QUICKSTART = "scenarios/quickstart.yaml"
# 2 rounds of 3 of 6 clients, the initial model evaluated (a round-0 line), an attacker in every
# round (so the lines carry detection/... numbers)
SMALL = ["federation.rounds=2", "federation.num_clients=6", "federation.clients_per_round=3", "federation.local_epochs=1",
         "evaluation.initial=true", "attack.schedule.first=1", "attack.schedule.every=1"]
LIBRARIES = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}


def installed(sink: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(LIBRARIES[sink]) is not None


def needs(sink: str) -> None:
    if not installed(sink):
        pytest.skip(f"{LIBRARIES[sink]} is not installed (pip install 'fedsim[tracking]')")


class Killed(Exception):
    """As if the process died right after a round's line was written."""


def run(parent: Path, tracking: str, extra=(), run_dir: Path | None = None, kill_after: int | None = None,
        checkpoints: bool = False) -> tuple[Path, dict | None]:
    """One small run on the in-process grid with `tracking` (YAML) as the scenario's tracking list."""
    scenario = quick_scenario(*SMALL, f"tracking={tracking}", *extra, base=QUICKSTART)

    def progress(record):
        if kill_after is not None and record["round"] == kill_after:
            raise Killed

    result = run_local(scenario, parent if run_dir is None else RunFolder(run_dir), progress=progress,
                       checkpoints=checkpoints, client_states=True)
    return result.path, result.summary


def series(run_dir: Path, key: str) -> list[tuple[int, float]]:
    return [(r["round"], r[key]) for r in read_rounds(run_dir) if r.get(key) is not None]


@pytest.fixture(scope="module")
def tracked(tmp_path_factory):
    """One run with every installed sink at its defaults (all inside the run folder)."""
    sinks = [name for name in LIBRARIES if installed(name)]
    if not sinks:
        pytest.skip("no tracking library installed (pip install 'fedsim[tracking]')")
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)  # the default store: the run folder's
        run_dir, summary = run(tmp_path_factory.mktemp("tracked"), "[" + ", ".join(sinks) + "]")
    return run_dir, summary


# --- the schema ---------------------------------------------------------------------------------
def test_an_unknown_sink_is_refused_naming_the_allowed_ones():
    with pytest.raises(ScenarioError) as err:
        load_scenario(QUICKSTART, ["tracking=[{name: comet}]"])
    assert "tracking.0" in str(err.value)
    assert all(name in str(err.value) for name in ("'mlflow'", "'tensorboard'", "'wandb'"))


def test_a_sink_listed_twice_or_with_an_unknown_key_is_refused():
    with pytest.raises(ScenarioError, match="tensorboard listed more than once"):
        load_scenario(QUICKSTART, ["tracking=[tensorboard, {name: tensorboard, dir: x}]"])
    with pytest.raises(ScenarioError, match=r"tracking.0.wandb.mode"):
        load_scenario(QUICKSTART, ["tracking=[{name: wandb, mode: cloud}]"])
    assert load_scenario(QUICKSTART).tracking == []


def test_the_schema_and_the_client_app_import_no_tracking_library():
    """Clients validate the scenario too: naming a sink must not need (or load) its library there."""
    code = ("import sys; from fedsim.scenario import load_scenario; import fedsim.client.app; "
            "load_scenario('scenarios/quickstart.yaml', ['tracking=[tensorboard, mlflow, wandb]']); "
            "print([m for m in ('mlflow', 'wandb', 'tensorboard', 'torch.utils.tensorboard') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_a_missing_library_is_refused_before_any_round_naming_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # importlib.util.find_spec then finds nothing
    scenario = load_scenario(QUICKSTART, SMALL + ["tracking=[wandb]"])
    with pytest.raises(TrackingUnavailable, match=r"needs wandb.*pip install 'fedsim\[tracking\]'"):
        Trackers.of(scenario, tmp_path)
    folder = RunFolder.create(scenario, tmp_path)
    with pytest.raises(TrackingUnavailable):
        run(tmp_path, "[wandb]", run_dir=folder.path)
    assert read_rounds(folder) == []


def test_flattening_keeps_finite_numbers_under_slash_keys_and_params_under_dotted_ones():
    line = {"round": 3, "main_accuracy": 0.5, "skipped": None, "attackers": [1], "rejected": {"2": "timeout"},
            "detection": {"tpr": 1.0, "precision": None, "flagged": [1], "clipped": {"honest": 2}},
            "backdoor_success_beyond_clean": float("nan"), "certified": True, "bytes_up_per_client": {4: 10}}
    assert flat_metrics(line, skip=frozenset({"round"})) == {
        "main_accuracy": 0.5, "detection/tpr": 1.0, "detection/clipped/honest": 2.0, "bytes_up_per_client/4": 10.0}
    params = flat_params({"seed": 0, "federation": {"rounds": 2}, "defenses": [{"name": "krum"}], "attack": None, "x": {}})
    assert params == {"seed": 0, "federation.rounds": 2, "defenses": [{"name": "krum"}], "attack": None, "x": {}}


# --- each library, read back ------------------------------------------------------------------
def test_tensorboard_events_hold_every_round_and_the_summary(tracked):
    needs("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, summary = tracked
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    events.Reload()
    got = [(e.step, e.value) for e in events.Scalars("main_accuracy")]
    want = series(run_dir, "main_accuracy")
    assert [s for s, _ in got] == [s for s, _ in want] == [0, 1, 2]
    assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-6)  # stored as float32
    assert [e.value for e in events.Scalars("detection/fn")] == [r["detection"]["fn"] for r in read_rounds(run_dir) if "detection" in r]
    final = events.Scalars("summary/final_main_accuracy")
    assert [(e.step, pytest.approx(e.value, rel=1e-6)) for e in final] == [(2, summary["final_main_accuracy"])]
    assert "plots/curves" in events.Tags()["images"]
    assert "scenario/text_summary" in events.Tags()["tensors"]


def test_tensorboard_logs_at_simulated_milliseconds_where_asked(tmp_path):
    needs("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, _ = run(tmp_path, "[{name: tensorboard, step: sim_ms}]", extra=("systems={}",))
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    want = [int(round(1000 * r.get("sim_time", 0.0))) for r in read_rounds(run_dir)]
    assert [e.step for e in events.Scalars("main_accuracy")] == want and want[-1] > want[0]
    with pytest.raises(ScenarioError, match="tracking.0.step"):
        quick_scenario("tracking=[{name: tensorboard, step: sim_ms}]")  # no clock, no simulated time


def mlflow_run(uri: str, experiment: str, run_name: str):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    found = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    assert [r.info.run_name for r in found] == [run_name]
    return client, found[0]


def test_mlflow_store_in_the_run_folder_holds_every_round_params_and_summary(tracked):
    needs("mlflow")
    run_dir, summary = tracked
    client, found = mlflow_run(f"sqlite:///{run_dir / 'mlflow.db'}", "quickstart", run_dir.name)
    history = client.get_metric_history(found.info.run_id, "main_accuracy")
    assert [(m.step, m.value) for m in history] == series(run_dir, "main_accuracy")
    assert [(m.step, m.value) for m in client.get_metric_history(found.info.run_id, "detection/attacker_weight_share")] == \
        series_nested(run_dir, "detection", "attacker_weight_share")
    assert found.info.status == "FINISHED"
    params = found.data.params
    assert params["seed"] == "0" and params["federation.rounds"] == "2" and params["attack.name"] == "edge_case"
    assert found.data.metrics["summary/final_main_accuracy"] == summary["final_main_accuracy"]
    assert found.data.metrics["summary/detection/fn"] == summary["detection"]["fn"]
    assert [a.path for a in client.list_artifacts(found.info.run_id, "plots")] == ["plots/curves.png"]
    assert (run_dir / "mlartifacts").is_dir()  # the default store keeps its artifacts in the run folder too


def series_nested(run_dir: Path, section: str, key: str) -> list[tuple[int, float]]:
    return [(r["round"], r[section][key]) for r in read_rounds(run_dir) if r.get(section, {}).get(key) is not None]


def test_mlflow_params_longer_than_mlflow_takes_are_cut_to_its_limit(tracked, tmp_path):
    needs("mlflow")
    from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

    from fedsim.tracking.mlflow_sink import MLflowParams, MLflowSink

    run_dir, _ = tracked
    uri = f"sqlite:///{run_dir / 'mlflow.db'}"
    sink = MLflowSink(MLflowParams(uri=uri, experiment="long"), tmp_path, "long-values", {})
    sink.open({"name": "long", "data.dir": "d" * (MAX_PARAM_VAL_LENGTH + 500), "seed": 1}, 1)
    sink.close()
    _, found = mlflow_run(uri, "long", "long-values")
    value = found.data.params["data.dir"]
    assert len(value) == MAX_PARAM_VAL_LENGTH and value.endswith("...[cut]")
    assert found.data.params["seed"] == "1"


def wandb_records(run_folder: Path) -> list[dict]:
    """The records of a W&B offline run's .wandb log, through wandb's own reader (`wandb leet inspect`)."""
    wandb_cli = Path(sys.executable).parent / "wandb"
    out = subprocess.run([str(wandb_cli), "leet", "inspect", "--json", str(run_folder)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def test_wandb_offline_run_holds_every_round_config_and_summary(tracked):
    needs("wandb")
    run_dir, summary = tracked
    offline = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(offline) == 1 and list(offline[0].glob("run-*.wandb"))
    records = wandb_records(offline[0])
    history = [r["history"] for r in records if r["type"] == "history"]
    got = [(h["step"]["num"], h["item"]["main_accuracy"]) for h in history if "main_accuracy" in h["item"]]
    assert got == series(run_dir, "main_accuracy")
    run = next(r["run"] for r in records if r["type"] == "run")
    assert run["display_name"] == run_dir.name and run["project"] == "quickstart"
    assert run["config"]["update"]["seed"] == 0 and run["config"]["update"]["federation.rounds"] == 2
    updates = {k: v for r in records if r["type"] == "summary" for k, v in r["summary"]["update"].items()}
    assert updates["summary/final_main_accuracy"] == summary["final_main_accuracy"]
    assert any(k.startswith("plots/curves") for h in history for k in h["item"])
    assert json.loads((run_dir / "tracking.json").read_text())["wandb"]["id"] == run["run_id"]


# --- failures and resumes ---------------------------------------------------------------------
def test_a_sink_that_raises_is_warned_about_once_and_the_run_completes(tmp_path, monkeypatch, caplog):
    needs("tensorboard")
    others = [name for name in ("wandb",) if installed(name)]

    def broken(self, metrics, step):
        raise OSError("no space left on device")

    monkeypatch.setattr(TensorBoardSink, "log_metrics", broken)
    with caplog.at_level(logging.WARNING, logger="fedsim.tracking"):
        run_dir, summary = run(tmp_path, "[" + ", ".join(["tensorboard", *others]) + "]")
    warnings = [r for r in caplog.records if r.name == "fedsim.tracking" and r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "tensorboard" in warnings[0].getMessage() and "no space left on device" in warnings[0].getMessage()
    assert summary["rounds_completed"] == 2 and (run_dir / "summary.json").exists()
    if others:  # the other sink logged every round
        records = wandb_records(next((run_dir / "wandb").glob("offline-run-*")))
        steps = [r["history"]["step"]["num"] for r in records if r["type"] == "history" and "main_accuracy" in r["history"]["item"]]
        assert steps == [0, 1, 2]


def test_a_resumed_run_appends_to_its_tensorboard_folder_and_continues_its_mlflow_run(tmp_path, monkeypatch):
    needs("tensorboard")
    needs("mlflow")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    tracking, extra = "[tensorboard, mlflow]", ["federation.rounds=3"]
    scenario = load_scenario(QUICKSTART, SMALL + extra)
    folder = RunFolder.create(scenario, tmp_path)
    with pytest.raises(Killed):
        run(tmp_path, tracking, extra, run_dir=folder.path, kill_after=2, checkpoints=True)
    first_id = json.loads((folder.path / "tracking.json").read_text())["mlflow"]["run_id"]
    _, summary = run(tmp_path, tracking, extra, run_dir=folder.path, checkpoints=True)
    assert summary["rounds_completed"] == 3

    events = EventAccumulator(str(folder.path / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    want = series(folder.path, "main_accuracy")
    assert [s for s, _ in want] == [0, 1, 2, 3]
    got = [(e.step, e.value) for e in events.Scalars("main_accuracy")]
    assert [s for s, _ in got] == [0, 1, 2, 3]
    assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-6)

    client, found = mlflow_run(f"sqlite:///{folder.path / 'mlflow.db'}", "quickstart", folder.path.name)
    assert found.info.run_id == first_id and found.info.status == "FINISHED"
    assert [(m.step, m.value) for m in client.get_metric_history(first_id, "main_accuracy")] == want


# --- a real MLflow tracking server ------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def mlflow_server(tmp_path):
    """`mlflow server` on 127.0.0.1 (its own process group, ended when the test ends)."""
    needs("mlflow")
    port = free_port()
    cmd = [str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port),
           "--backend-store-uri", f"sqlite:///{tmp_path / 'server.db'}", "--artifacts-destination", str(tmp_path / "artifacts"),
           "--workers", "1"]
    log_file = open(tmp_path / "server.log", "w")
    server = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True, cwd=tmp_path)
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=2) as reply:
                    if reply.status == 200:
                        break
            except OSError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"mlflow server did not start:\n{(tmp_path / 'server.log').read_text()[-3000:]}")
            time.sleep(0.5)
        yield uri
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=60)
        log_file.close()


@pytest.mark.slow
def test_mlflow_sink_logs_to_a_running_mlflow_server(tmp_path, mlflow_server):
    run_dir, summary = run(tmp_path / "runs", f"[{{name: mlflow, uri: '{mlflow_server}', experiment: served}}]")
    client, found = mlflow_run(mlflow_server, "served", run_dir.name)
    assert [(m.step, m.value) for m in client.get_metric_history(found.info.run_id, "main_accuracy")] == series(run_dir, "main_accuracy")
    assert found.data.params["seed"] == "0"
    assert found.data.metrics["summary/final_main_accuracy"] == summary["final_main_accuracy"]
    assert [a.path for a in client.list_artifacts(found.info.run_id, "plots")] == ["plots/curves.png"]
    assert not (run_dir / "mlflow.db").exists()  # nothing in the run folder but the run's id
    assert json.loads((run_dir / "tracking.json").read_text())["mlflow"]["uri"] == mlflow_server
