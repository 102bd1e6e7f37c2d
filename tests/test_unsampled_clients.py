"""Registered clients that are not sampled cost (almost) nothing (issue #34 item 7).

Flower's engine registers every simulated node with the link state and makes each a run-info
store before the first round; fedsim registers a node the first time the server reads its
partition's node (fedsim/engine/simulate.py `SimulatedNodes`). Checked by counting, not timing:
nodes in the link state and stores made equal the partitions read (a million registered, a few
sampled); a node registered late is the node Flower would have registered, and messages to it
are stored and delivered. benchmarks/scale.py measures the time and memory.
"""

from __future__ import annotations

import json

import pytest
from flwr.app import Message, RecordDict
from flwr.server.superlink.fleet.vce import vce_api
from link_state import empty_link_state

from fedsim.engine.simulate import NodeInfoStores, SimulatedNodes
from fedsim.flower import compat as flower_compat
from fedsim.server.nodes import NodeDirectory

MILLION = 1_000_000


def _empty_link_state():
    return empty_link_state(run_id=4343, task_id=78)


def test_a_node_is_registered_when_its_partition_is_first_read():
    state, factory, grid, _ = _empty_link_state()
    nodes = SimulatedNodes(state, MILLION)
    by_partition = nodes.by_partition
    assert len(state.nodes) == 0 and len(nodes) == 0 and len(by_partition) == MILLION
    ids = [by_partition[p] for p in (7, 999_999, 7, 0)]
    assert ids[0] == ids[2] and len(set(ids)) == 3
    assert len(state.nodes) == 3 and len(nodes) == 3  # three partitions read, three nodes, nothing else
    assert [nodes[i] for i in ids] == [7, 999_999, 7, 0] and sorted(nodes) == sorted(set(ids))
    assert by_partition.pid_of(ids[1]) == 999_999 and by_partition.pid_of(12345) == -1
    assert 999_999 in by_partition and MILLION not in by_partition and ids[1] in nodes
    with pytest.raises(KeyError):
        by_partition[MILLION]
    # the late node is what Flower's _register_nodes registers: online, never timing out, Flower's owner
    flowers = next(iter(vce_api._register_nodes(num_nodes=1, state_factory=factory)))
    for field in ("status", "heartbeat_interval", "online_until", "owner_aid", "owner_name"):
        assert getattr(state.nodes[ids[1]], field) == getattr(state.nodes[flowers], field), field
    assert state.get_nodes(4343) == {*ids, flowers}


def test_messages_to_late_nodes_are_stored_and_delivered():
    """The grid validates a message's destination against the link state's nodes; the delivery
    loop takes messages for the engine's mapping. Both see a node registered when first read."""
    state, _, grid, _ = _empty_link_state()
    nodes = SimulatedNodes(state, MILLION)
    sent = grid.push_messages([Message(RecordDict(), dst_node_id=nodes.by_partition[p], message_type="query")
                               for p in (3, 500_000)])
    assert len(sent) == 2  # accepted: an unknown destination is refused (logged) and gets no id
    delivered = flower_compat.undelivered_messages(state, nodes)
    assert sorted(nodes[m.metadata.dst_node_id] for m in delivered) == [3, 500_000]
    assert not grid.push_messages([Message(RecordDict(), dst_node_id=987654321, message_type="query")])


def test_run_info_stores_are_made_for_messaged_nodes_only():
    """A node's store (its node config and Context) is made when the engine's worker first looks
    the node up, with what Flower's _register_node_info_stores gives it."""
    state, _, _, run = _empty_link_state()
    nodes = SimulatedNodes(state, MILLION)
    stores = NodeInfoStores(nodes, run, None)
    node = nodes.by_partition[123_456]
    assert len(stores) == 0
    context = stores[node].retrieve_context(run_id=run.run_id)
    flowers = vce_api._register_node_info_stores({node: 123_456}, run=run, app_dir=None)[node]
    assert context.node_config == {"partition-id": 123_456, "num-partitions": MILLION}
    assert flowers.retrieve_context(run_id=run.run_id).node_config == {"partition-id": 123_456, "num-partitions": 1}
    assert stores[node] is stores[node] and len(stores) == 1


def test_a_round_over_a_million_registered_clients_registers_its_sampled_ones():
    """The server's side: a round's messages for 10 of 1,000,000 clients register 10 nodes, each
    reply is matched to its client without a reverse map of the million."""
    from fedsim.runtime import runtime_for
    from fedsim.scenario import load_scenario
    from fedsim.server.strategy import ScenarioStrategy

    from flwr.app import ArrayRecord, ConfigRecord

    scenario = load_scenario("scenarios/quickstart.yaml", [
        "attack=null", f"federation.num_clients={MILLION}", "federation.clients_per_round=10",
        "data.partition.min_partition_size=0"])
    state, _, _, _ = _empty_link_state()
    nodes = SimulatedNodes(state, MILLION)
    strategy = ScenarioStrategy(runtime_for(scenario))
    strategy.node_of.use(nodes.by_partition)
    messages = list(strategy.configure_train(1, ArrayRecord(), ConfigRecord(), grid=None))
    sampled = strategy.driver.pending.sampled
    assert len(messages) == 10 and len(state.nodes) == 10
    assert sorted(nodes[m.metadata.dst_node_id] for m in messages) == sampled
    assert sorted(strategy.node_of.pid_of(m.metadata.dst_node_id) for m in messages) == sampled
    parts = strategy.driver.rt.partitions
    assert len(parts) == MILLION and parts.sizes.sum() == len(strategy.driver.rt.data.y_train)


def test_node_directory_looks_back_through_the_map_it_was_given():
    directory = NodeDirectory()
    directory.update({0: 100, 1: 101})
    assert directory[1] == 101 and len(directory) == 2 and directory.pid_of(100) == 0 and directory.pid_of(5) == -1
    state, _, _, _ = _empty_link_state()
    nodes = SimulatedNodes(state, MILLION)
    directory.use(nodes.by_partition)
    node = directory[42]
    assert directory.pid_of(node) == 42 and len(directory) == MILLION and len(state.nodes) == 1


@pytest.mark.slow
@pytest.mark.simulation
def test_a_simulation_registers_only_the_clients_it_samples(tmp_path, monkeypatch):
    """End to end on Ray: 100,000 registered clients, 5 a round for 3 rounds; the link state gets
    exactly one node per distinct sampled client (Flower's engine would have registered 100,000)."""
    from fedsim.engine.simulate import simulate
    from fedsim.runs.results import read_rounds
    from fedsim.scenario import load_scenario

    registered = []
    register = flower_compat.register_node
    monkeypatch.setattr(flower_compat, "register_node", lambda state: registered.append(register(state)) or registered[-1])
    scenario = load_scenario("scenarios/quickstart.yaml", [
        "attack=null", "federation.num_clients=100000", "federation.clients_per_round=5", "federation.rounds=3",
        "data.partition.min_partition_size=0"])
    run_dir = simulate(scenario, run_dir=tmp_path / "run")
    rounds = [r for r in read_rounds(run_dir) if r["round"] > 0]
    sampled = {p for r in rounds for p in r["sampled"]}
    assert len(rounds) == 3 and len(registered) == len(set(registered)) == len(sampled)
    for r in rounds:  # every sampled client answered (an empty one with weight 0); none was lost
        assert not r["rejected"] and (r["skipped"] is not None or sorted(r["aggregated"]) == r["sampled"])
    assert json.loads((run_dir / "summary.json").read_text())["run_dir"] == str(run_dir)  # the run completed
