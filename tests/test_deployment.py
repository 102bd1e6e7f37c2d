"""The same apps on Flower's deployment engine: a real SuperLink and SuperNodes on loopback.

Slow (real processes, a ClientApp process per message): run with `pytest -m slow`.
Every process is started in its own session and killed at the end (its whole process group:
SuperNodes take their executors and ClientApp processes with them), even on failure.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedsim.server.record import without_times
from fedsim.deploy import commands as deploy
from fedsim.runs.results import read_rounds

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
REPO = Path(__file__).resolve().parents[1]
BIN = Path(os.environ.get("VIRTUAL_ENV", REPO / ".venv")) / "bin"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    def __init__(self, tmp: Path) -> None:
        self.tmp, self.procs = tmp, []
        self.env = deploy.deploy_env(tmp / "flwr_home")
        self.env["PATH"] = f"{BIN}:{self.env['PATH']}"
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"

    def start(self, cmd: list[str], name: str, cwd: Path | None = None) -> subprocess.Popen:
        log = open(self.tmp / f"{name}.log", "w")
        proc = subprocess.Popen(cmd, env=self.env, cwd=cwd or self.tmp, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        self.procs.append(proc)
        return proc

    def superlink(self, tls=None) -> None:
        self.start(deploy.superlink_cmd(port=self.port, tls=tls, database=self.tmp / "state.db"), "superlink")
        deadline = time.time() + 60
        while time.time() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.5)
        raise TimeoutError("SuperLink did not open its port")

    def supernode(self, i: int, n: int, **kw) -> subprocess.Popen:
        return self.start(deploy.supernode_cmd(i, n, self.address, port=free_port(), **kw), f"supernode{i}")

    def run(self, overrides: list[str], root_cert=None, timeout: float = 600) -> subprocess.Popen:
        deploy.write_connection(self.tmp / "flwr_home", "test", self.address, root_cert)
        cmd = deploy.run_cmd("test", REPO / "scenarios/quickstart.yaml", overrides, self.tmp / "results")
        return self.start(cmd, "flwr_run")

    def run_dir(self) -> Path | None:
        found = sorted((self.tmp / "results").glob("*/rounds.jsonl"))
        return found[0].parent if found else None

    def stop(self) -> None:
        for proc in reversed(self.procs):
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(proc.pid, sig)
                    proc.wait(timeout=10)
                    break
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    continue


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.stop()


SCENARIO = ["federation.num_clients=3", "federation.clients_per_round=3", "federation.rounds=2",
            "attack.attacker_ids=[0]", "attack.schedule={name: every_round}"]


def wait_summary(cluster: Cluster, timeout: float, run: subprocess.Popen) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        run_dir = cluster.run_dir()
        if run_dir is not None and (run_dir / "summary.json").exists():
            return json.loads((run_dir / "summary.json").read_text())
        if run.poll() is not None and run.returncode != 0:
            break  # `flwr run` failed: no point in waiting
        time.sleep(2)
    logs = {p.name: p.read_text()[-3000:] for p in cluster.tmp.glob("*.log")}
    raise AssertionError(f"no summary (flwr run exit {run.poll()}); logs: {logs}")


def in_process_rounds(tmp: Path, overrides: list[str]) -> list[dict]:
    """The same scenario and seed on an in-process grid: the metrics every transport must reproduce.
    Its messages go to the clients one by one (`cohorts=False`), as a SuperNode gets them: a deployed
    client trains alone, never vectorised with a cohort (fedsim/client/cohort.py)."""
    from fedsim.client.app import make_client_app
    from fedsim.runs.folder import RunFolder
    from fedsim.scenario import load_scenario
    from fedsim.server.app import run_server
    from fedsim.flower.local_grid import LocalGrid

    scenario = load_scenario(REPO / "scenarios/quickstart.yaml", overrides)
    local_dir = RunFolder.create(scenario, tmp / "local").path
    run_server(LocalGrid(make_client_app(scenario), 3, cohorts=False), scenario, local_dir)
    return read_rounds(local_dir)


def strip(rounds: list[dict]) -> list[dict]:
    return without_times(rounds)


def test_scenario_runs_on_superlink_with_three_supernodes(cluster):
    cluster.superlink()
    for i in range(3):
        cluster.supernode(i, 3)
    run = cluster.run(SCENARIO + ["federation.round_timeout=300"])
    summary = wait_summary(cluster, 600, run)
    rounds = read_rounds(cluster.run_dir())
    assert summary["rounds_completed"] == 2
    assert [r["attackers"] for r in rounds] == [[0], [0]]
    assert all(r["sampled"] == [0, 1, 2] and not r["rejected"] for r in rounds)
    assert all(r["backdoor_success"] is not None and r["bytes_up"] > 0 for r in rounds)
    # the same scenario and seed in-process gives the same metrics: only the transport differs
    assert strip(in_process_rounds(cluster.tmp, SCENARIO + ["federation.round_timeout=300"])) == strip(rounds)


def test_fedbuff_runs_on_a_real_superlink_as_replies_come(cluster):
    """An asynchronous round on real SuperNodes: the server keeps `concurrency` messages in flight
    (Grid.push_messages) and steps the model every K replies as they are pulled (fedsim/server/live.py)."""
    cluster.superlink()
    for i in range(3):
        cluster.supernode(i, 3)
    run = cluster.run(SCENARIO[:2] + ["federation.rounds=4", "federation.round_timeout=300", "attack.attacker_ids=[0]",
                                      "attack.schedule={name: every_round}",
                                      "systems.round={name: fedbuff, buffer_size: 2}"])
    summary = wait_summary(cluster, 600, run)
    rounds = read_rounds(cluster.run_dir())
    assert summary["rounds_completed"] == 4 and [r["round"] for r in rounds] == [1, 2, 3, 4]
    for r in rounds:  # a buffer of K = 2 a step, each update's model version and staleness recorded
        assert len(r["sampled"]) == 2 and not r["rejected"] and r["skipped"] is None
        assert all(r["staleness"][str(p)] == r["round"] - 1 - r["trained_from"][str(p)] for p in r["sampled"])
        assert "sim_time" not in r  # the real clock: `arrived` is the server's seconds since the start
        assert all(t > 0 for t in r["arrived"].values())
    assert any(r["attackers"] == [0] for r in rounds)  # the attacker's slot: always in flight


def test_process_isolation_with_forking_executor_gives_the_same_metrics(cluster):
    """`fedsim deploy supernode --isolation process`: each SuperNode with fedsim's forking executor beside it.

    The metrics must equal the in-process run's, which the default-mode test above also equals:
    the executor changes how ClientApp processes start, not what they compute. Node 2 runs Flower's
    own `flower-superexec` instead, so both executors serve one run.
    """
    cluster.superlink()
    nodes = []
    for i in range(3):
        cmd = [sys.executable, "-m", "fedsim.cli", "deploy", "supernode", "--insecure", "--superlink", cluster.address,
               "--partition", str(i), "--num-partitions", "3", "--node-port", str(free_port()),
               "--isolation", "process", "--executor", "fork" if i < 2 else "flower"]
        nodes.append(cluster.start(cmd, f"supernode{i}"))
    run = cluster.run(SCENARIO + ["federation.round_timeout=300"])
    summary = wait_summary(cluster, 600, run)
    rounds = read_rounds(cluster.run_dir())
    assert summary["rounds_completed"] == 2
    assert all(r["sampled"] == [0, 1, 2] and not r["rejected"] for r in rounds)
    logs = [(cluster.tmp / f"supernode{i}.log").read_text() for i in range(3)]
    for log in logs[:2]:  # the node-discovery query and two train messages, each in a forked process
        assert "fedsim executor: Runtime API" in log and log.count("-> ClientApp process") >= 3
    assert "fedsim executor" not in logs[2] and "Start `flwr-clientapp` process" in logs[2]
    assert strip(in_process_rounds(cluster.tmp, SCENARIO + ["federation.round_timeout=300"])) == strip(rounds)
    # the wrapper supervises its pair: SIGTERM to it stops the SuperNode and the executor
    os.kill(nodes[0].pid, signal.SIGTERM)
    assert nodes[0].wait(timeout=30) == 0
    assert group_members(nodes[0].pid) == [], "processes left in the node's process group"


def group_members(pgid: int) -> list[int]:
    """Live processes of a process group, from /proc (zombies, already dead, are not counted)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members


# flwr 1.41 has no heartbeat option: a SuperNode reports every 17.5-22.5 s and the SuperLink marks it
# offline 2 x 30 s after its last report (HEARTBEAT_DEFAULT_INTERVAL, HEARTBEAT_PATIENCE), then
# answers for it with a "Node Unavailable" error reply. A round_timeout above that lets the
# SuperLink's verdict arrive before the server stops waiting.
OFFLINE_AFTER = 60


def test_killed_supernode_is_reported_unavailable_and_its_rounds_do_not_wait_past_the_timeout(cluster):
    """`fedsim deploy run` from the app's directory (the FAB built there, the scenario named
    relative to it), 3 SuperNodes, 4 rounds; node 2 is killed once round 1 is written.

    Every `rejected` entry names a client sampled in its round, with the true reason: the node the
    SuperLink declared unavailable, never a timeout (the SuperLink's error reply comes from its
    own node id, and must still be put under the client whose message it answers). The round
    that lost the node ends no later than the longest other round plus round_timeout, the later
    ones at once. The ServerApp logs each round's row, and the run exits 0."""
    timeout = OFFLINE_AFTER + 30
    cluster.superlink()
    nodes = [cluster.supernode(i, 3) for i in range(3)]
    sets = [s for s in SCENARIO if "rounds" not in s] + ["federation.rounds=4", f"federation.round_timeout={timeout}"]
    cmd = [sys.executable, "-m", "fedsim.cli", "deploy", "run", "scenarios/quickstart.yaml", "--insecure",
           "--superlink", cluster.address, "--output", str(cluster.tmp / "results"), *sum((["--set", s] for s in sets), [])]
    run = cluster.start(cmd, "flwr_run", cwd=REPO)
    deadline = time.time() + 600
    while time.time() < deadline and run.poll() is None and not (cluster.run_dir() and read_rounds(cluster.run_dir())):
        time.sleep(0.5)
    os.killpg(nodes[2].pid, signal.SIGKILL)  # device 2 dies (with its ClientApp process) after round 1
    assert run.wait(timeout=600) == 0, (cluster.tmp / "flwr_run.log").read_text()[-3000:]
    rounds = [r for r in read_rounds(cluster.run_dir()) if r["round"] > 0]
    assert [r["round"] for r in rounds] == [1, 2, 3, 4]
    for r in rounds:
        assert set(r["rejected"]) <= {str(p) for p in r["sampled"]}, r["rejected"]
    lost = [r for r in rounds if r["rejected"]]
    assert lost and lost[-1]["round"] == 4 and [r["round"] for r in lost] == list(range(lost[0]["round"], 5))
    for r in lost:
        assert set(r["rejected"]) == {"2"} and r["aggregated"] == [0, 1]
        assert "Node Unavailable" in r["rejected"]["2"] and "round_timeout" not in r["rejected"]["2"], r["rejected"]
    others = max(r["wall_seconds"] for r in rounds if not r["rejected"])  # every reply came
    assert lost[0]["wall_seconds"] <= others + timeout, (lost[0]["wall_seconds"], others)
    for r in lost[1:]:  # the node is offline by then: the SuperLink answers for it at once
        assert r["wall_seconds"] < others + OFFLINE_AFTER / 2, (r["round"], r["wall_seconds"], others)
    log = (cluster.tmp / "flwr_run.log").read_text()
    for k in range(1, 5):
        assert f"fedsim round {k}/4: acc " in log, log[-3000:]


def test_tls_with_supernode_authentication(cluster, tmp_path):
    certs = tmp_path / "certs"
    subprocess.run(["bash", str(REPO / "scripts/generate_certs.sh"), str(certs), "4"], check=True, capture_output=True)
    tls = deploy.Tls(certs / "ca.crt", certs / "server.pem", certs / "server.key")
    cluster.superlink(tls)
    deploy.write_connection(cluster.tmp / "flwr_home", "test", cluster.address, tls.ca_cert)
    for i in range(3):  # register the three devices' public keys before they connect
        subprocess.run([str(BIN / "flwr"), "supernode", "register", str(certs / f"node{i}_key.pub"), "test"],
                       env=cluster.env, cwd=cluster.tmp, check=True, capture_output=True, timeout=120)
        cluster.supernode(i, 3, root_cert=tls.ca_cert, auth_key=certs / f"node{i}_key")
    intruder = cluster.supernode(3, 4, root_cert=tls.ca_cert, auth_key=certs / "node3_key", max_retries=1)
    assert intruder.wait(timeout=120) != 0  # an unregistered key is refused
    run = cluster.run(SCENARIO + ["federation.round_timeout=300"], root_cert=tls.ca_cert)
    summary = wait_summary(cluster, 600, run)
    assert summary["rounds_completed"] == 2


def test_a_run_whose_every_round_is_skipped_fails_under_flwr_run(cluster, tmp_path, capfd):
    """Every round skipped (one device lacks its data, and min_replies needs all three): the
    ServerApp ends the run as failed and `fedsim deploy run` (deploy.run_and_check) exits 1,
    where `flwr run` alone exits 0 whatever became of the run."""
    from conftest import data_dir

    if data_dir() is None:
        pytest.skip("needs MNIST in $FEDSIM_DATA_DIR or ../shared/data")
    empty = tmp_path / "no-data"
    empty.mkdir()
    cluster.superlink()
    for i in range(3):
        cluster.supernode(i, 3, data_dir=empty if i == 2 else data_dir())
    overrides = SCENARIO + ["federation.round_timeout=300", "federation.min_replies=3", "data.dataset=mnist",
                            "attack=null", f"data.dir={data_dir()}", "federation.local_epochs=1", "federation.batch_size=64"]
    deploy.write_connection(cluster.tmp / "flwr_home", "test", cluster.address)
    cmd = deploy.run_cmd("test", REPO / "scenarios/quickstart.yaml", overrides, cluster.tmp / "results")
    assert deploy.run_and_check(cmd, "test", cluster.env) == 1
    rounds = read_rounds(cluster.run_dir())
    assert len(rounds) == 2 and all(r["skipped"] and "2" in r["rejected"] for r in rounds)
    assert "finished:failed" in capfd.readouterr().err


def digits_png_folder(folder: Path, per_class: int = 4) -> int:
    """A device's own images: the first `per_class` digits images of each class as PNGs in class
    folders, pixels on scikit-learn's 0..16 scale (what the digits dataset's model expects)."""
    from PIL import Image
    from sklearn.datasets import load_digits

    d = load_digits()
    count = 0
    for label in range(10):
        (folder / str(label)).mkdir(parents=True)
        for k, idx in enumerate((d.target == label).nonzero()[0][:per_class]):
            Image.fromarray(d.images[idx].astype("uint8"), mode="L").save(folder / str(label) / f"{k}.png")
            count += 1
    return count


def test_a_device_training_on_its_own_image_folder_beside_partition_nodes(cluster):
    """Issue #21: SuperNode 1 trains on its own folder of images (`--local-data`), the others on their
    partitions; the run gives what the same mix gives in-process, and node 1 reports its folder's size."""
    from flwr.app import Context

    from fedsim.client.app import make_client_app
    from fedsim.flower.local_grid import LocalGrid
    from fedsim.runs.folder import RunFolder
    from fedsim.scenario import load_scenario
    from fedsim.server.app import run_server

    own = cluster.tmp / "device1_images"
    count = digits_png_folder(own)
    overrides = ["attack=null", "federation.num_clients=3", "federation.clients_per_round=3", "federation.rounds=2",
                 "federation.round_timeout=300"]
    cluster.superlink()
    for i in range(3):
        cluster.supernode(i, 3, local_data=own if i == 1 else None)
    run = cluster.run(overrides)
    summary = wait_summary(cluster, 600, run)
    rounds = read_rounds(cluster.run_dir())
    assert summary["rounds_completed"] == 2 and all(r["sampled"] == [0, 1, 2] and not r["rejected"] for r in rounds)

    scenario = load_scenario(REPO / "scenarios/quickstart.yaml", overrides)
    app = make_client_app(scenario)
    reported = {}

    def device(msg, ctx):
        if int(ctx.node_config["partition-id"]) == 1:
            ctx = Context(run_id=ctx.run_id, node_id=ctx.node_id, state=ctx.state, run_config=ctx.run_config,
                          node_config={**ctx.node_config, "local-data": str(own)})
        reply = app(msg, ctx)
        if not reply.has_error() and "metrics" in reply.content:
            reported[int(ctx.node_config["partition-id"])] = int(reply.content["metrics"]["num-examples"])
        return reply

    local_dir = RunFolder.create(scenario, cluster.tmp / "local").path
    run_server(LocalGrid(device, 3), scenario, local_dir)
    assert reported[1] == count
    assert strip(read_rounds(local_dir)) == strip(rounds)  # only the transport differs
