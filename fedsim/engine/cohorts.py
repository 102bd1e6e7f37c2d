"""Cohorts in Flower's simulation engine: an actor gets several of a round's messages in one task.

Flower's engine hands each message to an actor as its own Ray task: a task submission, a pickled
message and context, a ClientApp call and a reply fetched back, per client. With small models
that wrapping costs more than the training (issue #33 measured ~8 ms per client around a few
milliseconds of arithmetic, MLP on pfl-research's benchmark shape). Here the delivery sweep cuts the messages it finds into one cohort
per engine worker (round-robin over the order the server sent them, largest client first, so
cohorts get similar work: pfl's longest-first scheduling), and each worker sends its cohort to its
actor as one task (`ClientAppRunner.run_cohort`, fedsim/engine/ray_actor.py). There the ClientApp
may first train the cohort's honest clients together (fedsim/client/cohort.py: one vectorised
computation) and then answers every message on its own, as before.

Nothing else changes: every client still gets its own Message and sends its own reply, with its
own context, stored back where the engine keeps it; a client that raises gets the error reply
Flower's worker would give it. An actor that dies (a client that crashes its process) takes its
cohort's task down: each of the cohort's messages is then sent again alone, with Ray's one retry,
so only the client that keeps crashing is lost, as without cohorts.

A node that leaves the cluster (`ray start` nodes: its raylet killed, the machine gone) takes its
actors with it, and Ray, asked to restart them, waits for room that Flower's pool (sized to fill the
cluster) never leaves: every message handed to such an actor would wait with it, the round until
its timeout and the engine's shutdown for ever. So a task that has not answered looks at its actor
every `LOST_ACTOR_CHECK_SECONDS` (fedsim/engine/ray_start.py `actor_lost`); an actor lost for good
leaves the pool (fedsim/flower/compat.py `run_cohort_task`), its message goes once to another
actor, and the engine's workers share the actors left (`ActorSlots`). A task also stops waiting
when the engine stops.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import traceback
import weakref
from queue import Empty
from typing import Callable
from uuid import uuid4

from flwr.app import Error, Message

from fedsim.engine.ray_start import actor_lost
from fedsim.flower import compat as flower_compat

log = logging.getLogger("fedsim")


class Cohort(list):
    """Messages for one actor task (a list: the engine's queue carries it as one item)."""


def cohorts_of(messages: list, workers: int) -> list[Cohort]:
    """`messages` (in the order the server sent them) cut into at most `workers` cohorts per run,
    dealt round-robin so that each cohort gets a share of the large and of the small clients."""
    runs: dict[int, list] = {}
    for m in messages:
        runs.setdefault(m.metadata.run_id, []).append(m)
    out = []
    for msgs in runs.values():
        k = max(1, min(workers, len(msgs)))
        out += [Cohort(msgs[i::k]) for i in range(k)]
    return out


class WorkerCounts:
    """How many engine workers serve each message queue (one queue per run): the delivery sweep
    cuts its messages into that many cohorts."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: dict[int, int] = {}

    def join(self, queue) -> None:
        with self.lock:
            self.counts[id(queue)] = self.counts.get(id(queue), 0) + 1

    def leave(self, queue) -> None:
        with self.lock:
            left = self.counts.get(id(queue), 1) - 1
            if left:
                self.counts[id(queue)] = left
            else:
                self.counts.pop(id(queue), None)

    def of(self, queue) -> int:
        with self.lock:
            return max(1, self.counts.get(id(queue), 1))


def deliver_cohorts(undelivered: Callable[[], list], queue, counts: WorkerCounts, f_stop, sweep_seconds: float,
                    settle_seconds: float) -> None:
    """The delivery loop: each sweep's undelivered messages go to the workers' queue as cohorts.

    A sweep that finds messages looks again after `settle_seconds` until one finds none, so that a
    round whose messages the server was still storing is cut into cohorts whole: how a round is cut
    must not depend on timing, since a conv net's vectorised update depends, in its last bits, on
    the clients it is computed with (fedsim/cohort/vectorized.py)."""
    while not f_stop.is_set():
        batch = undelivered()
        while batch and not f_stop.wait(settle_seconds):
            more = undelivered()
            if not more:
                break
            batch += more
        if batch:
            batch.sort(key=lambda m: m.metadata.created_at)  # the order the server created them in
            for cohort in cohorts_of(batch, counts.of(queue)):
                queue.put(cohort)
        f_stop.wait(sweep_seconds)


def cohort_worker(counts: WorkerCounts):
    """`vce_api.worker`'s replacement: the same loop, for a cohort (or a single message) per item."""

    def worker(messageins_queue, messageres_queue, node_info_store, backend, f_stop, metrics) -> None:
        counts.join(messageins_queue)
        try:
            while not f_stop.is_set():
                try:
                    item = messageins_queue.get(timeout=1.0)
                except Empty:
                    continue
                for reply in process_cohort(item if isinstance(item, list) else [item], node_info_store, backend, metrics,
                                            f_stop):
                    messageres_queue.put(reply)
        finally:
            counts.leave(messageins_queue)

    return worker


LOST_ACTOR_CHECK_SECONDS = 1.0  # how often a task that has not answered looks at its actor and the stop event


class EngineStopping(RuntimeError):
    """The engine stopped while a task waited for an actor or for its answer."""


class ActorSlots:
    """How many tasks may be handed to a run's actor pool at once: as many as it has actors. The
    engine starts one worker per actor, but a pool shrinks when an actor is lost with its node
    (`actor_lost`, fedsim/engine/ray_start.py), and Flower's pool has no idle actor to wait for."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.slots: "weakref.WeakKeyDictionary[object, threading.Semaphore]" = weakref.WeakKeyDictionary()

    def of(self, backend) -> threading.Semaphore:
        with self.lock:
            if backend.pool not in self.slots:
                self.slots[backend.pool] = threading.Semaphore(flower_compat.pool_actors(backend))
            return self.slots[backend.pool]


SLOTS = ActorSlots()


@contextlib.contextmanager
def actor_slot(backend, f_stop, lost: list):
    """Wait for one of the pool's actors to be free (or the engine to stop); the slot goes back
    after the task unless its actor was lost for good."""
    slots = SLOTS.of(backend)
    while not slots.acquire(timeout=LOST_ACTOR_CHECK_SECONDS):
        if f_stop.is_set():
            raise EngineStopping("the engine stopped before an actor was free")
    try:
        yield
    finally:
        if not lost:
            slots.release()


def answer_waiter(backend, f_stop, lost: list):
    """`run_cohort_task`'s `wait`: wait for the task's answer; give up when the engine stops; every
    `LOST_ACTOR_CHECK_SECONDS`, tell whether its actor is lost for good (noted in `lost`), so that
    the message fails with that reason instead of waiting for a restart that has nowhere to happen."""
    import ray

    resources = flower_compat.backend_client_resources(backend)

    def wait(future, actor) -> bool:
        while not ray.wait([future], timeout=LOST_ACTOR_CHECK_SECONDS)[0]:
            if f_stop.is_set():
                raise EngineStopping("the engine stopped while a client task ran")
            if flower_compat.can_retire_actors(backend) and actor_lost(actor, resources, flower_compat.pool_actors(backend)):
                lost.append(actor)
                log.warning("a client actor is lost with its node (no node has room to restart it); the run goes on "
                            "with %d actors", flower_compat.pool_actors(backend) - 1)
                return True
        return False

    return wait


def process_cohort(messages: list, node_info_store, backend, metrics, f_stop, retry_lost: bool = True
                   ) -> list[Message]:
    """Run `messages` as one task on one actor; the replies, with each node's context updated.
    Once the engine is stopping (`f_stop`), a failed task (its actor killed by the shutdown) is
    neither retried nor reported. A message whose actor was found lost for good with its node is
    sent once more (`retry_lost`) to one of the actors left: the loss was the node's, not the client's."""
    contexts = [node_info_store[m.metadata.dst_node_id].retrieve_context(run_id=m.metadata.run_id) for m in messages]
    started = time.perf_counter()
    lost: list = []  # the task's actor, when it was found lost for good
    try:
        with actor_slot(backend, f_stop, lost):
            replies, updated = flower_compat.run_cohort_task(backend, messages, contexts,
                                                             answer_waiter(backend, f_stop, lost))
    except Exception as ex:  # noqa: BLE001  (the actor died or the task failed)
        metrics.add_clientapp_runtime(time.perf_counter() - started)
        if f_stop.is_set():
            log.debug("a cohort's task ended with the engine: %s", ex)
            replies, updated = [ex] * len(messages), [None] * len(messages)
        elif len(messages) > 1:  # one client may have taken its cohort down: each is retried alone
            log.warning("a client actor failed a cohort of %d messages (%s); each message is retried alone",
                        len(messages), ex)
            return [reply for m in messages for reply in process_cohort([m], node_info_store, backend, metrics, f_stop)]
        elif lost and retry_lost:
            log.warning("client %s: its actor was lost with its node; the message is sent to another actor",
                        messages[0].metadata.dst_node_id)
            return process_cohort(messages, node_info_store, backend, metrics, f_stop, retry_lost=False)
        else:
            log.error("a client actor failed: %s\n%s", ex, traceback.format_exc())
            replies, updated = [ex], [None]
    else:
        metrics.add_clientapp_runtime(time.perf_counter() - started)
    out = []
    for message, reply, context in zip(messages, replies, updated):
        if context is not None:
            node_info_store[message.metadata.dst_node_id].update_context(message.metadata.run_id, context=context)
        if isinstance(reply, BaseException):
            if not f_stop.is_set():
                log.error("client %s: %s", message.metadata.dst_node_id, reply)
            reply = Message(Error(code=flower_compat.error_code(reply), reason=failure_reason(reply, bool(lost))),
                            reply_to=message)
        flower_compat.stamp_message_id(reply, str(uuid4()))
        out.append(reply)
    return out


def failure_reason(ex: BaseException, node_lost: bool = False) -> str:
    """The reason an error reply gives: Flower's worker's wording, `<class>:<'message'>`, except for
    a lost actor, which says what happened to the client in words before Ray's own message: its
    actor's process died (killed, OOM-killed, crashed) or its node left the cluster, on the message's
    try and on Ray's one retry (fedsim/engine/ray_start.py client_resources); or (`node_lost`) its
    actor was found lost for good with its node and taken out of the pool."""
    from ray.exceptions import RayActorError

    if node_lost:
        return (f"the client's actor was lost with its node: the node left the Ray cluster and no node has room to "
                f"restart it, so the run goes on without that actor: {type(ex).__name__}: {ex}")
    if isinstance(ex, RayActorError):
        return (f"the client's actor was lost while running this message, and again on its retry (its process "
                f"died or its node left the Ray cluster): {type(ex).__name__}: {ex}")
    return f"{type(ex)}:<'{ex}'>"
