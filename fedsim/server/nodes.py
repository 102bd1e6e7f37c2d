"""Which node holds which partition: node ids are random per run, partition ids are what the scenario names."""

from __future__ import annotations

import time
from typing import Callable

from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid


def discover_nodes(grid: Grid, expected: int, timeout: float, node_map: Callable | None = None) -> dict[int, int]:
    """{partition id: node id} for partitions 0..expected-1.

    Each node is asked for its partition id (a QUERY message), as a deployment must. Inside
    fedsim's own simulation the engine's map is known where Flower registers the nodes
    (fedsim/engine/simulate.py, handed in as `node_map(grid, timeout)`), which saves one message
    per registered client at start-up.
    """
    known = node_map(getattr(grid, "inner", grid), timeout) if node_map is not None else None  # StoppableGrid wraps
    if known is not None:
        if sorted(known) != list(range(expected)):
            raise RuntimeError(f"the simulation registered partitions {sorted(known)[:10]}..., expected 0..{expected - 1}")
        return dict(known)
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
