"""How fedsim drives Flower's engine: one value passed in, instead of switches in modules.

Every field is on in normal use; each exists so that `benchmarks/overhead.py --disable NAME` can
measure what it buys (docs/performance.md). None changes a metric: only how fast the same rounds run.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineOptions:
    # simulation engine (fedsim/engine/simulate.py)
    fast_message_delivery: bool = True  # one scan of stored messages per delivery sweep, not one per node
    delivery_sweep_seconds: float = 0.02  # Flower's loop sweeps every 0.1 s
    delivery_settle_seconds: float = 0.005  # cohorts: a sweep that found messages looks again this soon, until none come
    light_actor: bool = True  # fedsim's ClientActor (cheap to import) instead of Flower's ClientAppActor
    cohorts: bool = True  # a sweep's messages go to the actors as one task per worker (needs light_actor);
    # off, every client trains alone, as under `federation.vectorize: off` (the one field that may move a metric, by rounding)
    prestarted_workers: bool = True  # a local Ray without a job runtime env, so actors take prestarted workers
    malloc_settings: bool = True  # fedsim/engine/allocator.py's thresholds in this process and the Ray workers
    queue_wait_seconds: float = 0.05  # the engine's workers wait up to 1 s on an empty queue (Flower)
    stop_grace_seconds: float = 20.0  # after an interrupt: time the ServerApp may take to write its last round
    reply_poll_seconds: float = 0.01  # the in-memory grid looks for replies every 0.1 s (Flower)
    # server (fedsim/server/nodes.py, fedsim/server/driver.py, fedsim/server/closing.py)
    known_simulation_nodes: bool = True  # node -> partition map from the engine: no QUERY per node
    nodes_on_demand: bool = True  # a simulated node is registered when first messaged, not all before round 1
    # (needs known_simulation_nodes: a QUERY per node needs every node registered)
    largest_first: bool = True  # the round's messages go out largest client first
    overlap_evaluation: bool | None = None  # force evaluation.overlap on/off (None: the scenario decides)
