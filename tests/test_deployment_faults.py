"""Deployment faults (#38 item 4): a SuperLink restarted mid-run, a node dropping out of a secure
round, the replies a SuperLink sends for nodes it has marked offline, an oversized reply and a flood
of replies from a hostile node.

The slow tests start a real SuperLink (with its database on disk) and real SuperNodes as processes
(tests/test_deployment.py: Cluster) and inject the fault into them: SIGKILL, a ClientApp of the
test's own, or a node of the test's own that speaks the Fleet API itself (HOSTILE_NODE). The fast
ones check the pieces those rely on in-process.
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


# A node that floods needs a client of its own: Flower's SuperNode pushes exactly one reply per
# message. This one speaks the Fleet API with the pieces flwr 1.41's flower-supernode uses
# (flwr/supernode/fleet_http_connection.py: http_request_response registers and activates the node
# and sends its heartbeats; start_client_internal.py and supernode/runtime/run_clientapp.py: how a
# message's objects are pulled and a reply's pushed), non-public modules all of them. It is test code
# playing an attacker, so those names stay in this string and never reach fedsim/, whose Flower
# internals are fenced into fedsim/flower/compat.py (tests/test_flower_compat.py scans fedsim/ and
# the plug-in folders, not tests/). The string is written to tmp_path and run as its own process, as
# a device's program would be.
HOSTILE_NODE = r'''"""A SuperNode of its own: registers and activates itself as flower-supernode does, answers every
message with fedsim's ClientApp, and floods the first train message with replies."""
import hashlib
import json
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message, RecordDict
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects, get_object_tree, no_object_id_recompute
from flwr.supercore.inflatable.inflatable_utils import pull_and_inflate_object_from_tree, push_objects
from flwr.supernode.fleet_http_connection import http_request_response

from fedsim.client.app import make_client_app
from fedsim.scenario import load_scenario

address, scenario, overrides, partition, partitions, folder = sys.argv[1:7]
DIFFERENT, REPEATS, JUNK = int(sys.argv[7]), int(sys.argv[8]), int(sys.argv[9])
folder = Path(folder)
app = make_client_app(load_scenario(scenario, json.loads(overrides)))


def poisoned(content: RecordDict, k: int) -> RecordDict:
    """The honest reply's records, every float array scaled by k + 2, plus JUNK random bytes."""
    out = RecordDict()
    for key, record in content.items():
        if isinstance(record, ArrayRecord):
            record = ArrayRecord(array_dict={n: Array(a.numpy() * (k + 2)) if a.numpy().dtype.kind == "f" else a
                                             for n, a in record.items()})
        out[key] = record
    out["junk"] = ArrayRecord([np.random.default_rng(k).integers(0, 256, size=JUNK, dtype=np.uint8)])
    return out


with http_request_response(address, insecure=True) as (node_id, receive, send, _r, _f, pull_object, push_object,
                                                       confirm):

    def push(answer: Message) -> int:
        """Push `answer` as flower-supernode does (its message and object tree, then the objects the
        SuperLink asks for); the number of objects it asked for: 0 when it refused the reply."""
        answer.metadata.__dict__["_message_id"] = answer.object_id  # a message's id is its object id
        with no_object_id_recompute():
            asked, session = send(answer, get_object_tree(answer), 0.1)
            if asked:
                push_objects(get_all_nested_objects(answer), partial(push_object, answer.metadata.run_id, session),
                             object_ids_to_push=set(asked))
        return len(asked)

    context = Context(run_id=0, node_id=node_id, state=RecordDict(), run_config={},
                      node_config={"partition-id": int(partition), "num-partitions": int(partitions)})
    flooded = False
    while True:
        got = receive()
        if got is None:
            time.sleep(0.2)
            continue
        shell, tree = got
        run_id = shell.metadata.run_id
        msg = pull_and_inflate_object_from_tree(tree, partial(pull_object, run_id), partial(confirm, run_id),
                                                return_type=Message)
        msg.metadata.__dict__["_message_id"] = tree.object_id
        context.run_id = run_id
        reply = app(msg, context)
        if flooded or msg.metadata.message_type != "train" or reply.has_error():
            push(reply)
            continue
        flooded = True
        (folder / "ready").write_text(msg.metadata.message_id)
        deadline = time.time() + 120
        while not (folder / "go").exists() and time.time() < deadline:
            time.sleep(0.05)
        start = time.time()
        report = {"train_id": msg.metadata.message_id, "honest": push(reply), "reply_id": reply.metadata.message_id}
        report["different"] = [push(Message(poisoned(reply.content, k), reply_to=msg)) for k in range(DIFFERENT)]
        report["repeats"] = [push(reply) for _ in range(REPEATS)]
        fake = Message(reply.content, reply_to=msg)
        fake_id = hashlib.sha256(b"a message the SuperLink never sent").hexdigest()
        fake.metadata.__dict__["_reply_to_message_id"] = fake_id
        report.update(fake_id=fake_id, fake=push(fake), seconds=time.time() - start)
        (folder / "flood.json").write_text(json.dumps(report))
'''


def descendant_named(pid: int, word: str) -> int | None:
    """The first live descendant of `pid` whose command line contains `word`, from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    todo = list(children.get(pid, []))
    while todo:
        p = todo.pop(0)
        try:
            if word in Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode():
                return p
        except OSError:
            continue
        todo += children.get(p, [])
    return None


def peak_rss_bytes(pid: int) -> int:
    """A process's peak resident set size so far (VmHWM in /proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM for process {pid}")


@pytest.mark.slow
@pytest.mark.chaos
@pytest.mark.timeout(600)
def test_a_flood_of_replies_from_a_hostile_node_is_refused_by_the_superlink_and_counted_once(tmp_path):
    """Partition 2 is a hostile node of the test's own (HOSTILE_NODE) that speaks the Fleet API itself:
    it answers every message with fedsim's ClientApp, and for its first train message pushes its honest
    reply, then 150 replies with other content (every float array scaled, 2 MiB of random junk each),
    then the honest reply 50 times more, then a reply to a message id the SuperLink never sent, as
    fast as it can (about 10-15 s on 2 busy cores: the SuperLink answers each push in turn).

    flwr 1.41's SuperLink keeps one reply per message (sql_linkstate.py: store_message_res): it asks
    for none of the other replies' objects, and logs each as refused, "duplicate reply" until the
    ServerApp pulls the first reply (which deletes the message), "does not exist" after; a repeat of
    the stored reply is taken as that reply before the pull (nothing logged) and refused after it;
    the reply to the unknown id is refused. The run completes, each round's line written once and the
    same lines as the in-process run (the hostile client's update counted once, the honest one), and
    neither the ServerApp's nor the SuperLink's peak memory grows by a tenth of what the flood
    announced."""
    from test_deployment import SCENARIO, Cluster, in_process_rounds, strip, wait_summary

    different, repeats, junk = 150, 50, 2 * 2**20
    sets = [s for s in SCENARIO if "rounds" not in s] + ["federation.rounds=2", "federation.round_timeout=120"]
    script = tmp_path / "hostile_node.py"
    script.write_text(HOSTILE_NODE)
    cluster = Cluster(tmp_path)
    try:
        cluster.superlink()
        link = cluster.procs[-1]
        for i in range(2):
            cluster.supernode(i, 3)
        cluster.start([sys.executable, str(script), cluster.address, str(REPO / "scenarios" / "quickstart.yaml"),
                       json.dumps(sets), "2", "3", str(tmp_path), str(different), str(repeats), str(junk)], "hostile")
        run = cluster.run(sets)
        deadline = time.time() + 300
        while not (tmp_path / "ready").exists():
            assert time.time() < deadline and run.poll() is None, (tmp_path / "hostile.log").read_text()[-3000:]
            time.sleep(0.2)
        server_app = descendant_named(link.pid, "flwr-serverapp")
        assert server_app is not None
        before = {"serverapp": peak_rss_bytes(server_app), "superlink": peak_rss_bytes(link.pid)}
        (tmp_path / "go").write_text("")
        wait_for_round(cluster, 1, run)
        # round 2 is still to come: the ServerApp is alive
        after = {"serverapp": peak_rss_bytes(server_app), "superlink": peak_rss_bytes(link.pid)}
        summary = wait_summary(cluster, 300, run)
        assert run.wait(timeout=120) == 0  # `flwr run --stream` has printed the ServerApp's whole log
        rounds = [r for r in read_rounds(cluster.run_dir()) if r["round"] > 0]
    finally:
        cluster.stop()
    flood = json.loads((tmp_path / "flood.json").read_text())
    link_log = (tmp_path / "superlink.log").read_text()
    duplicate = f"duplicate reply for reply_to_message_id {flood['train_id']}"
    gone = f"with message_id {flood['train_id']} does not exist"
    refusals = [line for line in link_log.splitlines() if duplicate in line or gone in line]
    print(f"flood: {1 + different + repeats + 1} pushes in {flood['seconds']:.1f} s; SuperLink refusals "
          f"{sum(duplicate in x for x in refusals)} duplicate, {sum(gone in x for x in refusals)} gone; peak RSS MiB "
          + ", ".join(f"{k} {before[k] / 2**20:.1f} -> {after[k] / 2**20:.1f}" for k in before)
          + "; round seconds " + str([r["wall_seconds"] for r in rounds]))
    # the attacker's side: the SuperLink asked for the objects of its first reply only
    assert flood["honest"] > 0 and flood["different"] == [0] * different and flood["repeats"] == [0] * repeats
    assert flood["fake"] == 0
    # the SuperLink's side: every different reply refused, as a duplicate until the ServerApp pulled the
    # first reply (which deletes the message), as a reply to a message that no longer exists after;
    # a repeat of the stored reply is taken silently as that reply before the pull, refused after it
    assert different <= len(refusals) <= different + repeats, len(refusals)
    kinds = [duplicate in line for line in refusals]
    assert kinds == sorted(kinds, reverse=True), "a duplicate refusal after the message was gone"
    assert link_log.count(f"with message_id {flood['fake_id']} does not exist") == 1
    assert summary["rounds_completed"] == 2 and [r["round"] for r in rounds] == [1, 2]
    log = (tmp_path / "flwr_run.log").read_text()
    assert [log.count(f"fedsim round {k}/2: acc ") for k in (1, 2)] == [1, 1], log[-3000:]
    assert all(r["sampled"] == [0, 1, 2] and r["aggregated"] == [0, 1, 2] and not r["rejected"] for r in rounds)
    assert strip(in_process_rounds(tmp_path, sets)) == strip(rounds)  # counted once, the honest reply
    for proc in ("serverapp", "superlink"):  # the flood announced different * junk bytes of content
        assert after[proc] - before[proc] < different * junk / 10, (proc, before, after)
