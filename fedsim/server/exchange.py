"""A round protocol's server side, and the plain protocol's.

Every protocol registered in fedsim.registry.PROTOCOLS names an exchange class with one calling
convention, which the strategy (fedsim/server/strategy.py) calls once per round:

    exchange = Exchange(driver, node_of)        # the round driver (fedsim/server/driver.py)
    messages = exchange.configure(plan, grid)   # messages out for the round the driver opened
    count = exchange.aggregate(replies)         # replies in -> the global model stepped; None: skipped

`plain`: one TRAIN message per sampled client; each reply is decoded and checked (untrusted
input), the accepted updates are stacked in partition-id order and handed to the driver, which
runs the pipeline (server-side attack, defenses, rule) and the server step.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch
from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid

from fedsim.compression.base import PayloadError
from fedsim.server.driver import RoundDriver, RoundPlan
from fedsim.server.pipeline import update_norms
from fedsim.updates import UpdateBatch
from fedsim.wire import attacker_train_seconds, decode_upload, message_bytes, pack_model, records_bytes, shared_backdoor_state

log = logging.getLogger("fedsim")


class ReplyOwners:
    """Which client a reply belongs to: the client of the message it answers (`reply_to_message_id`).

    Not its `src_node_id`: a SuperLink answers for a node it has marked offline with an error reply
    from its own node id, which would put the failure under a client that does not exist and leave
    the dead client with a false timeout. The grid gives each message its id when it pushes it, so
    the map is read after sending. A reply whose message id is unknown (a grid that sets none)
    falls back to its source node, looked up among the round's own clients (the node map may hold
    a million partitions: fedsim/server/nodes.py)."""

    def __init__(self, sent: list[tuple[Message, int]]) -> None:
        self.sent = sent
        self._by_id: dict[str, int] | None = None
        self._by_node: dict[int, int] | None = None

    def __call__(self, reply: Message) -> int:
        if self._by_id is None:
            self._by_id = {m.metadata.message_id: pid for m, pid in self.sent if m.metadata.message_id}
        pid = self._by_id.get(reply.metadata.reply_to_message_id)
        if pid is not None:
            return pid
        if self._by_node is None:
            self._by_node = {m.metadata.dst_node_id: pid for m, pid in self.sent}
        return self._by_node.get(reply.metadata.src_node_id, -1)


class PlainExchange:
    """One exchange a round: the model out to every sampled client, its encoded update back."""

    def __init__(self, driver: RoundDriver, node_of: dict[int, int]) -> None:
        self.driver, self.node_of = driver, node_of
        self.owner = ReplyOwners([])
        self.sent_at = time.perf_counter()  # when this round's messages were handed to Flower

    def configure(self, plan: RoundPlan, grid: Grid) -> list[Message]:
        driver = self.driver
        model_record = pack_model(driver.global_vec, driver.layout)
        model_bytes = records_bytes({"arrays": model_record})  # the same model goes to everyone: size it once
        sent, down_per_client = [], {}
        for pid in plan.order:
            config_record = ConfigRecord(plan.configs[pid])
            msg = Message(RecordDict({"arrays": model_record, "config": config_record}),
                          dst_node_id=self.node_of[pid], message_type=MessageType.TRAIN)
            down_per_client[pid] = model_bytes + records_bytes({"config": config_record})
            sent.append((msg, pid))
        self.owner = ReplyOwners(sent)
        driver.pending.bytes_down = sum(down_per_client.values())
        driver.pending.bytes_down_per_client = down_per_client
        self.sent_at = time.perf_counter()
        driver.timing[plan.round] = {"encode": self.sent_at - driver.started}
        return [msg for msg, _ in sent]

    def aggregate(self, replies: list[Message], excused: frozenset = frozenset(), sizes: dict | None = None,
                  reshape: Callable[[UpdateBatch], tuple[UpdateBatch, dict]] | None = None) -> int | None:
        """`excused`: sampled clients whose missing reply is no failure (a clock's stragglers and dropouts);
        `sizes`: replies' serialized sizes by client, where a wrapping exchange has measured them already;
        `reshape`: what a wrapping exchange makes of the decoded batch before the pipeline (asynchronous
        protocols: staleness-scaled rows), with the driver's `aggregate` options (scale, reference)."""
        driver, record = self.driver, self.driver.pending
        t_start = time.perf_counter()
        timing = driver.timing.setdefault(record.round, {})
        timing["waiting_for_clients"] = t_start - self.sent_at
        rows, rejected, up, losses = self.decode(replies, sizes or {})
        timing["decode"] = time.perf_counter() - t_start
        fed = driver.scenario.federation
        answered = {self.owner(m) for m in replies}
        for pid in record.sampled:
            if pid not in answered and pid not in excused:  # a node that died or timed out: the round goes on without it
                rejected[pid] = f"no reply within federation.round_timeout={fed.round_timeout}s"
        record.update({"bytes_up": up, "rejected": rejected, "defenses": {}, "skipped": None})
        record.train_loss = (sum(losses[p] for p in sorted(losses)) / len(losses)) if losses else None
        batch = UpdateBatch(
            torch.stack([u for _, u, _ in rows]) if rows else torch.zeros(0, driver.layout.dim),
            torch.tensor([w for _, _, w in rows], dtype=torch.float32),
            tuple(pid for pid, _, _ in rows),
        )
        options = {}
        if reshape is not None:
            batch, options = reshape(batch)
        record.attacker_update_norms, record.honest_update_norm_median = update_norms(batch, set(record.attackers))
        if len(rows) < fed.min_replies:
            record.skipped = f"{len(rows)} valid updates, fewer than federation.min_replies={fed.min_replies}"
            log.warning("round %s skipped: %s", record.round, record.skipped)
            return None
        if not driver.aggregate(batch, set(record.attackers), record.groups or None, **options):
            log.warning("round %s skipped: %s", record.round, record.skipped)
            return None
        timing["aggregate"] = time.perf_counter() - t_start - timing["decode"]
        return len(rows)

    def decode(self, replies: list[Message], sizes: dict | None = None) -> tuple[list, dict, int, dict]:
        """Accepted (pid, update, weight) rows sorted by partition id, rejections with reasons, upload bytes, losses."""
        driver, record = self.driver, self.driver.pending
        rows, rejected, up, losses = [], {}, 0, {}
        up_per_client = record.bytes_up_per_client = {}
        train_seconds = {}
        for reply in replies:
            pid = self.owner(reply)
            if reply.has_error():
                rejected[pid] = f"client error: {reply.error.reason}"
                continue
            try:
                size = sizes[pid] if sizes and pid in sizes else message_bytes(reply)
                up += size
                up_per_client[pid] = size
                update, weight, loss = decode_upload(reply.content, driver.rt.codec, driver.layout)
            except PayloadError as err:
                rejected[pid] = str(err)
                log.warning("round %s: rejected upload from client %s: %s", record.round, pid, err)
                continue
            losses[pid] = loss
            rows.append((pid, update, weight))
            if pid in record.attackers:
                take_backdoor_report(driver, pid, reply)
                seconds = attacker_train_seconds(reply.content)
                if seconds is not None:
                    train_seconds[pid] = seconds
        rows.sort(key=lambda r: r[0])  # aggregation independent of arrival order
        if train_seconds:
            record.attacker_train_seconds = dict(sorted(train_seconds.items()))
        return rows, rejected, up, losses


def take_backdoor_report(driver: RoundDriver, pid: int, reply: Message) -> None:
    """An attacker's reply may carry the trigger it planted (an untrusted report: a malformed one
    is ignored with a warning); the driver keeps the lowest attacker id's."""
    try:
        shared = shared_backdoor_state(reply.content, driver.layout)
    except PayloadError as err:
        log.warning("round %s: ignored the backdoor report of attacker %s: %s", driver.pending.round, pid, err)
        return
    driver.take_backdoor_report(pid, shared)
