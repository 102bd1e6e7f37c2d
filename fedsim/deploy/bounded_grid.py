"""A deployed ServerApp's grid that stops pulling a reply once it outgrows the server's bound.

fedsim refuses an upload whose payload exceeds `max_payload_bytes` (fedsim/wire.py) when it
decodes it, in simulation and deployment alike. On Flower's deployment engine that check comes
late: flwr 1.41's `HttpGrid.pull_messages` pulls every object of a reply (its message, records,
arrays and their chunks) into the ServerApp's memory before the strategy sees it, whatever its
size, so a SuperNode that replies with gigabytes would have them all loaded first.

`BoundedReplies` pulls replies the way `HttpGrid.pull_messages` does (the same Runtime API calls,
through the grid's own client) but counts each reply's bytes as its objects arrive, and gives up a
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

# A reply carries an upload and possibly an attacker's backdoor report, each bounded by
# max_payload_bytes, plus records of metrics and configuration (a few KiB; a SecAgg+ share stage
# carries about 200 bytes per neighbour): 1 MiB more covers them.
REPLY_SLACK = 1 << 20
POLL_SECONDS = 3.0  # as flwr 1.41's HttpGrid.send_and_receive (hard-coded there)


def reply_limit(layout) -> int:
    """The most bytes a deployed ServerApp pulls for one reply to a model of `layout`."""
    from fedsim.wire import max_payload_bytes

    return 2 * max_payload_bytes(layout) + REPLY_SLACK


class ReplyTooLarge(Exception):
    pass


def bounded(grid: Grid, limit: int) -> Grid:
    """`grid` with its replies bounded (BoundedReplies) when it is Flower's HTTP grid, else itself."""
    try:
        from flwr.superlink.grid.http_grid import HttpGrid
    except ImportError:  # another flwr: its grid as it is
        return grid
    return BoundedReplies(grid, limit) if isinstance(grid, HttpGrid) else grid


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
        """`HttpGrid.pull_messages` (flwr 1.41), each reply's objects counted as they arrive."""
        from flwr.proto.message_pb2 import ConfirmMessageReceivedRequest  # pylint: disable=no-name-in-module
        from flwr.proto.runtime_pb2 import PullAppMessagesRequest  # pylint: disable=no-name-in-module
        from flwr.supercore.inflatable.inflatable_protobuf_utils import make_pull_object_fn_protobuf
        from flwr.supercore.inflatable.inflatable_utils import (ObjectPullError, inflate_object_from_contents,
                                                                iterate_object_tree, pull_objects)

        grid = self.grid
        client, run_id = grid._runtime_client, grid._run.run_id  # noqa: SLF001 - Flower's HTTP grid, see bounded()
        res = client.PullMessages(PullAppMessagesRequest(message_ids=message_ids))
        out: list[Message] = []
        for msg_proto, tree in zip(res.messages_list, res.message_object_trees, strict=True):
            msg_id = msg_proto.metadata.message_id
            pull_one = make_pull_object_fn_protobuf(pull_object_protobuf=client.PullObject, node=grid.node, run_id=run_id)
            pulled = [0]

            def counted(object_id: str, pull_one=pull_one, pulled=pulled) -> bytes:
                content = pull_one(object_id)
                pulled[0] += len(content)
                if pulled[0] > self.limit:
                    raise ReplyTooLarge(object_id)
                return content

            try:
                contents = pull_objects([t.object_id for t in iterate_object_tree(tree)], pull_object_fn=counted)
            except ReplyTooLarge:
                out.append(self._refused(msg_proto, f"the reply of node {msg_proto.metadata.src_node_id} exceeds "
                                                    f"{self.limit} bytes, the most this server pulls for one reply "
                                                    f"(pulled {pulled[0]} bytes, then stopped)", run_id))
                continue
            except ObjectPullError as err:  # as HttpGrid: an object gone or never uploaded
                out.append(self._refused(msg_proto, f"Reply message objects are unavailable. {err}", run_id))
                continue
            client.ConfirmMessageReceived(ConfirmMessageReceivedRequest(node=grid.node, run_id=run_id,
                                                                        message_object_id=msg_id))
            message = inflate_object_from_contents(msg_id, contents)
            message.metadata.__dict__["_message_id"] = msg_id
            out.append(message)
        return out

    def _refused(self, msg_proto, reason: str, run_id: int) -> Message:
        """An error reply in place of a reply that was not pulled, matched to the message it answers."""
        from flwr.app import Error, Metadata
        from flwr.app.message import make_message
        from flwr.common.constant import ErrorCode
        from flwr.supercore.constant import SYSTEM_MESSAGE_TYPE
        from flwr.supercore.date import now

        node = self.grid.node.node_id
        return make_message(
            metadata=Metadata(run_id=run_id, message_id="", src_node_id=node, dst_node_id=node,
                              message_type=SYSTEM_MESSAGE_TYPE, group_id="", ttl=0,
                              reply_to_message_id=msg_proto.metadata.reply_to_message_id, created_at=now().timestamp()),
            error=Error(code=ErrorCode.MESSAGE_UNAVAILABLE, reason=reason))

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
