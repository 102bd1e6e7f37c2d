"""The pieces that make fedsim's simulation cheap per message and at scale, each against what it replaces.

* `deliver_messages` must hand Flower's workers exactly the messages Flower's own
  `add_messages_to_queue` hands them (same link state, same registered nodes, expired and foreign
  messages left alone), only with one scan per sweep instead of one per registered node.
* `CompactClientApp` must pickle small and rebuild the very same scenario in the worker.
* Outside `simulate`, the server gets no node map and falls back to asking every node.
"""

from __future__ import annotations

import os
import pickle
import queue
import subprocess
import sys
import threading
import time

import pytest
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.server.superlink.fleet.vce import vce_api
from link_state import empty_link_state

from fedsim.engine.ray_actor import CompactClientApp, _client_app
from fedsim.runtime import scenario_key
from fedsim.scenario import load_scenario
from fedsim.engine.simulate import deliver_messages, prompt_stop_queue, registered_partitions


def _deliver_messages(state, queue, mapping, stop):
    return deliver_messages(state, queue, mapping, stop, 0.02)


def _link_state(num_nodes: int):
    """A link state and grid set up the way run_simulation sets them up, with `num_nodes` registered nodes."""
    state, factory, grid, _ = empty_link_state(run_id=4242, task_id=77)
    mapping = vce_api._register_nodes(num_nodes=num_nodes, state_factory=factory)
    return state, grid, mapping


def _deliver_with(fn, num_nodes=30, targets=(0, 3, 3, 17, 29), expired=(5,)):
    """Push messages to the nodes of the given partitions (one with a 1 s TTL, left to expire), run
    `fn` as the engine's delivery thread for a few sweeps; returns what it queued and what stayed behind."""
    state, grid, mapping = _link_state(num_nodes)
    node_of = {pid: node for node, pid in mapping.items()}
    sent = {}
    for pid in targets:
        msg = Message(RecordDict(), dst_node_id=node_of[pid], message_type="query")
        sent[grid.push_messages([msg])[0]] = pid
    for pid in expired:
        msg = Message(RecordDict(), dst_node_id=node_of[pid], message_type="query", ttl=1.0)
        sent[grid.push_messages([msg])[0]] = ("expired", pid)
    time.sleep(1.2)  # the short-lived message is now past its TTL
    out, stop = queue.Queue(), threading.Event()
    thread = threading.Thread(target=fn, args=(state, out, mapping, stop))
    thread.start()
    time.sleep(0.5)
    stop.set()
    thread.join()
    delivered = []
    while not out.empty():
        msg = out.get()
        delivered.append(sent[msg.metadata.message_id])
        assert msg.metadata.delivered_at != ""
    undelivered = sorted(
        sent[mid] for mid, m in state.message_ins_store.items() if m.metadata.delivered_at == ""
    )
    return sorted(delivered, key=str), undelivered


def test_fast_delivery_queues_what_flower_queues():
    """Same messages delivered (both for the node holding two), the expired one dropped by both."""
    flower = _deliver_with(vce_api.add_messages_to_queue)
    fast = _deliver_with(_deliver_messages)
    assert flower == fast
    assert fast[0] == sorted([0, 3, 3, 17, 29], key=str) and fast[1] == []


def test_fast_delivery_is_one_scan_per_sweep_not_one_per_node():
    """With 5,000 registered nodes and 50 stored messages, Flower's loop calls get_message_ins once
    per node per sweep (each call scanning all messages); the replacement scans the store once."""
    state, grid, mapping = _link_state(5000)
    calls = {"get_message_ins": 0}
    original = state.get_message_ins

    def counting(*args, **kwargs):
        calls["get_message_ins"] += 1
        return original(*args, **kwargs)

    state.get_message_ins = counting
    node_of = {pid: node for node, pid in mapping.items()}
    grid.push_messages([Message(RecordDict(), dst_node_id=node_of[p], message_type="query") for p in range(0, 5000, 100)])
    out, stop = queue.Queue(), threading.Event()
    stop_soon = threading.Timer(0.05, stop.set)
    stop_soon.start()
    _deliver_messages(state, out, mapping, stop)
    assert out.qsize() == 50 and calls["get_message_ins"] == 0
    stop.clear()
    threading.Timer(0.05, stop.set).start()
    vce_api.add_messages_to_queue(state, queue.Queue(), mapping, stop)
    assert calls["get_message_ins"] >= 5000  # Flower's loop: every registered node, every sweep


def test_compact_client_app_pickles_small_and_rebuilds_the_same_scenario():
    """The app crosses to the actors as the scenario's JSON (KBs, not the 200 KB pickled pydantic
    class), and the worker rebuilds the identical scenario (same key) once, then reuses it."""
    scenario = load_scenario("scenarios/quickstart.yaml", ["federation.rounds=3"])
    app = CompactClientApp.of(scenario, "/tmp/run/checkpoint/clients")
    blob = pickle.dumps(app)
    assert len(blob) < 10_000
    clone = pickle.loads(blob)
    assert clone.key == scenario_key(scenario) and clone.state_dir == "/tmp/run/checkpoint/clients"
    built = _client_app(clone.scenario_json, clone.key, clone.state_dir)
    assert _client_app(clone.scenario_json, clone.key, clone.state_dir) is built
    with pytest.raises(RuntimeError, match="does not validate"):
        _client_app(clone.scenario_json, "not-the-key", None)


def test_no_node_map_outside_a_simulation():
    """A grid that is not driven by `simulate` (deployment, the in-process test grid) gets None, so
    fedsim/server/nodes.py asks every node for its partition."""
    _, grid, _ = _link_state(3)
    assert registered_partitions(grid, timeout=1.0) is None
    assert registered_partitions(object(), timeout=1.0) is None


def test_messages_go_out_largest_client_first():
    """Longest-processing-time-first: the round's messages are created (and so delivered to the
    actors) in decreasing partition size, ties by id; the recorded sample stays sorted by id."""
    from flwr.app import ArrayRecord, ConfigRecord

    from fedsim.runtime import runtime_for
    from fedsim.server.strategy import ScenarioStrategy

    scenario = load_scenario("scenarios/quickstart.yaml", ["attack=null"])
    strategy = ScenarioStrategy(runtime_for(scenario))
    strategy.node_of.update({p: 1000 + p for p in range(scenario.federation.num_clients)})
    messages = list(strategy.configure_train(1, ArrayRecord(), ConfigRecord(), grid=None))
    order = [m.metadata.dst_node_id - 1000 for m in messages]
    sizes = [len(strategy.driver.rt.partitions[p]) for p in order]
    assert sorted(order) == strategy.driver.pending.sampled and len(set(sizes)) > 1
    assert [(-s, p) for s, p in zip(sizes, order)] == sorted((-s, p) for s, p in zip(sizes, order))


def test_client_actor_keeps_flowers_actor_contract():
    """fedsim's actor class does what Flower's ClientAppActor.run does: (cid, reply, context) back,
    a failing app as ClientAppException (the engine reports it and the round goes on), a ClientApp
    that cannot be loaded as LoadClientAppError (the engine stops the simulation)."""
    from flwr.app import Context
    from flwr.clientapp.client_app import ClientAppException, LoadClientAppError

    from fedsim.engine.ray_actor import ClientAppRunner

    context = Context(run_id=1, node_id=2, node_config={}, state=RecordDict(), run_config={})
    message = Message(RecordDict(), dst_node_id=2, message_type="query")

    def app(message, context):
        context.state["seen"] = ConfigRecord({"yes": 1})
        return "reply"

    assert ClientAppRunner().run(lambda: app, message, "7", context) == ("7", "reply", context)
    assert context.state["seen"]["yes"] == 1

    def broken(message, context):
        raise ValueError("client blew up")

    with pytest.raises(ClientAppException, match="client blew up"):
        ClientAppRunner().run(lambda: broken, message, "7", context)

    def unloadable():
        raise LoadClientAppError("no such app")

    with pytest.raises(LoadClientAppError):
        ClientAppRunner().run(unloadable, message, "7", context)


def test_actor_module_is_cheap_to_import():
    """What a client actor imports for its class and its ClientApp leaves flwr.simulation (the
    link state, SQLAlchemy, FastAPI), fedsim's server side and torch (imported with the first message) out."""
    code = ("import sys, fedsim.engine.ray_actor\n"
            "print(sorted(m for m in ('flwr.simulation', 'sqlalchemy', 'fastapi', 'fedsim.server.app', 'torch')"
            " if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_simulate_swaps_the_actor_class_and_restores_it():
    from flwr.server.superlink.fleet.vce.backend import raybackend

    from fedsim.flower.options import EngineOptions
    from fedsim.engine.ray_actor import client_actor_class
    from fedsim.engine.simulate import engine_adjustments

    original = raybackend.ClientAppActor
    with engine_adjustments():
        assert raybackend.ClientAppActor is client_actor_class()
    assert raybackend.ClientAppActor is original
    with engine_adjustments(EngineOptions(light_actor=False)):  # the benchmark's lever off: Flower's own
        assert raybackend.ClientAppActor is original


def test_simulate_swaps_the_engine_queue_and_restores_it():
    """The engine's threads poll their queues with a 1 s timeout before checking the stop event;
    during `simulate` the wait is capped so the engine stops as soon as the ServerApp is done."""
    from fedsim.flower.options import EngineOptions
    from fedsim.engine.simulate import engine_adjustments

    original = vce_api.Queue
    with engine_adjustments():
        assert vce_api.Queue is not original and vce_api.Queue.__name__ == "PromptStopQueue"
    assert vce_api.Queue is original

    QUEUE_WAIT_SECONDS = EngineOptions().queue_wait_seconds
    q = prompt_stop_queue(QUEUE_WAIT_SECONDS)()
    start = time.monotonic()
    with pytest.raises(queue.Empty):
        q.get(timeout=30.0)
    assert time.monotonic() - start < 10 * QUEUE_WAIT_SECONDS + 1.0  # far below the 30 s asked for
    q.put("message")
    assert q.get(timeout=1.0) == "message" and q.empty()


def test_local_ray_starts_without_a_job_runtime_env(monkeypatch):
    """A job runtime environment stops Ray from handing its prestarted workers to the actors; a
    local Ray gets PYTHONPATH through the environment its workers inherit instead. An existing
    cluster (an address) still goes through Flower's start."""
    import ray

    from fedsim.engine.allocator import tunables
    from fedsim.engine.simulate import start_local_ray

    calls, flower = [], []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    tunables_at_start = []

    def fake_init(**kw):
        calls.append(kw)
        tunables_at_start.append(os.environ.get("GLIBC_TUNABLES"))

    monkeypatch.setattr(ray, "init", fake_init)
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    started = []
    init_ray = start_local_ray(lambda backend, config: flower.append(config), lambda: started.append(1), True)

    init_ray(None, {"init_args": {"num_cpus": 2, "logging_level": "ERROR"}})
    assert calls == [{"num_cpus": 2, "logging_level": "ERROR", "include_dashboard": False}] and not flower
    paths = os.environ["PYTHONPATH"].split(os.pathsep)
    assert paths[-1] == "/elsewhere" and all(p in paths for p in sys.path)
    # the raylet, and through it every worker, inherits fedsim's malloc settings; this process's env is restored
    assert tunables_at_start == [tunables()] and "GLIBC_TUNABLES" not in os.environ

    cluster = {"init_args": {"address": "127.0.0.1:6379"}}
    init_ray(None, cluster)
    assert flower == [cluster] and len(calls) == 1
    assert started == [1, 1]  # after either start (fedsim puts its SIGTERM handler back there)


def test_simulate_swaps_ray_start_and_restores_it():
    from flwr.server.superlink.fleet.vce.backend import raybackend

    from fedsim.engine.simulate import engine_adjustments

    original = raybackend.RayBackend.init_ray
    with engine_adjustments():
        assert raybackend.RayBackend.init_ray is not original
    assert raybackend.RayBackend.init_ray is original
