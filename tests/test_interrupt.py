"""Ctrl-C and SIGTERM stop a run within seconds, keep every completed round, and the run resumes
to exactly the metrics of an uninterrupted run (fedsim.engine.interrupt). The end-to-end tests start a
real `fedsim run` / `fedsim sweep` process through Ray, signal it mid-run, and check its exit code,
how long it took to exit, that no process of its session is left, and the resumed metrics."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from flwr.app import Message

from fedsim.server.record import without_times
from fedsim.engine.interrupt import RunInterrupted, on_signals
from fedsim.flower.stoppable_grid import RunStopped, StoppableGrid
from fedsim.runs.results import read_rounds

REPO = Path(__file__).resolve().parents[1]
FEDSIM = [sys.executable, "-m", "fedsim.cli"]
SMALL = ["--set", "federation.rounds=6", "--set", "federation.num_clients=8", "--set", "federation.clients_per_round=4",
         "--set", "attack.schedule.every=2"]


def metrics(rounds: list[dict]) -> list[dict]:
    return without_times(rounds)


# --- the parts, in-process ---------------------------------------------------------------------
class SilentGrid:
    """A grid whose nodes never answer (as after Ray has gone), recording what was pulled."""

    def __init__(self) -> None:
        self.pulls = 0

    def push_messages(self, messages):
        return [f"m{i}" for i, _ in enumerate(messages)]

    def pull_messages(self, ids):
        self.pulls += 1
        return []


def test_stoppable_grid_stops_waiting_when_the_event_is_set():
    stop = threading.Event()
    grid = StoppableGrid(SilentGrid(), stop, pull_interval=0.01)
    threading.Timer(0.3, stop.set).start()
    t0 = time.monotonic()
    with pytest.raises(RunStopped, match="2 replies outstanding"):
        grid.send_and_receive([object(), object()], timeout=600)
    assert time.monotonic() - t0 < 1.0
    with pytest.raises(RunStopped):  # once stopped, nothing more is sent
        grid.send_and_receive([object()], timeout=600)


def test_stoppable_grid_returns_the_replies_so_far_at_the_timeout():
    class HalfGrid(SilentGrid):
        def pull_messages(self, ids):
            self.pulls += 1
            reply = Message.__new__(Message)  # only metadata.reply_to_message_id is read
            reply.__dict__["_metadata"] = type("M", (), {"reply_to_message_id": "m0"})()
            return [reply] if "m0" in ids else []

    inner = HalfGrid()
    grid = StoppableGrid(inner, threading.Event(), pull_interval=0.01)
    t0 = time.monotonic()
    replies = grid.send_and_receive([object(), object()], timeout=0.2)
    assert len(replies) == 1 and 0.2 <= time.monotonic() - t0 < 1.0
    assert inner.pulls >= 5  # it kept polling until the timeout


@pytest.mark.parametrize("signum,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_first_signal_sets_the_event_and_raises_in_the_main_thread(signum, code):
    before = signal.getsignal(signum)
    stop = threading.Event()
    with pytest.raises(RunInterrupted) as caught:
        with on_signals(stop):
            os.kill(os.getpid(), signum)
            time.sleep(5)  # interrupted long before
    assert stop.is_set() and caught.value.exit_code == code
    assert signal.getsignal(signum) is before  # handlers restored


def test_handlers_put_back_after_a_library_replaced_them():
    stop = threading.Event()
    with pytest.raises(RunInterrupted):
        with on_signals(stop) as handle:
            signal.signal(signal.SIGTERM, lambda *a: sys.exit(1))  # what ray.init does
            handle.reinstall()
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)


# --- a real `fedsim run` / `fedsim sweep` through Ray -------------------------------------------
def start(args: list[str], cwd: Path) -> subprocess.Popen:
    """The command in its own session, as a terminal would run it (Ctrl-C reaches its process group)."""
    env = dict(os.environ, COLUMNS="200")
    return subprocess.Popen(FEDSIM + args, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True, env=env)


def wait_for_lines(folder: Path, n: int, proc: subprocess.Popen, timeout: float = 180) -> Path:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for path in folder.glob("**/rounds.jsonl"):
            if len(read_rounds(path.parent)) >= n:
                return path.parent
        assert proc.poll() is None, proc.communicate()[0]
        time.sleep(0.05)
    raise AssertionError(f"no run reached {n} rounds within {timeout}s")


def session_processes(sid: int) -> list[str]:
    out = subprocess.run(["ps", "-eo", "sid=,pid=,comm="], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if line.split() and line.split()[0] == str(sid)]


def stop_and_check(proc: subprocess.Popen, signum: int, code: int, whole_group: bool = True, within: float = 15.0) -> str:
    """Signal `proc` (its process group, like Ctrl-C, or itself, like `kill`), then check it exits
    with `code` within `within` seconds and leaves no process of its session behind."""
    t0 = time.monotonic()
    (os.killpg if whole_group else os.kill)(proc.pid, signum)
    try:
        out, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"still running 60 s after {signal.Signals(signum).name}: {proc.communicate()[0][-3000:]}")
    took = time.monotonic() - t0
    assert proc.returncode == code, out[-3000:]
    assert took < within, f"took {took:.1f}s to exit"
    assert "Traceback" not in out, out[-3000:]
    deadline = time.monotonic() + 10  # Ray's processes are stopped by the driver; allow them to go
    while session_processes(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not session_processes(proc.pid), session_processes(proc.pid)
    return out


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> list[dict]:
    """The small scenario's metrics from an uninterrupted run (in-process grid: the same metrics
    as through Ray, as tests/test_simulation.py and the golden tests check)."""
    from fedsim.client.app import make_client_app
    from fedsim.runs.folder import RunFolder
    from fedsim.scenario import load_scenario
    from fedsim.server.app import run_server
    from fedsim.flower.local_grid import LocalGrid

    overrides = [a for a in SMALL if a != "--set"]
    scenario = load_scenario(REPO / "scenarios/quickstart.yaml", overrides)
    run_dir = RunFolder.create(scenario, tmp_path_factory.mktemp("full")).path
    run_server(LocalGrid(make_client_app(scenario), scenario.federation.num_clients), scenario, run_dir, checkpoints=True)
    return metrics(read_rounds(run_dir))


@pytest.mark.simulation
@pytest.mark.parametrize("signum,code,whole_group", [(signal.SIGINT, 130, True), (signal.SIGTERM, 143, False)])
def test_run_stops_on_a_signal_and_resumes_to_the_same_metrics(tmp_path, uninterrupted, signum, code, whole_group):
    proc = start(["run", str(REPO / "scenarios/quickstart.yaml"), *SMALL, "--output", str(tmp_path)], tmp_path)
    run_dir = wait_for_lines(tmp_path, 2, proc)
    out = stop_and_check(proc, signum, code, whole_group)
    assert f"fedsim run --resume {run_dir}" in " ".join(out.split())
    kept = read_rounds(run_dir)
    assert 2 <= len(kept) < 6 and metrics(kept) == uninterrupted[: len(kept)]
    resumed = subprocess.run(FEDSIM + ["run", "--resume", str(run_dir)], cwd=tmp_path, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert metrics(read_rounds(run_dir)) == uninterrupted


@pytest.mark.simulation
def test_second_ctrl_c_exits_at_once(tmp_path):
    proc = start(["run", str(REPO / "scenarios/quickstart.yaml"), *SMALL, "--output", str(tmp_path)], tmp_path)
    wait_for_lines(tmp_path, 1, proc)
    os.killpg(proc.pid, signal.SIGINT)
    time.sleep(0.2)
    t0 = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 130 and time.monotonic() - t0 < 2.0
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-3000:]
    os.killpg(proc.pid, signal.SIGKILL) if session_processes(proc.pid) else None  # exiting at once may leave Ray's


SWEEP = """
name: tiny
base: {base}
federation: {{rounds: 4, num_clients: 8, clients_per_round: 4}}
attack: {{schedule: {{every: 2}}}}
sweep:
  seed: [0, 1]
"""


@pytest.mark.simulation
@pytest.mark.parametrize("jobs,signum,code,whole_group", [(1, signal.SIGINT, 130, True), (2, signal.SIGTERM, 143, False)])
def test_sweep_stops_on_a_signal_and_a_rerun_finishes_it(tmp_path, jobs, signum, code, whole_group):
    sweep = tmp_path / "tiny.yaml"
    sweep.write_text(SWEEP.format(base=REPO / "scenarios/quickstart.yaml"))
    proc = start(["sweep", str(sweep), "--jobs", str(jobs), "--output", str(tmp_path / "out")], tmp_path)
    wait_for_lines(tmp_path / "out", 1, proc)
    out = stop_and_check(proc, signum, code, whole_group, within=20.0)
    assert f"fedsim sweep {sweep}" in " ".join(out.split()), out[-2000:]
    again = subprocess.run(FEDSIM + ["sweep", str(sweep), "--jobs", str(jobs), "--output", str(tmp_path / "out")],
                           cwd=tmp_path, capture_output=True, text=True)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    runs = sorted(p.parent for p in (tmp_path / "out").glob("**/summary.json"))
    assert len(runs) == 2 and all(len(read_rounds(r)) == 4 for r in runs)
