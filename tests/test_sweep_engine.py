"""A sweep runs on one engine: runs in flight together compute exactly what each computes alone."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

from conftest import run_local
from fedsim.runs.folder import RunFolder
from fedsim.runs.results import read_rounds
from fedsim.runs.sweep import expand, run_sweep, sweep_dir
from fedsim.server.record import without_times

REPO = Path(__file__).resolve().parents[1]
FEDSIM = [sys.executable, "-m", "fedsim.cli"]

# codecs, a defense, attack on and off, two seeds: six runs of a few seconds each
MIXED = """
base: {base}
name: mixed
federation: {{rounds: 3, num_clients: 8, clients_per_round: 4}}
attack: {{schedule: {{name: every_round}}, num_edge: 20, num_clean: 20}}
sweep:
  case:
    - {{label: plain, compression: none, defenses: []}}
    - {{label: topk_clip, compression: {{name: topk, fraction: 0.05}}, defenses: [{{name: norm_clipping, delta: 1.0}}]}}
    - {{label: clean_powersgd, attack: null, compression: {{name: powersgd, rank: 2}}}}
  seed: [0, 1]
"""


@pytest.fixture
def mixed(tmp_path) -> Path:
    path = tmp_path / "mixed.yaml"
    path.write_text(MIXED.format(base=REPO / "scenarios/quickstart.yaml"))
    return path


def local_runner(started=None, fail=None):
    """Runs a scenario on the in-process grid; records how many runs are in flight."""
    def runner(scenario, run_dir):
        if started is not None:
            started.append(scenario.name)
        if fail is not None and scenario.name == fail:
            raise RuntimeError(f"{fail} failed")
        run_local(scenario, RunFolder(run_dir), checkpoints=True, client_states=True)
    return runner


def test_runs_in_threads_equal_runs_one_after_another(mixed, tmp_path):
    name, runs = expand(mixed)
    one = run_sweep(sweep_dir(name, runs, tmp_path / "one"), runs, local_runner())
    two = run_sweep(sweep_dir(name, runs, tmp_path / "two"), runs, local_runner(), jobs=3)
    assert [p.name for p in two] == [r.name for r in runs]
    for a, b in zip(one, two):
        x, y = without_times(read_rounds(a)), without_times(read_rounds(b))
        assert x == y, (b.name, [{k: (p.get(k), q.get(k)) for k in set(p) | set(q) if p.get(k) != q.get(k)} for p, q in zip(x, y)])


def test_a_failed_run_stops_new_runs_and_is_raised_after_the_runs_in_flight(mixed, tmp_path):
    name, runs = expand(mixed)
    folder = sweep_dir(name, runs, tmp_path / "out")
    started: list[str] = []
    with pytest.raises(RuntimeError, match="failed"):
        run_sweep(folder, runs, local_runner(started, fail=runs[1].name), jobs=2)
    assert runs[-1].name not in started  # nothing new started after the failure
    assert (folder / runs[0].name / "summary.json").exists()  # the run in flight beside it finished
    run_sweep(folder, runs, local_runner(), jobs=2)  # a rerun does the rest
    assert all((folder / r.name / "summary.json").exists() for r in runs)


INTERRUPTED_SWEEP = """
import _thread, signal, sys, threading, time
from fedsim.runs.sweep import expand, run_sweep, sweep_dir

# as the CLI's on_signals does: a process started in the background by a shell inherits SIGINT
# ignored, and then interrupt_main does nothing
signal.signal(signal.SIGINT, signal.default_int_handler)

name, runs = expand(sys.argv[1])
stop, ended = threading.Event(), []

def runner(scenario, run_dir):
    stop.wait(10)
    time.sleep(0.3)  # a run takes a moment to write its last round after the stop
    ended.append(scenario.name)

def interrupt():  # what the CLI's signal handler does: set the stop event, raise in the main thread
    stop.set()
    _thread.interrupt_main()

threading.Timer(0.5, interrupt).start()
try:
    run_sweep(sweep_dir(name, runs, sys.argv[2]), runs, runner, jobs=2)
except KeyboardInterrupt:
    print("interrupted, runs ended:", len(ended))
"""


def test_an_interrupt_waits_for_the_runs_in_flight(mixed, tmp_path):
    """In a process of its own, with Python's SIGINT handler installed."""
    done = subprocess.run([sys.executable, "-c", INTERRUPTED_SWEEP, str(mixed), str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "interrupted, runs ended: 2"  # both runs in flight ended before it was raised


def test_client_apps_and_runtimes_are_kept_per_scenario(mixed):
    """A worker process keeps a few scenarios' ClientApps and runtimes, each under its content's key."""
    from fedsim.engine import ray_actor
    from fedsim.engine.ray_actor import CompactClientApp
    from fedsim.runtime import RUNTIMES_KEPT, runtime_for

    _, runs = expand(mixed)
    apps = [CompactClientApp.of(r.scenario) for r in runs[:2]]
    built = [ray_actor._client_app(a.scenario_json, a.key, None) for a in apps]
    assert built[0] is not built[1]
    assert ray_actor._client_app(apps[0].scenario_json, apps[0].key, None) is built[0]  # kept, not rebuilt
    rts = [runtime_for(r.scenario) for r in runs[: RUNTIMES_KEPT + 1]]
    assert runtime_for(runs[RUNTIMES_KEPT].scenario) is rts[-1]
    assert runtime_for(runs[1].scenario) is rts[1]
    assert runtime_for(runs[0].scenario) is not rts[0]  # the least recently used went first


@pytest.mark.slow
@pytest.mark.simulation
def test_a_mixed_grid_on_one_engine_equals_each_run_alone(mixed, tmp_path):
    """`fedsim sweep --jobs 2` (one Ray, shared actors, two runs in flight) against each run alone
    on a Ray of its own (`simulate` without an engine): every round's metrics equal, timings aside."""
    from fedsim.engine.simulate import simulate

    sweep = subprocess.run(FEDSIM + ["sweep", str(mixed), "--jobs", "2", "--output", str(tmp_path / "sweep")],
                           cwd=tmp_path, capture_output=True, text=True)
    assert sweep.returncode == 0, sweep.stdout[-3000:] + sweep.stderr[-3000:]
    name, runs = expand(mixed)
    folder = sweep_dir(name, runs, tmp_path / "sweep")
    for run in runs:
        alone = simulate(run.scenario, run_dir=tmp_path / "alone" / run.name)
        swept, single = read_rounds(folder / run.name), read_rounds(alone)
        assert len(swept) == run.scenario.federation.rounds
        assert without_times(swept) == without_times(single), run.name


@pytest.mark.slow
@pytest.mark.simulation
def test_a_sweep_attaches_to_a_cluster_started_with_ray_start(tmp_path):
    """`ray start --head` on loopback, then `fedsim sweep` with RAY_ADDRESS: both runs finish, and
    the sweep ran as a driver of that cluster (its processes are stopped by their ids afterwards)."""
    import os
    import tempfile

    from test_deployment import free_port
    from test_ray_cluster import RAY, _processes_naming, _stop_cluster

    if not RAY.exists():
        pytest.skip("the ray command is not installed next to this Python")
    path = tmp_path / "two.yaml"
    path.write_text(MIXED.format(base=REPO / "scenarios/quickstart.yaml").replace("seed: [0, 1]", "seed: [0]")
                    .replace("    - {label: clean_powersgd, attack: null, compression: {name: powersgd, rank: 2}}\n", ""))
    port = free_port()
    temp_dir = tempfile.mkdtemp(prefix="fsray", dir="/tmp")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    try:
        subprocess.run([str(RAY), "start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1", "--num-cpus=2",
                        f"--temp-dir={temp_dir}", "--include-dashboard=false", "--disable-usage-stats",
                        f"--object-store-memory={200 * 1024**2}"], check=True, env=env, capture_output=True, timeout=120)
        done = subprocess.run(FEDSIM + ["sweep", str(path), "--output", str(tmp_path / "out")], cwd=tmp_path,
                              capture_output=True, text=True, env=dict(env, RAY_ADDRESS=f"127.0.0.1:{port}"))
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert len(list((tmp_path / "out").glob("*/*/summary.json"))) == 2
        assert list(Path(temp_dir).glob("session_*/logs/python-core-driver-*.log")), "the sweep did not attach"
    finally:
        _stop_cluster(temp_dir)
        leftover = _processes_naming(temp_dir)
        subprocess.run(["rm", "-rf", temp_dir], check=False)
    assert not leftover, f"cluster processes still running: {sorted(leftover)}"


def test_reading_a_sweep_imports_no_torch(mixed):
    """`fedsim sweep` starts Ray after reading the file and before validating the runs (which
    imports every component, torch included): reading must stay that cheap."""
    code = ("import sys; from fedsim.runs.sweep import Grid; g = Grid.read(sys.argv[1]); "
            "assert 'torch' not in sys.modules, 'torch imported'; print(sorted(g.axes), g.base['federation']['rounds'])")
    done = subprocess.run([sys.executable, "-c", code, str(mixed)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["['case',", "'seed']", "3"]


def test_a_warm_up_reads_the_data_and_reports_a_failure_instead_of_raising(mixed):
    from fedsim.engine.ray_actor import ClientAppRunner, scenario_message
    from fedsim.runtime import runtime_for

    _, runs = expand(mixed)
    text, key = scenario_message(runs[0].scenario)
    assert ClientAppRunner().warm_up(text, key) is None
    assert ("dataset", "digits", runs[0].scenario.data.dataset) in runtime_for(runs[0].scenario).cache  # kept for the run
    failed = ClientAppRunner().warm_up(text, "another scenario's key")
    assert failed.startswith("RuntimeError: the scenario sent to the client actors")


@pytest.mark.simulation
def test_the_first_runs_actors_are_started_and_warmed_before_it_asks_for_them(mixed, tmp_path):
    """`begin` starts Ray in a thread, `start(scenario)` creates the actors of the shape Flower's
    backend will ask for and warms them; the run then borrows exactly those actors (none other is
    made), and Ray's processes, which die with the thread that started them, last until `close`."""
    import ray

    from fedsim.engine.shared import SharedEngine
    from fedsim.engine.simulate import simulate

    _, runs = expand(mixed)
    engine = SharedEngine().begin()
    try:
        assert any(t.name == "fedsim-ray" for t in threading.enumerate())
        engine.start(runs[0].scenario)
        (shared,) = engine.shapes.values()
        prestarted = list(shared.actors)
        assert prestarted and ray.get(engine.warm_ups, timeout=120) == [None] * len(prestarted)
        engine.open()
        run_dir = simulate(runs[0].scenario, run_dir=tmp_path / "run", engine=engine)
        assert len(read_rounds(run_dir)) == runs[0].scenario.federation.rounds
        assert [list(s.actors) for s in engine.shapes.values()] == [prestarted]
    finally:
        engine.close()
    assert not ray.is_initialized() and not any(t.name == "fedsim-ray" for t in threading.enumerate())


@pytest.mark.simulation
def test_runs_of_one_sweep_on_different_clusters_are_refused(tmp_path, capsys):
    from fedsim.cli import main

    path = tmp_path / "two_clusters.yaml"
    path.write_text(f"base: {REPO / 'scenarios/quickstart.yaml'}\nsweep:\n"
                    "  federation.ray_address: ['127.0.0.1:1', '127.0.0.1:2']\n")
    assert main(["sweep", str(path), "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "federation.ray_address" in err and "share one Ray cluster" in err and "Traceback" not in err
    import ray

    assert not ray.is_initialized()
