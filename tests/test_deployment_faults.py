"""Deployment faults (#38 item 4): a SuperLink restarted mid-run, a node dropping out of a secure
round, and the replies a SuperLink sends for nodes it has marked offline.

The slow tests start a real SuperLink (with its database on disk) and real SuperNodes as processes
(tests/test_deployment.py: Cluster) and inject the fault into them: SIGKILL. The fast ones check
the pieces those rely on in-process.
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
import torch

from conftest import QUICKSTART, quick_scenario, run_local
from fedsim.client.app import make_client_app
from fedsim.deploy import commands as deploy
from fedsim.flower.compat import from_the_link
from fedsim.flower.local_grid import StageDropGrid
from fedsim.runs.checkpoint import load_server
from fedsim.runs.results import read_rounds
from fedsim.scenario import ScenarioError
from test_deploy_commands import APP_TOML

REPO = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------- in-process
class LinkAnsweredDropGrid(StageDropGrid):
    """StageDropGrid whose dropped nodes are answered for as a SuperLink does for a node it has
    marked offline: an error reply from the link's own node id (every such reply has the same
    `src_node_id`), not from the node's."""

    def send_and_receive(self, messages, *, timeout=None):
        replies = list(super().send_and_receive(messages, timeout=timeout))
        return [from_the_link(r) if r.has_error() else r for r in replies]


def secure_scenario(*overrides: str):
    return quick_scenario("federation.num_clients=6", "federation.clients_per_round=5", "federation.rounds=1",
                          "federation.local_epochs=1", "attack=null", "evaluation.overlap=false", *overrides,
                          base=QUICKSTART)


def one_round(sc, grid=None):
    result = run_local(sc, tempfile.mkdtemp(), grid=grid, checkpoints=True)
    line = [r for r in result.rounds if r["round"] > 0][-1]
    return line, load_server(result.path, at_most=line["round"])["global"]


@pytest.mark.parametrize("stage, summed_too", [("collect_masked_vectors", False), ("unmask", True)])
def test_secaggplus_round_is_not_disturbed_by_the_links_error_replies_for_offline_nodes(stage, summed_too):
    """Two nodes gone at a SecAgg+ stage, each answered for by the link (one src_node_id for both):
    the round completes with the survivors, each dropout is filed under its own client, and the
    aggregate equals the one where the nodes' own error replies came (fedsim/server/secure.py and
    Flower's SecAggPlusWorkflow read src_node_id of non-error replies only)."""
    sc = secure_scenario("secure_aggregation={name: secaggplus}")
    probe, _ = one_round(sc)
    victims = probe["sampled"][1:3]
    drop = {v: stage for v in victims}
    line, secure = one_round(sc, LinkAnsweredDropGrid(make_client_app(sc), 6, drop))
    own_line, own = one_round(sc, StageDropGrid(make_client_app(sc), 6, drop))  # the nodes' own error replies
    summed = line["secure_aggregation"]["summed"]
    assert line["skipped"] is None and line["sampled"] == probe["sampled"]
    assert all((v in summed) == summed_too for v in victims)
    assert summed == own_line["secure_aggregation"]["summed"]
    assert set(line["rejected"]) == set(own_line["rejected"]) <= {str(p) for p in line["sampled"]}
    if not summed_too:
        assert set(line["rejected"]) == {str(v) for v in victims}
    assert torch.equal(secure, own)


def test_a_resume_of_another_scenario_is_refused_naming_what_differs(tmp_path):
    from fedsim.deploy.run_config import resumed_folder
    from fedsim.runs.folder import RunFolder

    sc = quick_scenario()
    folder = RunFolder.create(sc, tmp_path)
    assert resumed_folder(str(folder.path), quick_scenario("output.dir=elsewhere")).path == folder.path
    with pytest.raises(ScenarioError) as err:
        resumed_folder(str(folder.path), quick_scenario("federation.rounds=5"))
    assert "federation" in str(err.value) and "resume-dir" in str(err.value)
    with pytest.raises(ScenarioError) as err:
        resumed_folder(str(tmp_path / "nothing"), sc)
    assert "not a run folder" in str(err.value)
    async_sc = quick_scenario("systems.round={name: fedbuff, buffer_size: 2}")
    with pytest.raises(ScenarioError) as err:
        resumed_folder(str(RunFolder.create(async_sc, tmp_path).path), async_sc)
    assert "asynchronous round" in str(err.value)


def test_deploy_run_resume_alone_reads_the_run_config_the_folder_recorded(tmp_path):
    """`fedsim deploy run --resume DIR`: the scenario and --set options of the first run (the
    ServerApp's run_config.json in DIR), and `resume-dir` with DIR's absolute path."""
    run_dir = tmp_path / "quickstart-1"
    run_dir.mkdir()
    (run_dir / "run_config.json").write_text(json.dumps(
        {"scenario": "scenarios/quickstart.yaml", "overrides": "federation.rounds=3;federation.num_clients=3"}))
    env = dict(os.environ, FLWR_HOME=str(tmp_path / "home"))
    out = subprocess.run([sys.executable, "-m", "fedsim.cli", "deploy", "run", "--resume", str(run_dir), "--insecure",
                          "--dry-run"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert (f"""--run-config 'scenario="scenarios/quickstart.yaml" overrides="federation.rounds=3;federation.num_clients=3" """
            f"""resume-dir="{run_dir.resolve()}"'""") in out.stdout
    # a folder without the record (not a deployed run, or on another machine) says what to pass instead
    out = subprocess.run([sys.executable, "-m", "fedsim.cli", "deploy", "run", "--resume", str(tmp_path), "--insecure",
                          "--dry-run"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "fedsim deploy run FILE --set ... --resume DIR" in out.stderr
    # an asynchronous round cannot resume on a SuperLink: refused before anything starts
    out = subprocess.run([sys.executable, "-m", "fedsim.cli", "deploy", "run", "scenarios/quickstart.yaml", "--resume",
                          str(run_dir), "--insecure", "--dry-run", "--set", "systems.round={name: fedbuff, buffer_size: 2}"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "cannot resume on a SuperLink" in out.stderr


# --------------------------------------------------------------------------- a real SuperLink
def restart_superlink(cluster, old) -> None:
    """SIGKILL the SuperLink process alone (its own children follow it: flwr's parent monitors) and
    start it again on the same port with the same database file."""
    os.kill(old.pid, signal.SIGKILL)
    old.wait(timeout=30)
    cluster.procs.remove(old)
    (cluster.tmp / "superlink.log").rename(cluster.tmp / "superlink-before.log")
    cluster.superlink()


def wait_for_round(cluster, rnd: int, run, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        run_dir = cluster.run_dir()
        if run_dir is not None and any(r["round"] >= rnd for r in read_rounds(run_dir)):
            return
        assert run.poll() is None, (cluster.tmp / "flwr_run.log").read_text()[-3000:]
        time.sleep(0.5)
    raise AssertionError(f"round {rnd} never written: {(cluster.tmp / 'flwr_run.log').read_text()[-3000:]}")


@pytest.mark.slow
@pytest.mark.chaos
@pytest.mark.timeout(900)
def test_superlink_restarted_mid_run_fails_the_run_and_resume_completes_it_with_each_round_once(tmp_path):
    """flwr 1.41: the SuperLink's ServerApp process dies with it (its executor watches the link's
    pid, the ServerApp its executor's) and the restarted link fails the run ("No heartbeat received
    from the task"); the SuperNodes reconnect on their own. `fedsim deploy run` exits 1 and says
    `fedsim deploy run --resume DIR`; that command, against the restarted link, completes the run:
    rounds 1..2 each once, the same lines as an uninterrupted in-process run."""
    from test_deployment import SCENARIO, Cluster, in_process_rounds, strip

    sets = [s for s in SCENARIO if "rounds" not in s] + ["federation.rounds=2", "federation.round_timeout=120"]
    cluster = Cluster(tmp_path)
    try:
        cluster.superlink()
        link = cluster.procs[-1]
        for i in range(3):
            cluster.supernode(i, 3)
        cli = [sys.executable, "-m", "fedsim.cli", "deploy", "run"]
        link_args = ["--insecure", "--superlink", cluster.address]
        run = cluster.start(cli + ["scenarios/quickstart.yaml", *link_args, "--output", str(tmp_path / "results"),
                                   *sum((["--set", s] for s in sets), [])], "flwr_run", cwd=REPO)
        wait_for_round(cluster, 1, run)
        restart_superlink(cluster, link)
        assert run.wait(timeout=120) == 1
        run_dir = cluster.run_dir()
        out = (tmp_path / "flwr_run.log").read_text()
        assert f"fedsim deploy run --resume {run_dir.resolve()}" in out, out[-3000:]
        assert max(r["round"] for r in read_rounds(run_dir)) < 2 and not (run_dir / "summary.json").exists()

        resumed = cluster.start(cli + ["--resume", str(run_dir), *link_args], "flwr_resume", cwd=REPO)
        assert resumed.wait(timeout=600) == 0, (tmp_path / "flwr_resume.log").read_text()[-3000:]
    finally:
        cluster.stop()
    rounds = read_rounds(run_dir)
    assert [r["round"] for r in rounds if r["round"] > 0] == [1, 2]
    assert json.loads((run_dir / "summary.json").read_text())["rounds_completed"] == 2
    assert "fedsim: resuming the run in" in (tmp_path / "flwr_resume.log").read_text()
    assert strip(in_process_rounds(tmp_path, sets)) == strip(rounds)


@pytest.mark.slow
@pytest.mark.chaos
@pytest.mark.timeout(900)
def test_a_supernode_killed_during_a_secure_run_drops_out_of_the_next_round(tmp_path):
    """Three SuperNodes, LightSecAgg (U = N - D = 2), two rounds; node 2 is SIGKILLed (with its
    ClientApp process) once round 1 is written, as round 2's protocol starts. Its messages go
    unanswered until the stage timeout (federation.round_timeout) and it is dropped at the first
    stage; its reason is filed under client 2, never under the SuperLink's id; the two survivors
    are summed.

    SecAgg+ under the same fault halts the round although 2 of 3 shares would do (Flower's
    SecAggPlusWorkflow, 1.41, asks at unmask for `threshold` shares of every node sampled at setup);
    that is Flower's protocol code, the same on any grid, so it is shown on the in-process grid
    (test_secaggplus_halts_when_a_node_is_lost_before_it_dealt_its_shares): on a real SuperLink it
    took 164 s more of CI."""
    section = "{name: lightsecagg, privacy: 1, dropout: 1}"
    from test_deployment import SCENARIO, Cluster, wait_summary

    over = [s for s in SCENARIO if "rounds" not in s] + ["federation.rounds=2", "federation.round_timeout=30",
                                                          f"secure_aggregation={section}"]
    cluster = Cluster(tmp_path)
    try:
        cluster.superlink()
        nodes = [cluster.supernode(i, 3) for i in range(3)]
        run = cluster.run(over)
        wait_for_round(cluster, 1, run)
        os.killpg(nodes[2].pid, signal.SIGKILL)
        summary = wait_summary(cluster, 300, run)
        rounds = [r for r in read_rounds(cluster.run_dir()) if r["round"] > 0]
    finally:
        cluster.stop()
    assert summary["rounds_completed"] == 2 and [r["round"] for r in rounds] == [1, 2]
    first, second = rounds
    assert first["secure_aggregation"]["summed"] == [0, 1, 2] and not first["rejected"]
    assert second["sampled"] == [0, 1, 2] and "2" in second["rejected"]
    assert "first stage" in second["rejected"]["2"], second["rejected"]
    assert second["skipped"] is None and second["secure_aggregation"]["summed"] == [0, 1]
    assert set(second["rejected"]) == {"2"}


HOSTILE_APP = '''"""A ClientApp that answers as fedsim's, except on partition 2, whose train replies carry
{junk} random bytes more (random: Flower stores identical chunks once)."""
import numpy as np
from flwr.app import ArrayRecord
from flwr.clientapp import ClientApp

from fedsim.client.app import make_client_app

honest = make_client_app()
app = ClientApp()


@app.query()
def query(msg, context):
    return honest(msg, context)


@app.train()
def train(msg, context):
    reply = honest(msg, context)
    if int(context.node_config["partition-id"]) == 2 and not reply.has_error():
        junk = np.random.default_rng().integers(0, 256, size={junk}, dtype=np.uint8)
        reply.content["junk"] = ArrayRecord([junk])
    return reply
'''

HOSTILE_PYPROJECT = APP_TOML.replace('name = "myapp"', 'name = "hostile"').replace("fedsim.client.app:app", "hostile:app")


@pytest.mark.slow
@pytest.mark.chaos
@pytest.mark.timeout(900)
def test_an_oversized_reply_from_a_hostile_supernode_is_refused_at_the_servers_bound_while_pulled(tmp_path):
    """SuperNode 2 runs a ClientApp whose train reply carries 24 MB more than fedsim's (an app of
    its own: the FAB's ClientApp is whatever the node runs). The ServerApp stops pulling that reply
    once it passes the bound (fedsim/deploy/bounded_grid.py: twice the upload bound of fedsim/wire.py
    plus 1 MiB), holding at most the bound plus the two objects in flight, and the round aggregates
    the other two with node 2 rejected for it."""
    from test_deployment import SCENARIO, Cluster, wait_summary

    from fedsim.deploy.bounded_grid import reply_limit
    from fedsim.runtime import runtime_for
    from fedsim.scenario import load_scenario

    junk = 24 * 2**20
    app = tmp_path / "app"
    (app / "scenarios").mkdir(parents=True)
    (app / "scenarios" / "quickstart.yaml").write_text((REPO / "scenarios" / "quickstart.yaml").read_text())
    (app / "pyproject.toml").write_text(HOSTILE_PYPROJECT)
    (app / "hostile.py").write_text(HOSTILE_APP.replace("{junk}", str(junk)))
    sets = [s for s in SCENARIO if "rounds" not in s] + ["federation.rounds=1", "federation.round_timeout=120"]
    limit = reply_limit(runtime_for(load_scenario(app / "scenarios" / "quickstart.yaml", sets)).layout)
    assert limit < junk / 4
    cluster = Cluster(tmp_path)
    try:
        cluster.superlink()
        for i in range(3):
            cluster.supernode(i, 3)
        deploy.write_connection(tmp_path / "flwr_home", "test", cluster.address)
        cmd = deploy.run_cmd("test", app / "scenarios" / "quickstart.yaml", sets, tmp_path / "results", app_dir=app)
        run = cluster.start(cmd, "flwr_run")
        summary = wait_summary(cluster, 300, run)
        rounds = [r for r in read_rounds(cluster.run_dir()) if r["round"] > 0]
    finally:
        cluster.stop()
    assert summary["rounds_completed"] == 1
    (line,) = rounds
    assert line["sampled"] == [0, 1, 2] and line["aggregated"] == [0, 1] and line["skipped"] is None
    assert set(line["rejected"]) == {"2"}
    reason = line["rejected"]["2"]
    assert f"exceeds {limit} bytes, the most this server pulls for one reply" in reason, reason
    pulled = int(reason.split("(pulled ")[1].split(" bytes")[0])
    assert limit < pulled <= limit + 2 * 5 * 2**20 < junk  # Flower's chunks: 5 MiB, two pulled at once


@pytest.mark.parametrize("stage", ["setup", "share_keys"])
def test_secaggplus_halts_when_a_node_is_lost_before_it_dealt_its_shares(stage):
    """flwr 1.41's SecAggPlusWorkflow wants `threshold` shares of every node sampled at setup at its
    unmask stage; a node lost at setup or share_keys dealt none, so the round halts however many
    survive (4 of 5 here, threshold 2), and fedsim records it skipped with the reasons
    (docs/deployment.md, "A node that drops out of a secure round"). LightSecAgg survives it."""
    sc = secure_scenario("secure_aggregation={name: secaggplus}")
    probe, _ = one_round(sc)
    victim = probe["sampled"][1]
    line, _ = one_round(sc, StageDropGrid(make_client_app(sc), 6, {victim: stage}))
    assert line["skipped"] == "secaggplus halted in every group" and line["secure_aggregation"]["summed"] == []
    assert set(line["rejected"]) == {str(p) for p in probe["sampled"]}
    light = secure_scenario("secure_aggregation={name: lightsecagg}")
    stage_light = {"setup": "keys", "share_keys": "shares"}[stage]
    line, _ = one_round(light, StageDropGrid(make_client_app(light), 6, {victim: stage_light}))
    assert line["skipped"] is None and victim not in line["secure_aggregation"]["summed"]
    assert set(line["rejected"]) == {str(victim)}
