"""A Flower Grid whose wait for replies ends as soon as the run's stop event is set
(fedsim/engine/interrupt.py turns Ctrl-C and SIGTERM into that event)."""

from __future__ import annotations

import threading
import time
from typing import Iterable

from flwr.app import Message
from flwr.serverapp import Grid


class RunStopped(Exception):
    """Raised in the ServerApp thread when the run's stop event is set while it waits for replies."""


class StoppableGrid(Grid):
    """A Flower Grid that stops waiting for replies when `stop` is set.

    Everything is delegated to `inner` through the public Grid API; only `send_and_receive` is
    fedsim's own: push, then pull every `pull_interval` seconds until every reply is in, the
    timeout passes (the replies so far are returned, as Flower's grids do), or `stop` is set.
    """

    def __init__(self, inner: Grid, stop: threading.Event, pull_interval: float = 0.01) -> None:
        self.inner, self.stop, self.pull_interval = inner, stop, pull_interval

    def set_run(self, run) -> None:
        self.inner.set_run(run)

    @property
    def run(self):
        return self.inner.run

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None) -> Message:
        return self.inner.create_message(content, message_type, dst_node_id, group_id, ttl)

    def get_node_ids(self) -> Iterable[int]:
        return self.inner.get_node_ids()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self.inner.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self.inner.pull_messages(message_ids)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        if self.stop.is_set():
            raise RunStopped("the run was stopped before the messages were sent")
        waiting = set(self.inner.push_messages(messages))
        deadline = None if timeout is None else time.monotonic() + timeout
        replies: list[Message] = []
        while waiting:
            got = list(self.inner.pull_messages(waiting))
            replies += got
            waiting -= {m.metadata.reply_to_message_id for m in got}
            if not waiting or (deadline is not None and time.monotonic() >= deadline):
                break
            if self.stop.wait(self.pull_interval):
                raise RunStopped(f"the run was stopped with {len(waiting)} replies outstanding")
        return replies
