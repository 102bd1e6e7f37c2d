"""Attaching a simulation to an existing Ray cluster (federation.ray_address or RAY_ADDRESS).

The end-to-end test starts its own single-node cluster with `ray start --head` in a fresh temp
dir, runs the quickstart for 2 rounds attached to it, and stops exactly that cluster: `ray stop`
would stop every Ray instance on the machine, so the test ends the processes it started by their
ids (those whose command line names its temp dir, and their children). Ray writes the cluster's
address file into that temp dir, so no other process on the machine attaches to it by accident.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from fedsim.runs.results import read_rounds
from fedsim.scenario import load_scenario
from fedsim.engine.simulate import backend_config, ray_address, simulate
from test_deployment import free_port

REPO = Path(__file__).resolve().parents[1]
RAY = Path(sys.executable).with_name("ray")


def test_local_cluster_by_default(monkeypatch):
    """Without an address the simulation starts its own Ray with this machine's CPUs and a bounded store."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    scenario = load_scenario(REPO / "scenarios/quickstart.yaml")
    args = backend_config(scenario, verbose=False)["init_args"]
    assert "address" not in args
    assert args["num_cpus"] == (os.cpu_count() or 1) and args["object_store_memory"] > 0


def test_address_from_the_scenario_or_the_environment(monkeypatch):
    """Attaching passes the address and no num_cpus/object_store_memory (Ray refuses those for an
    existing cluster); the scenario's address wins over RAY_ADDRESS."""
    monkeypatch.setenv("RAY_ADDRESS", "10.1.2.3:6379")
    scenario = load_scenario(REPO / "scenarios/quickstart.yaml")
    args = backend_config(scenario, verbose=False)["init_args"]
    assert args["address"] == "10.1.2.3:6379"
    assert "num_cpus" not in args and "object_store_memory" not in args
    pinned = load_scenario(REPO / "scenarios/quickstart.yaml", ["federation.ray_address=head.example:6380"])
    assert ray_address(pinned) == "head.example:6380"
    assert backend_config(pinned, verbose=False)["init_args"]["address"] == "head.example:6380"


def _processes_naming(text: str) -> set[int]:
    """Ids of processes whose command line contains `text`, and all their descendants."""
    found, children = set(), {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, set()).add(int(entry.name))
        if text in cmdline:
            found.add(int(entry.name))
    todo = list(found)
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    found.discard(os.getpid())
    return found


def _stop_cluster(temp_dir: str, grace: float = 10.0) -> None:
    """SIGTERM the cluster's processes, then SIGKILL whatever is left after `grace` seconds."""
    pids = _processes_naming(temp_dir)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() for p in pids):
            time.sleep(0.2)
        pids = {p for p in pids if Path(f"/proc/{p}").exists()}
        if not pids:
            return


@pytest.mark.simulation
@pytest.mark.slow
def test_simulation_attached_to_a_ray_cluster_started_with_ray_start(tmp_path):
    """`ray start --head` on this machine, then 2 rounds of the quickstart attached to it: the run
    completes with the usual results, and the cluster (not a private Ray instance) ran it."""
    if not RAY.exists():
        pytest.skip("the ray command is not installed next to this Python")
    port = free_port()
    temp_dir = tempfile.mkdtemp(prefix="fsray", dir="/tmp")  # short: Ray's socket paths must fit in 107 bytes
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    try:
        subprocess.run(
            [str(RAY), "start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1", "--num-cpus=2",
             f"--temp-dir={temp_dir}", "--include-dashboard=false", "--disable-usage-stats",
             f"--object-store-memory={200 * 1024**2}"],
            check=True, env=env, capture_output=True, timeout=120,
        )
        scenario = load_scenario(REPO / "scenarios/quickstart.yaml", [
            "federation.rounds=2", f"federation.ray_address=127.0.0.1:{port}", "attack.schedule.first=2",
        ])
        run_dir = simulate(scenario, run_dir=tmp_path / "run")
        rounds = read_rounds(run_dir)
        assert [r["round"] for r in rounds] == [1, 2]
        assert all(len(r["aggregated"]) == scenario.federation.clients_per_round and not r["rejected"] for r in rounds)
        assert rounds[-1]["main_accuracy"] > 0.5 and rounds[-1]["attackers"]
        assert json.loads((run_dir / "summary.json").read_text())["rounds_completed"] == 2
        # this process ran as a driver of that cluster: Ray logged it in the cluster's session
        drivers = list(Path(temp_dir).glob(f"session_*/logs/python-core-driver-*_{os.getpid()}.log"))
        assert drivers, "the simulation did not attach to the cluster started by the test"
    finally:
        _stop_cluster(temp_dir)
        leftover = _processes_naming(temp_dir)
        subprocess.run(["rm", "-rf", temp_dir], check=False)
    assert not leftover, f"cluster processes still running: {sorted(leftover)}"
