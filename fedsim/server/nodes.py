"""Which node holds which partition: node ids are random per run, partition ids are what the scenario names."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Callable

from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid


class NodeDirectory(Mapping):
    """{partition id: node id}, the map the round protocols address their messages with, and back
    (`pid_of`). Made empty with the strategy, filled when the nodes are known (`use`, `update`).

    In fedsim's simulation it is the engine's map over every partition, which registers a node
    the first time its partition is read (fedsim/engine/simulate.py `PartitionNodes`): so nothing
    here iterates it; a reverse lookup asks the map itself when it can answer (`pid_of`)."""

    def __init__(self) -> None:
        self._nodes: Mapping[int, int] = {}
        self._back: dict[int, int] | None = None

    def use(self, nodes: Mapping[int, int]) -> None:
        self._nodes, self._back = nodes, None

    def update(self, nodes: Mapping[int, int]) -> None:
        self._nodes, self._back = {**self._nodes, **nodes}, None

    def __getitem__(self, partition_id: int) -> int:
        return self._nodes[partition_id]

    def __contains__(self, partition_id) -> bool:
        return partition_id in self._nodes

    def __iter__(self):
        return iter(self._nodes)

    def __len__(self) -> int:
        return len(self._nodes)

    def pid_of(self, node_id: int, default: int = -1) -> int:
        """The partition of node `node_id` (`default` for a node that holds none)."""
        find = getattr(self._nodes, "pid_of", None)
        if find is not None:
            return find(node_id, default)
        if self._back is None:
            self._back = {node: pid for pid, node in self._nodes.items()}
        return self._back.get(node_id, default)


def discover_nodes(grid: Grid, expected: int, timeout: float, node_map: Callable | None = None) -> Mapping[int, int]:
    """{partition id: node id} for partitions 0..expected-1.

    Each node is asked for its partition id (a QUERY message), as a deployment must. Inside
    fedsim's own simulation the engine's map is known where Flower registers the nodes
    (fedsim/engine/simulate.py, handed in as `node_map(grid, timeout)`), which saves one message
    per registered client at start-up; it may be a map that registers each node when it is first
    read (its length is the partition count, its keys 0..expected-1 by construction).
    """
    known = node_map(getattr(grid, "inner", grid), timeout) if node_map is not None else None  # StoppableGrid wraps
    if known is not None:
        if len(known) != expected or (isinstance(known, dict) and sorted(known) != list(range(expected))):
            raise RuntimeError(f"the simulation registered {len(known)} partitions "
                               f"{sorted(known)[:10] if isinstance(known, dict) else ''}, expected 0..{expected - 1}")
        return known
    deadline = time.monotonic() + timeout
    nodes = list(grid.get_node_ids())
    while len(nodes) < expected:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {len(nodes)} of {expected} client nodes connected within {timeout:.0f}s")
        time.sleep(0.2)
        nodes = list(grid.get_node_ids())
    queries = [Message(RecordDict({"config": ConfigRecord({})}), dst_node_id=n, message_type=MessageType.QUERY)
               for n in nodes]
    node_of: dict[int, int] = {}
    for reply in grid.send_and_receive(queries, timeout=timeout):
        if reply.has_error():
            raise RuntimeError(f"node {reply.metadata.src_node_id} failed to report its partition: {reply.error.reason}")
        pid = int(reply.content["info"]["partition-id"])
        if pid in node_of:
            raise RuntimeError(f"two nodes report partition-id {pid}")
        node_of[pid] = reply.metadata.src_node_id
    missing = sorted(set(range(expected)) - set(node_of))
    if missing:
        raise RuntimeError(f"no node holds partitions {missing[:10]}{'...' if len(missing) > 10 else ''}")
    return node_of
