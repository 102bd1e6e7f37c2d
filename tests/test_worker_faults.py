"""Faults of the processes that run the clients, injected on real processes (issue #38 item 1).

* A client actor's Ray worker SIGKILLed from outside while it trains (as the OOM killer or an
  operator would): Ray restarts the actor and retries the message once (fedsim/engine/ray_start.py
  client_resources); a client killed on every try is recorded in rounds.jsonl with the reason, the
  run completes, and the lines written before the kill are untouched.
* A Ray node lost from a multi-node cluster started with `ray start` (slow).
* `federation.client_memory_gb`: a client whose process goes over it fails that message with the
  limit and the measured peak as the reason (fedsim/client/memory_limit.py); the run goes on.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from fedsim.runs.results import read_rounds
from fedsim.scenario import load_scenario
from fedsim.engine.simulate import simulate

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.chaos


def small_scenario(*overrides: str):
    """The quickstart with 6 clients, all sampled every round, no attacker, rounds written in line."""
    return load_scenario(REPO / "scenarios/quickstart.yaml", [
        "federation.num_clients=6", "federation.clients_per_round=6", "attack=null", "evaluation.overlap=false",
        *overrides,
    ])


def wait_to_be_killed(folder: str, pid: int, rnd: int, seconds: float = 60.0) -> None:
    """Announce this process (a client actor's Ray worker) in `folder` and wait for the test to kill it."""
    with open(os.path.join(folder, f"{pid}-{rnd}-{os.getpid()}.tmp"), "w") as fh:
        fh.write(str(os.getpid()))
    os.replace(os.path.join(folder, f"{pid}-{rnd}-{os.getpid()}.tmp"), os.path.join(folder, f"{pid}-{rnd}-{os.getpid()}"))
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.02)


class Killer(threading.Thread):
    """SIGKILLs every process announced in `folder` (`wait_to_be_killed`), from this test's process,
    and remembers (partition, round, pid, the process's command line, rounds.jsonl at that moment)."""

    def __init__(self, folder: Path, rounds_file: Path, spare_after_one: set[int]) -> None:
        super().__init__(daemon=True)
        self.folder, self.rounds_file, self.spare_after_one = folder, rounds_file, spare_after_one
        self.kills: list[tuple[int, int, int, str, bytes]] = []
        self.done = threading.Event()

    def run(self) -> None:
        seen = set()
        while not self.done.is_set():
            for entry in sorted(self.folder.iterdir()):
                if entry.name in seen or entry.name.endswith(".tmp") or entry.name.startswith("spare"):
                    continue
                seen.add(entry.name)
                pid, rnd, worker = (int(x) for x in entry.name.split("-"))
                if pid in self.spare_after_one:  # its next try trains normally
                    (self.folder / f"spare{pid}").touch()
                cmdline = Path(f"/proc/{worker}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                written = self.rounds_file.read_bytes() if self.rounds_file.exists() else b""
                os.kill(worker, signal.SIGKILL)
                self.kills.append((pid, rnd, worker, cmdline, written))
            time.sleep(0.02)


@pytest.mark.simulation
def test_a_client_worker_killed_from_outside_mid_round(tmp_path):
    """Round 2 of 3: the Ray worker of partition 3 is SIGKILLed once while it trains, partition 1's
    on every try. Ray restarts the actor and retries the message once: partition 3's retry trains
    in a new process and its update is aggregated; partition 1 is killed again and recorded as failed
    with the reason; rounds 1 and 3 aggregate everyone, and round 1's line, written before the first
    kill, is still there byte for byte."""
    from failing_app import client_app_with_failures

    scenario = small_scenario("federation.rounds=3")
    victims = tmp_path / "victims"
    victims.mkdir()
    folder = str(victims)

    def before_train(pid, rnd):
        if rnd == 2 and (pid == 1 or (pid == 3 and not os.path.exists(os.path.join(folder, "spare3")))):
            wait_to_be_killed(folder, pid, rnd)
        # every training that went past the hook leaves a mark
        open(os.path.join(folder, f"spare-trained-{pid}-{rnd}-{os.getpid()}"), "w").close()

    run_dir = tmp_path / "run"
    killer = Killer(victims, run_dir / "rounds.jsonl", spare_after_one={3})
    killer.start()
    try:
        simulate(scenario, run_dir=run_dir, client_app=client_app_with_failures(scenario, before_train))
    finally:
        killer.done.set()
        killer.join()
    rounds = read_rounds(run_dir)
    assert [r["round"] for r in rounds] == [1, 2, 3]
    # what was killed: client actors' Ray workers, partition 3 once, partition 1 on every try
    assert all("ray::" in cmdline for *_, cmdline, _ in killer.kills), [k[3] for k in killer.kills]
    killed = [(pid, rnd) for pid, rnd, *_ in killer.kills]
    assert killed.count((3, 2)) == 1
    # partition 1: alone, its message is run and retried once; first maybe also in its cohort's task
    assert killed.count((1, 2)) in (2, 3) and len(killed) == killed.count((1, 2)) + 1
    assert len({worker for _, _, worker, *_ in killer.kills}) == len(killer.kills)  # a new process each time
    # partition 3's retry trained in a process other than the one killed
    trained = [name.split("-")[2:] for name in os.listdir(folder) if name.startswith("spare-trained-")]
    p3_round2 = [int(w) for p, r, w in trained if (p, r) == ("3", "2")]
    killed_p3 = next(worker for pid, _, worker, *_ in killer.kills if pid == 3)
    assert len(p3_round2) == 1 and p3_round2[0] != killed_p3
    # the rounds: partition 1 failed in round 2 with the reason, everyone else aggregated
    assert rounds[1]["rejected"].keys() == {"1"}
    reason = rounds[1]["rejected"]["1"]
    assert reason.startswith("client error: the client's actor was lost while running this message, and again on "
                             "its retry"), reason
    assert "ActorUnavailableError" in reason or "ActorDiedError" in reason, reason  # Ray's own words follow
    assert rounds[1]["aggregated"] == [0, 2, 3, 4, 5]
    assert all(not r["rejected"] and r["aggregated"] == [0, 1, 2, 3, 4, 5] for r in (rounds[0], rounds[2]))
    # round 1 was on disk before the first kill, and it is still there as it was
    first_written = killer.kills[0][4]
    assert [json.loads(line)["round"] for line in first_written.decode().splitlines()] == [1]
    assert (run_dir / "rounds.jsonl").read_bytes().startswith(first_written)


def test_the_memory_watchdog_interrupts_a_growing_process():
    """In this process: under a limit 0.5 GB above what it holds now, a loop that keeps 100 MB
    tensors (60 of them would be 6 GB) is interrupted within a few of them, with the limit and the
    peak in the error; the memory is given back; a call that stays under the limit returns its result."""
    import torch

    from fedsim.client.memory_limit import GB, MemoryLimitExceeded, resident_bytes, run_limited

    held = []

    def grow():
        for _ in range(60):
            held.append(torch.ones(25 * 1024**2))  # 100 MB, every page touched
        return "never"

    limit = round(resident_bytes() / GB + 0.5, 2)
    with pytest.raises(MemoryLimitExceeded) as failure:
        run_limited(limit, grow)
    assert 5 <= len(held) <= 12, len(held)  # stopped a sample or so after crossing the limit
    peak = float(str(failure.value).split("(peak ")[1].split(" GB")[0])
    assert str(failure.value).startswith(f"client exceeded federation.client_memory_gb={limit:g} (peak ")
    assert limit < peak < limit + 0.5
    held.clear()
    assert resident_bytes() / GB < limit - 0.3
    assert run_limited(limit, lambda: float(torch.ones(1000).sum())) == 1000.0
    assert run_limited(None, lambda: "no limit") == "no limit"


@pytest.mark.simulation
def test_a_client_over_client_memory_gb_fails_its_message_and_the_run_goes_on(tmp_path):
    """federation.client_memory_gb=1.5: in round 1, partition 2's process holds 1.6 GB more while it
    trains (a tensor its hook allocates). That message fails with the limit and the peak as the
    reason; the other clients and round 2 are untouched: every round's figures are those of a run
    without the limit in which partition 2's round-1 message fails by raising."""
    import torch

    from failing_app import client_app_with_failures

    limit = 1.5
    results = {}
    for case in ("memory", "raise"):
        scenario = small_scenario("federation.rounds=2",
                                  *([f"federation.client_memory_gb={limit}"] if case == "memory" else []))

        def before_train(pid, rnd, case=case):
            if (pid, rnd) != (2, 1):
                return None
            if case == "raise":
                raise RuntimeError("partition 2 fails round 1")
            return torch.ones(int(1.6 * 1024**3) // 4)  # every page touched: resident while it trains

        app = client_app_with_failures(scenario, before_train)
        results[case] = read_rounds(simulate(scenario, run_dir=tmp_path / case, client_app=app))
    rounds = results["memory"]
    assert [r["round"] for r in rounds] == [1, 2]
    reason = rounds[0]["rejected"]["2"]
    assert rounds[0]["rejected"].keys() == {"2"} and f"client exceeded federation.client_memory_gb={limit:g} (peak " in reason
    peak = float(reason.split("(peak ")[1].split(" GB")[0])
    assert limit < peak < limit + 2.0, reason
    assert rounds[0]["aggregated"] == [0, 1, 3, 4, 5] and not rounds[1]["rejected"]
    assert rounds[1]["aggregated"] == [0, 1, 2, 3, 4, 5]
    figures = ("aggregated", "main_accuracy", "main_loss", "bytes_up")
    assert [{k: r[k] for k in figures} for r in rounds] == [{k: r[k] for k in figures} for r in results["raise"]]


@pytest.mark.simulation
@pytest.mark.slow
def test_a_ray_node_lost_mid_run(tmp_path):
    """A two-node cluster on this machine: `ray start --head` (1 CPU) and a worker node joined with
    `ray start --address` (1 CPU, its own temp dir), one client actor on each. In round 2 of 4, while
    a client trains on the worker node, every process of that node (its raylet, its agents, the
    actor's worker) is SIGKILLed. The clients that were on it in round 2 are recorded as failed, with
    the lost actor as the reason (or trained again on the head node, see below); Ray would restart that actor but no node has room for it, so the
    engine takes it out of the pool and the run goes on, on the head node's actor, to the end, no
    round waiting for its timeout; rounds 3 and 4 train on the head node, and round 4 everyone."""
    from failing_app import client_app_with_failures
    from test_deployment import free_port
    from test_ray_cluster import RAY, _processes_naming, _stop_cluster

    if not RAY.exists():
        pytest.skip("the ray command is not installed next to this Python")
    import subprocess
    import tempfile

    port = free_port()
    head = tempfile.mkdtemp(prefix="fsh", dir="/tmp")  # short: Ray's socket paths must fit in 107 bytes
    worker = tempfile.mkdtemp(prefix="fsw", dir="/tmp")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    common = ["--node-ip-address=127.0.0.1", "--num-cpus=1", "--disable-usage-stats",
              f"--object-store-memory={100 * 1024**2}"]
    trained = tmp_path / "trained"
    trained.mkdir()
    folder = str(trained)

    def before_train(pid, rnd):
        import ray

        with open(os.path.join(folder, f"{pid}-{rnd}-{os.getpid()}-{ray.get_runtime_context().get_node_id()}"), "w"):
            pass
        if rnd == 2:
            time.sleep(1.0)  # the node is killed while this trains
        return None

    killed: list[set[int]] = []
    killed_commands: list[str] = []
    done = threading.Event()

    def kill_the_worker_node():
        while not done.is_set() and not killed:
            for name in os.listdir(folder):
                if name.split("-")[1] == "2" and int(name.split("-")[2]) in _processes_naming(worker):
                    victims = _processes_naming(worker)
                    for victim in victims:
                        with contextlib.suppress(OSError):
                            killed_commands.append(Path(f"/proc/{victim}/cmdline").read_bytes().split(b"\0")[0].decode())
                    for victim in victims:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(victim, signal.SIGKILL)
                    killed.append(victims)
                    break
            time.sleep(0.02)

    try:
        subprocess.run([str(RAY), "start", "--head", f"--port={port}", f"--temp-dir={head}", "--include-dashboard=false",
                        *common], check=True, env=env, capture_output=True, timeout=120)
        subprocess.run([str(RAY), "start", f"--address=127.0.0.1:{port}", f"--temp-dir={worker}", *common],
                       check=True, env=env, capture_output=True, timeout=120)
        scenario = small_scenario("federation.rounds=4", f"federation.ray_address=127.0.0.1:{port}",
                                  "federation.round_timeout=60")
        killer = threading.Thread(target=kill_the_worker_node, daemon=True)
        killer.start()
        run_dir = simulate(scenario, run_dir=tmp_path / "run", client_app=client_app_with_failures(scenario, before_train))
        done.set()
        killer.join()
        runs = [name.split("-") for name in os.listdir(folder)]
        nodes = {node for *_, node in runs}
    finally:
        done.set()
        _stop_cluster(head)
        _stop_cluster(worker)
        leftover = _processes_naming(head) | _processes_naming(worker)
        subprocess.run(["rm", "-rf", head, worker], check=False)
    assert not leftover, f"cluster processes still running: {sorted(leftover)}"
    assert len(killed) == 1 and any(c.endswith("/raylet") for c in killed_commands), killed_commands
    rounds = read_rounds(run_dir)
    assert [r["round"] for r in rounds] == [1, 2, 3, 4]
    assert (run_dir / "summary.json").exists()
    assert len(nodes) == 2 and not rounds[0]["rejected"]
    # round 1 ran on both nodes; which node is the worker's: the one whose round-2 runs were cut off
    head_node = {node for pid, rnd, _, node in runs if rnd in ("3", "4")}
    assert len(head_node) == 1, "after the loss every client trains on the head node"
    lost_node = (nodes - head_node).pop()
    on_lost_node = {int(pid) for pid, rnd, _, node in runs if rnd == "2" and node == lost_node}
    on_head_node = {int(pid) for pid, rnd, _, node in runs if rnd == "2" and node != lost_node}
    lost = {int(p): reason for p, reason in rounds[1]["rejected"].items()}
    assert on_lost_node and sorted([*rounds[1]["aggregated"], *lost]) == list(range(6))
    for reason in lost.values():
        assert reason.startswith("client error: the client's actor was lost"), reason
    # a client cut off on the lost node: recorded as failed, or, when Ray declared the node dead
    # before the message's retry gave up (its health checks: 5 x 3 s by default), sent again to the
    # head node's actor, where it trained and was aggregated
    for pid in on_lost_node:
        assert pid in lost or (pid in rounds[1]["aggregated"] and pid in on_head_node), (pid, rounds[1])
    assert all(pid in on_head_node for pid in rounds[1]["aggregated"])
    for r in rounds[2:]:
        assert all(reason.startswith("client error: the client's actor was lost") for reason in r["rejected"].values())
        assert r["wall_seconds"] < 30, "a round waited for the lost actor"
    assert rounds[3]["aggregated"] == list(range(6)) and not rounds[3]["rejected"]


@pytest.mark.simulation
def test_the_actor_pool_counts_client_memory_gb():
    """federation.client_memory_gb is each client actor's Ray `memory`. On a local Ray with 4 CPUs,
    a limit of 2/3 of the node's memory resource leaves room for one actor: fedsim's pool makes one,
    where Flower's rule (CPUs only) would make 4, and an actor beyond the first is never placed: a
    message handed to it would wait for ever."""
    import ray

    from fedsim.engine.ray_actor import client_actor_class
    from fedsim.engine.ray_start import actor_pool_size, client_resources
    from fedsim.flower import compat as flower_compat

    ray.init(num_cpus=4, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        memory = sum(n["Resources"].get("memory", 0) for n in ray.nodes() if n["Alive"])
        limit = round(memory / 1.5 / 1024**3, 3)
        resources = client_resources(small_scenario(f"federation.client_memory_gb={limit}"))
        assert resources["memory"] == int(limit * 1024**3) and resources["num_cpus"] == 1
        assert flower_compat.actor_pool_size(resources) == 4
        assert actor_pool_size(resources) == 1
        assert "memory" not in client_resources(small_scenario())
        actors = [client_actor_class().options(**resources).remote() for _ in range(2)]
        answers = [actor.warm_up.remote("{}", "no scenario") for actor in actors]  # answers once placed
        placed, waiting = ray.wait(answers, num_returns=1, timeout=60)
        assert len(placed) == 1
        assert not ray.wait(waiting, timeout=3)[0]  # the second actor's memory does not fit: never placed
    finally:
        ray.shutdown()
