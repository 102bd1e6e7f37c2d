"""A deployed ServerApp's grid that stops pulling a reply once it outgrows the server's bound.

fedsim refuses an upload whose payload exceeds `max_payload_bytes` (fedsim/wire.py) when it
decodes it, in simulation and deployment alike. On Flower's deployment engine that check comes
late: flwr 1.41's `HttpGrid.pull_messages` pulls every object of a reply (its message, records,
arrays and their chunks) into the ServerApp's memory before the strategy sees it, whatever its
size, so a SuperNode that replies with gigabytes would have them all loaded first.

`BoundedReplies` pulls replies the way `HttpGrid.pull_messages` does (the same Runtime API calls,
through the grid's own client; Flower's internals in fedsim/flower/compat.py: pull_replies_bounded) but counts each reply's bytes as its objects arrive, and gives up a
reply once they pass `limit`: the reply becomes an error reply ("reply of node ... exceeds ...")
matched to the message it answers, which fedsim files as that client's rejection, and the objects
pulled so far are dropped. A reply's objects are pulled a few at a time (Flower's
`FLWR_PRIVATE_MAX_CONCURRENT_OBJ_PULLS`), so the ServerApp holds at most `limit` plus that many
objects of one reply. One object is pulled whole: its size is the sender's chunk size (flwr's
`FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE`, 5 MiB by default, but a hostile node chooses its own), and the
SuperLink itself accepts a request body of any size; bound those at the SuperLink's ingress (a
reverse proxy's request-body limit in front of its port, see docs/deployment.md, "Faults").

A grid that is not Flower's HTTP grid (an in-process grid, the simulation's) is used as it is.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from flwr.app import Message
from flwr.serverapp import Grid

from fedsim.flower import compat as flower_compat

# A reply carries an upload and possibly an attacker's backdoor report, each bounded by
# max_payload_bytes, plus records of metrics and configuration (a few KiB; a SecAgg+ share stage
# carries about 200 bytes per neighbour): 1 MiB more covers them.
REPLY_SLACK = 1 << 20
POLL_SECONDS = 3.0  # as flwr 1.41's HttpGrid.send_and_receive (hard-coded there)


def reply_limit(layout) -> int:
    """The most bytes a deployed ServerApp pulls for one reply to a model of `layout`."""
    from fedsim.wire import max_payload_bytes

    return 2 * max_payload_bytes(layout) + REPLY_SLACK


def bounded(grid: Grid, limit: int) -> Grid:
    """`grid` with its replies bounded (BoundedReplies) when it is Flower's HTTP grid, else itself
    (fedsim/flower/compat.py: probe `bounded-pull`; without it, Flower's own pull)."""
    return BoundedReplies(grid, limit) if flower_compat.is_http_grid(grid) else grid


class BoundedReplies(Grid):
    """Flower's HTTP grid, each reply pulled only up to `limit` bytes (see the module's docstring)."""

    def __init__(self, grid: Grid, limit: int) -> None:
        self.grid, self.limit = grid, int(limit)
        super().__init__()

    # --- the grid's own calls -------------------------------------------------------------------
    def set_run(self, run) -> None:
        self.grid.set_run(run)

    @property
    def run(self):
        return self.grid.run

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):
        return self.grid.create_message(content, message_type, dst_node_id, group_id, ttl)

    def get_node_ids(self) -> Iterable[int]:
        return self.grid.get_node_ids()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self.grid.push_messages(messages)

    def close(self) -> None:
        close = getattr(self.grid, "close", None)
        if close is not None:
            close()

    # --- pulling, bounded -----------------------------------------------------------------------
    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        def too_large(node: int, pulled: int) -> str:
            return (f"the reply of node {node} exceeds {self.limit} bytes, the most this server pulls for one reply "
                    f"(pulled {pulled} bytes, then stopped)")

        return flower_compat.pull_replies_bounded(self.grid, message_ids, self.limit, too_large)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        """`HttpGrid.send_and_receive` (flwr 1.41) over the bounded pull: push, then pull every 3 s."""
        pending = set(self.push_messages(messages))
        pending.discard(None)
        end = time.time() + (timeout if timeout is not None else 0.0)
        out: list[Message] = []
        while timeout is None or time.time() < end:
            got = list(self.pull_messages(pending))
            out.extend(got)
            pending.difference_update(m.metadata.reply_to_message_id for m in got)
            if not pending:
                break
            time.sleep(POLL_SECONDS)
        return out
