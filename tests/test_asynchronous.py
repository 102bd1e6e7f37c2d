"""Asynchronous protocols (systems.round: fedasync, fedbuff): staleness weights by hand, the event
order and buffer contents against a hand-worked timeline, the server steps' maths against a
hand computation, identical lines whatever order and timing the replies come in, attackers'
reporting behaviours, and the refusals."""

from __future__ import annotations

import random
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from conftest import QUICKSTART, quick_scenario, run_local
from fedsim.clock.asynchrony import ConstantStaleness, FedAsync, FedBuff, HingeStaleness, PolynomialStaleness
from fedsim.clock.events import AsyncFederation
from fedsim.registry import ATTACKS, load_components
from fedsim.scenario import ScenarioError
from fedsim.server.record import without_times


# --- staleness functions (FedAsync §5.2), by hand ------------------------------------------------
def test_staleness_functions_by_hand():
    assert [ConstantStaleness().weight(s) for s in (0, 3, 50)] == [1.0, 1.0, 1.0]
    poly = PolynomialStaleness(a=0.5)  # FedBuff's 1/sqrt(1 + staleness)
    assert poly.weight(0) == 1.0 and poly.weight(3) == pytest.approx(0.5) and poly.weight(8) == pytest.approx(1 / 3)
    assert PolynomialStaleness(a=2).weight(1) == pytest.approx(0.25)
    hinge = HingeStaleness(a=10, b=4)
    assert [hinge.weight(s) for s in (0, 4)] == [1.0, 1.0]
    assert hinge.weight(5) == pytest.approx(1 / 11) and hinge.weight(6) == pytest.approx(1 / 21)


# --- the event order, against a timeline worked by hand ----------------------------------------
class FakeClock:
    """Every client checked in, nobody drops out; attackers as systems.attackers says."""

    def __init__(self, num_clients: int, reporting: str = "eager") -> None:
        self.num_clients = num_clients
        self.systems = SimpleNamespace(idle_seconds=60.0, attackers=SimpleNamespace(reporting=reporting, always_on=True))

    def available_at(self, t, task):
        return np.ones(self.num_clients, dtype=bool)

    def drops_out(self, pid, task):
        return False


def federation(duration: dict[int, float], c: int, k: int, attackers=(), attack=None, reporting="eager"):
    """An AsyncFederation whose client i always takes duration[i] simulated seconds."""
    policy = FedBuff(buffer_size=k, concurrency=c)
    fed = SimpleNamespace(num_clients=len(duration), clients_per_round=c)
    clock = FakeClock(len(duration), reporting)

    def prepare(task):
        task.bound = task.start  # the loosest bound: every untrained task is trained before anything is processed

    def train(tasks):
        for t in tasks:
            t.finish, t.reply, t.times = t.start + duration[t.pid], f"reply {t.number}", [0.0, duration[t.pid], 0.0]

    return AsyncFederation(policy, fed, clock, list(attackers), attack, seed=0, prepare=prepare), train


def arrivals(step):
    return [(a.task.pid, a.time, a.staleness) for a in step.arrivals]


def test_buffer_contents_follow_the_clock_by_hand():
    # three clients, three slots: a freed slot can only take the client that freed it (the others
    # are busy), so each client restarts at its own arrivals: client 0 arrives at 1, 2, 3, 4, ...,
    # client 1 (2.4 s) at 2.4, 4.8, ..., client 2 (3.7 s) at 3.7, 7.4. K = 2, no server time.
    fed, train = federation({0: 1.0, 1: 2.4, 2: 3.7}, c=3, k=2)
    # step 1: 0@1 (from v0); 0@2 is client 0's second update: it waits for the next buffer; 1@2.4
    s1 = fed.step(train)
    assert arrivals(s1) == [(0, 1.0, 0), (1, 2.4, 0)] and s1.time == 2.4 and fed.version == 1
    # step 2 opens at 2.4 with the waiting 0 (from v0: staleness 1); 0@3 (from v0, started at 2) waits; 2@3.7 (v0)
    s2 = fed.step(train)
    assert arrivals(s2) == [(0, 2.4, 1), (2, 3.7, 1)] and s2.time == 3.7
    # step 3 opens at 3.7 with that waiting 0 (from v0: staleness 2); 1@4.8 (restarted at 2.4 from v1)
    s3 = fed.step(train)
    assert [(p, s) for p, _, s in arrivals(s3)] == [(0, 2), (1, 1)]
    assert [t for _, t, _ in arrivals(s3)] == pytest.approx([3.7, 4.8])
    assert [a.task.version for a in s3.arrivals] == [0, 1]
    # exactly `concurrency` clients are always in flight
    assert fed.in_flight() == 3


def test_each_task_starts_from_the_version_current_at_its_start():
    fed, train = federation({i: 1.0 + 0.37 * i for i in range(8)}, c=4, k=2)
    seen = []
    for _ in range(12):
        step = fed.step(train)
        for a in step.arrivals:
            assert a.staleness == fed.version - 1 - a.task.version >= 0
            seen.append(a.task.number)
        assert len({a.task.pid for a in step.arrivals}) == len(step.arrivals) == 2  # one update per client per buffer
        assert fed.in_flight() == 4
    assert len(seen) == len(set(seen))  # every task reaches the server once


def schedule(k=1):
    return SimpleNamespace(name="every_round", attackers_per_round=k, is_attack_round=lambda rnd: True)


def test_eager_attacker_on_a_fast_device_reports_more_often_than_honest_clients():
    duration = {0: 0.2, **{i: 2.0 + 0.1 * i for i in range(1, 10)}}  # client 0, the attacker, is 10x faster
    fed, train = federation(duration, c=4, k=3, attackers=[0], attack=SimpleNamespace(schedule=schedule()))
    steps = [fed.step(train) for _ in range(6)]
    counts = {}
    for step in steps:
        for a in step.arrivals:
            counts[a.task.pid] = counts.get(a.task.pid, 0) + 1
    assert counts[0] == 6  # in every buffer (once each: its extra updates wait for the next)
    assert max(v for p, v in counts.items() if p != 0) < 6


def test_fresh_only_attacker_drops_stale_updates_and_buffer_timed_completes_the_buffer():
    duration = {0: 0.5, **{i: 1.0 for i in range(1, 10)}}
    attack = SimpleNamespace(schedule=schedule())
    fed, train = federation(duration, c=4, k=3, attackers=[0], attack=attack, reporting="fresh_only")
    steps = [fed.step(train) for _ in range(5)]
    assert all(a.staleness == 0 for s in steps for a in s.arrivals if a.task.pid == 0)
    assert any(t.pid == 0 for s in steps for t in s.discarded)
    fed, train = federation(duration, c=4, k=3, attackers=[0], attack=attack, reporting="buffer_timed")
    steps = [fed.step(train) for _ in range(5)]
    timed = [s for s in steps if any(a.task.pid == 0 for a in s.arrivals)]
    assert timed and all(s.arrivals[-1].task.pid == 0 and s.arrivals[-1].staleness == 0 for s in timed)


# --- whole runs on the in-process grid --------------------------------------------------------------
ASYNC = ["federation.rounds=5", "federation.num_clients=12", "federation.clients_per_round=5", "federation.local_epochs=1",
         "evaluation.every=5"]


def scenario(policy: dict, *overrides, **sections):
    attack = () if "attack" in sections else ("attack.schedule=every_round",)
    return quick_scenario(*ASYNC, *attack, *overrides, base=QUICKSTART, systems={"round": policy, "jitter": 0.3},
                          **sections)


class ShuffledGrid:
    """A grid that answers each wave in a random order after random delays: other 'actor timings'."""

    def __init__(self, inner, seed: int) -> None:
        self.inner, self.rng = inner, random.Random(seed)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def send_and_receive(self, messages, *, timeout=None):
        replies = list(self.inner.send_and_receive(messages, timeout=timeout))
        time.sleep(self.rng.random() * 0.01)
        self.rng.shuffle(replies)
        return replies


@pytest.mark.parametrize("policy", [{"name": "fedbuff", "buffer_size": 3}, {"name": "fedasync", "alpha": 0.6}])
def test_identical_lines_whatever_the_reply_order_and_timing(tmp_path, policy):
    from fedsim.client.app import make_client_app
    from fedsim.flower.local_grid import LocalGrid

    sc = scenario(policy)
    lines = []
    for i in range(2):
        grid = ShuffledGrid(LocalGrid(make_client_app(sc, None), sc.federation.num_clients), seed=i)
        lines.append(without_times(run_local(sc, tmp_path / str(i), grid=grid).rounds))
    assert lines[0] == lines[1]
    first = lines[0]
    assert [r["round"] for r in first] == [1, 2, 3, 4, 5]
    k = policy.get("buffer_size", 1)
    for r in first:
        assert len(r["sampled"]) == k and set(map(int, r["staleness"])) == set(r["sampled"])
        assert all(r["staleness"][str(p)] == r["round"] - 1 - r["trained_from"][str(p)] for p in r["sampled"])
        assert r["sim_time"] >= r["sim_start"] and r["in_flight"] == 5
        assert all(r["sim_start"] - 1e-6 <= t <= r["sim_time"] + 1e-6 for t in r["arrived"].values())  # rounded
    assert [r["sim_start"] for r in first[1:]] == [r["sim_start"] + r["sim_seconds"] for r in first[:-1]]
    assert any(r["attackers"] for r in first)


def test_fedbuff_step_is_the_staleness_scaled_mean_and_fedasync_mixes(tmp_path):
    """The global model after each step, recomputed by hand from the updates the clients sent."""
    from fedsim.client.app import make_client_app
    from fedsim.flower.local_grid import LocalGrid
    from fedsim.runs.folder import RunFolder
    from fedsim.runtime import runtime_for
    from fedsim.server.app import drive_server
    from fedsim.server.strategy import ScenarioStrategy
    from fedsim.wire import decode_upload, unpack_model

    for policy in ({"name": "fedbuff", "buffer_size": 3, "staleness": {"name": "polynomial", "a": 1.0}},
                   {"name": "fedasync", "alpha": 0.5, "staleness": {"name": "hinge", "a": 2, "b": 0}}):
        sc = scenario(policy, "federation.rounds=4", attack=None, server={"lr": 0.7})
        sent = {}  # reply id -> (pid, start model, update)

        class Recording(LocalGrid):
            def send_and_receive(self, messages, *, timeout=None):
                replies = super().send_and_receive(messages, timeout=timeout)
                rt = runtime_for(sc)
                by_id = {m.metadata.message_id: m for m in messages}
                for r in replies:
                    if by_id[r.metadata.reply_to_message_id].metadata.message_type != "train":
                        continue  # the node discovery's queries
                    start = unpack_model(by_id[r.metadata.reply_to_message_id].content["arrays"], rt.layout_for(None))
                    update, _, _ = decode_upload(r.content, rt.codec, rt.layout_for(None))
                    sent[id(r)] = (start, update)
                return replies

        grid = Recording(make_client_app(sc, None), sc.federation.num_clients)
        models = []
        original = ScenarioStrategy.aggregate_train

        def spy(self, server_round, replies):
            before = self.driver.global_vec.clone()
            out = original(self, server_round, replies)
            step = self.exchange.step
            models.append((before, self.driver.global_vec.clone(),
                           [(sent[id(a.task.reply)], a.staleness) for a in step.arrivals]))
            return out

        ScenarioStrategy.aggregate_train = spy
        try:
            drive_server(grid, sc, RunFolder.create(sc, tmp_path))()
        finally:
            ScenarioStrategy.aggregate_train = original
        assert len(models) == 4
        for before, after, buffer in models:
            if policy["name"] == "fedbuff":
                mean = sum(update / (1.0 + s) for (start, update), s in buffer) / len(buffer)  # a = 1
                expected = before + 0.7 * mean
            else:
                ((start, update), s), = buffer
                alpha = 0.5 * (1.0 if s <= 0 else 1.0 / (2 * s + 1))
                expected = before + 0.7 * alpha * (start + update - before)
            torch.testing.assert_close(after, expected, rtol=1e-5, atol=1e-6)
        assert any(s > 0 for _, _, buffer in models for _, s in buffer)  # staleness did occur


# --- refusals -------------------------------------------------------------------------------------
@pytest.mark.parametrize("sections, needle", [
    ({"aggregator": {"name": "krum", "num_malicious": 1}}, "krum"),
    ({"aggregator": {"name": "detox", "group_size": 3}}, "groups"),
    ({"lowrank": {"name": "pufferfish"}}, "lowrank"),
])
def test_refused_with_the_reason(sections, needle):
    with pytest.raises(ScenarioError) as err:
        scenario({"name": "fedasync"}, **sections)
    assert needle in str(err.value)


def test_buffer_of_k_runs_rules_that_need_several_updates():
    sc = scenario({"name": "fedbuff", "buffer_size": 5}, aggregator={"name": "median"})
    assert sc.systems.round.buffer_size == 5
    with pytest.raises(ScenarioError, match="bulyan"):
        scenario({"name": "fedbuff", "buffer_size": 5}, aggregator={"name": "bulyan", "num_malicious": 1})


def test_resume_is_refused_where_it_cannot_be_exact(tmp_path):
    from fedsim.runs.folder import RunFolder
    from fedsim.runtime import runtime_for
    from fedsim.server.asynchronous import AsynchronousExchange
    from fedsim.server.driver import RoundDriver

    sc = scenario({"name": "fedbuff", "buffer_size": 2})
    folder = RunFolder.create(sc, tmp_path)
    driver = RoundDriver(runtime_for(sc), checkpoint_to=folder)
    driver.offset = 3
    with pytest.raises(RuntimeError, match="no asynchronous state"):
        AsynchronousExchange(driver, {}).open_round(4)
    exchange = AsynchronousExchange(driver, {})
    driver.resumed_protocol = exchange.state_dict()
    folder.client_states.mkdir(parents=True, exist_ok=True)
    (folder.client_states / "0-r3.npz").write_bytes(b"")  # a client that keeps memory between tasks
    with pytest.raises(RuntimeError, match="client memory cannot be resumed"):
        exchange.open_round(4)
    live = RoundDriver(runtime_for(sc), real_clock=True)
    live.offset = 3
    with pytest.raises(RuntimeError, match="real SuperLink cannot be resumed"):
        AsynchronousExchange(live, {}).open_round(4)


# --- every client-side attack under both protocols ---------------------------------------------------
load_components()
CLIENT_ATTACKS = sorted(e.name for e in ATTACKS.entries() if e.obj.side == "client")


ON_DIGITS = {  # what 8x8 digits and a small MLP need (each attack's own tests use the same)
    "dba": {"bar_cols": [[0, 1], [4, 5]], "num_pieces": 2},
    "iba": {"generator_width": 4, "generator_epochs": 1},
    "a3fl": {"trigger_epochs": 1, "adapt_epochs": 1},
}


@pytest.mark.parametrize("name", CLIENT_ATTACKS)
def test_every_client_side_attack_runs_under_fedbuff_and_fedasync(tmp_path, name):
    for policy in ({"name": "fedbuff", "buffer_size": 2}, {"name": "fedasync"}):
        sc = quick_scenario("federation.rounds=3", "federation.num_clients=8", "federation.clients_per_round=5",
                            "federation.local_epochs=1", "evaluation.every=3", base=QUICKSTART,
                            attack={"name": name, "attacker_ids": [0, 1], **ON_DIGITS.get(name, {}),
                                    "schedule": {"name": "every_round", "attackers_per_round": 2}},
                            systems={"round": policy})
        rounds = run_local(sc, tmp_path / policy["name"]).rounds
        assert [r["round"] for r in rounds] == [1, 2, 3]
        assert any(r["attackers"] for r in rounds), (name, policy)
        assert not any(r["rejected"] for r in rounds), [r["rejected"] for r in rounds]
        assert all(r["skipped"] is None for r in rounds)


SERVER_ATTACKS = sorted(e.name for e in ATTACKS.entries() if e.obj.side == "server")


@pytest.mark.parametrize("name", SERVER_ATTACKS)
def test_every_server_side_attack_crafts_from_recent_honest_updates(tmp_path, name):
    """Under FedAsync a buffer holds one update: the omniscient attack crafts from the recent honest ones."""
    for policy in ({"name": "fedbuff", "buffer_size": 3}, {"name": "fedasync"}):
        sc = quick_scenario("federation.rounds=4", "federation.num_clients=8", "federation.clients_per_round=5",
                            "federation.local_epochs=1", "evaluation.every=4", base=QUICKSTART,
                            attack={"name": name, "attacker_ids": [0, 1],
                                    "schedule": {"name": "every_round", "attackers_per_round": 2}},
                            systems={"round": policy})
        rounds = run_local(sc, tmp_path / policy["name"]).rounds
        struck = [r for r in rounds if r["attackers"]]
        assert struck and all(r["skipped"] is None for r in rounds)
        crafted = [r for r in struck if "failed" not in r.get("attack", {"failed": "no report"})]  # it crafted rows
        assert crafted, (name, policy)


# --- on the real clock (a deployment): pushed and pulled as replies come ------------------------------
class PushPullGrid:
    """An in-process grid with Flower's push_messages / pull_messages: each pushed message is
    answered at once by the real ClientApp, and each pull hands back a random part of the replies
    ready (the order and timing a network gives)."""

    def __init__(self, inner, seed: int = 0) -> None:
        self.inner, self.rng, self.ready = inner, random.Random(seed), {}

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def push_messages(self, messages):
        messages = list(messages)
        replies = self.inner.send_and_receive(messages)  # stamps the message ids
        for reply in replies:
            self.ready[reply.metadata.reply_to_message_id] = reply
        return [m.metadata.message_id for m in messages]

    def pull_messages(self, message_ids):
        wanted = [i for i in message_ids if i in self.ready]
        taken = self.rng.sample(wanted, k=self.rng.randint(0, len(wanted))) if wanted else []
        return [self.ready.pop(i) for i in taken]


def test_fedbuff_on_the_real_clock_pushes_and_pulls_as_replies_come(tmp_path):
    from fedsim.client.app import make_client_app
    from fedsim.deploy.run_config import deployable
    from fedsim.flower.local_grid import LocalGrid
    from fedsim.runs.folder import RunFolder
    from fedsim.runs.results import read_rounds
    from fedsim.server.app import run_server

    sc = quick_scenario(*ASYNC, "attack.schedule=every_round", base=QUICKSTART,
                        systems={"round": {"name": "fedbuff", "buffer_size": 3}})
    assert deployable(sc, "test") is sc  # only an asynchronous round in `systems:`: deployable
    with pytest.raises(ScenarioError, match="systems.jitter"):
        deployable(scenario({"name": "fedbuff"}), "test")
    grid = PushPullGrid(LocalGrid(make_client_app(sc, None), sc.federation.num_clients, cohorts=False))
    folder = RunFolder.create(sc, tmp_path)
    summary = run_server(grid, sc, folder.path, real_clock=True)
    rounds = [r for r in read_rounds(folder) if r["round"] > 0]
    assert summary["rounds_completed"] == 5 and len(rounds) == 5
    for r in rounds:
        assert len(r["sampled"]) == 3 and not r["rejected"] and r["skipped"] is None
        assert all(r["staleness"][str(p)] == r["round"] - 1 - r["trained_from"][str(p)] for p in r["sampled"])
        # the slots the closing arrivals freed take the new model when the next step opens
        assert 0 < r["in_flight"] <= 5 and "sim_time" not in r and "client_seconds" not in r
    assert any(r["attackers"] for r in rounds)
