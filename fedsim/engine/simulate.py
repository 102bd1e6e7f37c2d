"""Run a scenario on Flower's simulation engine (Ray backend), quietly unless asked.

While `simulate` runs, two functions of Flower's simulation engine (flwr 1.41, `vce_api`) are
wrapped or replaced, and restored afterwards:

* node registration: the engine's node id -> partition id map is recorded, so the ServerApp
  takes it from there instead of sending every registered node a QUERY (200 messages and several
  seconds at start-up for 200 clients; deployment still asks, see fedsim/server/nodes.py);
* message delivery: Flower's loop asks the link state for each registered node's messages every
  0.1 s, and every ask scans every stored message: O(nodes x messages) Python work per sweep
  under the GIL. With 10,000 registered clients and 100 messages in flight that is a million
  checks per sweep and rounds slow down with the number of *registered* clients. The
  replacement scans the stored messages once per sweep and delivers the same messages;
* actor shutdown: the client actors are killed with `ray.kill(no_restart=True)` rather than asked
  to exit through a task, which the restart policy below would otherwise report as a failed task
  to retry;
* the engine's workers and what delivery hands them: each sweep's messages go out as one cohort
  per worker, one actor task each, instead of one task per message (fedsim/engine/cohorts.py);
* the actor class: fedsim's `ClientActor` (fedsim/engine/ray_actor.py), Flower's `ClientAppActor` defined
  in a module that is cheap to import in every actor;
* Ray's start (a local one): Flower starts Ray with a job runtime environment (only PYTHONPATH,
  which a local Ray's workers inherit anyway), and Ray cannot hand the workers it prestarts at
  start-up to a job with a runtime environment: it starts new ones when the actors are created
  (~0.8 s later to the first client, measured). `start_local_ray` starts it without one;
  attaching to an existing cluster still goes through Flower's start, runtime environment and all;
* the engine's two queues: its worker threads wait on them up to 1 s before they look at the stop
  event, so the engine stopped (and Ray's shutdown began) up to a second after the ServerApp had
  finished; the queues used during `simulate` cap that wait at `EngineOptions.queue_wait_seconds`.

Every one of these reaches into Flower's non-public API through fedsim/flower/compat.py; if
the installed Flower lacks what they rely on, `simulate` leaves the engine alone (it stays
correct, only slower at scale). Each is an `EngineOptions` field (fedsim/flower/options.py), on by
default, so that benchmarks/overhead.py can measure what it buys.

The engine pickles the ClientApp with every message it sends to a Ray actor: `simulate` sends a
`CompactClientApp` (fedsim/engine/ray_actor.py), pickled as the scenario's JSON text; each worker process
builds the real ClientApp from it once and reuses it.

`federation.ray_address` (or the RAY_ADDRESS environment variable) attaches the simulation to an
existing Ray cluster instead of starting a local one; see docs/performance.md.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from pathlib import Path
from typing import Callable

from fedsim.engine import ray_start  # noqa: F401,I001  (first: it sets the environment flwr and Ray read at import)
from fedsim.devices import check_simulation_gpus
from fedsim.flower import compat as flower_compat
from fedsim.engine.allocator import apply_to_this_process
from fedsim.engine.cohorts import WorkerCounts, cohort_worker, deliver_cohorts
from fedsim.flower.stoppable_grid import RunStopped
from fedsim.flower.options import EngineOptions
from fedsim.engine.ray_actor import CompactClientApp, client_actor_class
from fedsim.engine.ray_start import (  # noqa: F401  (also imported from here by the engine's callers)
    OBJECT_STORE_BYTES, client_resources, init_local_ray, quiet_logs, ray_address, single_threaded_openblas,
    workers_pythonpath,
)
from fedsim.preflight import preflight
from fedsim.runs.folder import RunFolder
from fedsim.server.app import make_server_app

log = logging.getLogger("fedsim")


def backend_config(scenario, verbose: bool) -> dict:
    """Flower's backend config for the scenario; device settings the simulation cannot run are
    refused here, before Ray starts (fedsim/devices.py check_simulation_gpus)."""
    init_args = {"logging_level": "INFO" if verbose else "ERROR", "log_to_driver": verbose, "include_dashboard": False}
    address = ray_address(scenario)
    check_simulation_gpus(scenario, attached=bool(address))
    if address:
        # an existing cluster: its nodes bring their own CPUs and object stores
        init_args["address"] = address
    else:
        init_args.update(num_cpus=os.cpu_count() or 1, object_store_memory=OBJECT_STORE_BYTES)
    return {
        "client_resources": client_resources(scenario),
        "init_args": init_args,
    }


# --- the engine adjustments ----------------------------------------------------------------------
class NodeMaps:
    """{partition id: node id} per link state, recorded where the engine registers its nodes.

    One per process (the engine's functions are patched process-wide); `simulate` calls may nest
    or overlap, so maps are keyed by the link state they belong to."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.active = 0  # simulate() calls in progress in this process
        self.maps: dict[int, dict[int, int]] = {}

    def record(self, state, mapping: dict[int, int]) -> None:
        with self.lock:
            self.maps[id(state)] = {pid: node for node, pid in mapping.items()}

    def lookup(self, grid, timeout: float) -> dict[int, int] | None:
        """{partition id: node id} of the simulation driving `grid`, waiting up to `timeout` s for
        the engine to register the nodes (the ServerApp thread starts first); None when `grid`
        does not belong to a `simulate` call (then the server asks each node)."""
        state = flower_compat.grid_link_state(grid)
        if state is None:
            return None
        deadline = time.monotonic() + timeout
        while True:
            with self.lock:
                if not self.active:
                    return None
                found = self.maps.get(id(state))
            if found is not None:
                return dict(found)
            if time.monotonic() > deadline:
                raise TimeoutError(f"the simulation engine registered no nodes within {timeout:.0f}s")
            time.sleep(0.02)


NODE_MAPS = NodeMaps()


def registered_partitions(grid, timeout: float) -> dict[int, int] | None:
    """See `NodeMaps.lookup`."""
    return NODE_MAPS.lookup(grid, timeout)


def prompt_stop_queue(wait_seconds: float) -> type[queue.Queue]:
    """The engine's message queues, with a blocking `get` that waits at most `wait_seconds`: its
    threads poll `get(timeout=1.0)` and then check the stop event, so that is how long they kept
    the engine (and Ray) running after the last round."""

    class PromptStopQueue(queue.Queue):
        def get(self, block=True, timeout=None):
            if block and timeout is not None:
                timeout = min(timeout, wait_seconds)
            return super().get(block, timeout)

    return PromptStopQueue


def deliver_messages(state, queue, nodes_mapping, f_stop, sweep_seconds: float) -> None:
    """What vce_api.add_messages_to_queue does (move undelivered instructions for registered nodes
    to the workers' queue, marking them delivered, dropping expired ones), with one scan of the
    stored messages per sweep instead of one per registered node."""
    while not f_stop.is_set():
        for msg in flower_compat.undelivered_messages(state, nodes_mapping):
            queue.put(msg)
        f_stop.wait(sweep_seconds)


def start_local_ray(original_init_ray, after_init: Callable[[], None], malloc_settings: bool):
    """`RayBackend.init_ray` for a Ray started here: what Flower's does (PYTHONPATH for the workers'
    imports, no dashboard), with PYTHONPATH passed through the environment the raylet and its
    workers inherit rather than a job runtime environment, so the actors take the worker processes
    Ray prestarts. An address (an existing cluster, whose workers inherit nothing from this process)
    goes to Flower's `original_init_ray`. `after_init` runs once Ray is up either way."""

    def init_ray(backend, backend_config) -> None:
        try:
            _init_ray(backend, backend_config)
        finally:
            after_init()

    def _init_ray(backend, backend_config) -> None:
        import ray

        init_args = dict(backend_config.get("init_args") or {})
        if ray.is_initialized() or init_args.get("address"):
            return original_init_ray(backend, backend_config)
        init_local_ray(init_args, malloc_settings)

    return init_ray


@contextlib.contextmanager
def engine_adjustments(options: EngineOptions = EngineOptions(), after_ray_init: Callable[[], None] = lambda: None):
    """Wrap node registration and replace message delivery in Flower's simulation engine, then restore them.

    `after_ray_init` runs right after Ray has started (`ray.init` replaces the process's SIGTERM
    handler; fedsim's run puts its own back there)."""
    if not flower_compat.PROBES["simulation-engine"].holds():
        log.warning("this flwr version lacks what fedsim's simulation adjustments use (%s); running the engine as is",
                    ", ".join(flower_compat.PROBES["simulation-engine"].missing()))
        yield
        return
    flower = flower_compat.engine_members()  # Flower's own, put back when the last user leaves

    def register_nodes(num_nodes, state_factory):
        mapping = flower["register_nodes"](num_nodes=num_nodes, state_factory=state_factory)
        NODE_MAPS.record(state_factory.state(), mapping)
        return mapping

    light_actor = client_actor_class() if options.light_actor else None
    cohorts = options.cohorts and light_actor is not None  # only fedsim's actor runs a cohort task
    workers = WorkerCounts()

    def deliver(state, queue, nodes_mapping, f_stop):
        if options.fast_message_delivery and flower_compat.has_message_store(state):
            if cohorts:
                return deliver_cohorts(lambda: flower_compat.undelivered_messages(state, nodes_mapping), queue,
                                       workers, f_stop, options.delivery_sweep_seconds, options.delivery_settle_seconds)
            return deliver_messages(state, queue, nodes_mapping, f_stop, options.delivery_sweep_seconds)
        return flower["deliver"](state, queue, nodes_mapping, f_stop)

    def terminate_all_actors(pool):
        import ray

        for actor in pool.pool:
            ray.kill(actor, no_restart=True)

    with NODE_MAPS.lock:
        NODE_MAPS.active += 1
    adjusted = {"register_nodes": register_nodes, "deliver": deliver, "terminate_all_actors": terminate_all_actors,
                "queue": prompt_stop_queue(options.queue_wait_seconds)}
    if options.prestarted_workers:
        adjusted["init_ray"] = start_local_ray(flower["init_ray"], after_ray_init, options.malloc_settings)
    if light_actor is not None:
        adjusted["actor_class"] = light_actor
    if cohorts:
        adjusted["worker"] = cohort_worker(workers)
    flower_compat.set_engine_members(adjusted)
    try:
        yield
    finally:
        with NODE_MAPS.lock:
            NODE_MAPS.active -= 1
            if not NODE_MAPS.active:
                NODE_MAPS.maps.clear()
                flower_compat.set_engine_members(flower)


def simulate(scenario, run_dir: Path | RunFolder | None = None, verbose: bool = False, progress=None, client_app=None,
             stop: threading.Event | None = None, signals=None, options: EngineOptions = EngineOptions(),
             engine=None) -> Path:
    """Run `scenario` on Ray-simulated clients; returns the run folder's path.

    `run_dir`: the run's folder (made here under `output.dir` when None; fedsim/runs/folder.py).
    One that already holds completed rounds (and checkpoints) is resumed, not restarted.
    `client_app` replaces the scenario's ClientApp (tests inject failing clients this way).
    `stop` ends the run early when set (fedsim.engine.interrupt: the CLI sets it on Ctrl-C/SIGTERM);
    `signals`, the CLI's `on_signals` handle, has its handlers put back after `ray.init` replaced
    SIGTERM's. Whatever ends the run early (an interrupt, an error), the ServerApp thread is told
    to stop and given `options.stop_grace_seconds` to finish writing the last completed round
    before the exception propagates.
    `engine`: a running `SharedEngine` (fedsim/engine/shared.py) to run on, with its Ray and client
    actors, instead of starting and stopping Ray for this run alone; several runs may share it at once.
    """
    from flwr.simulation import run_simulation

    quiet_logs(verbose)
    preflight(scenario)  # the data, edge sets and model, before Ray starts (cached for the server)
    backend = backend_config(scenario, verbose)  # refuses GPU shares no GPU can serve, before anything starts
    if options.malloc_settings:
        apply_to_this_process()
    folder = RunFolder.create(scenario) if run_dir is None else RunFolder.at(RunFolder.of(run_dir).path, scenario)
    run_dir = folder.path
    # the simulated clients keep their memory in their own state folder, here inside the run folder
    state_dir = folder.client_states if scenario.output.checkpoints else None
    stop = stop if stop is not None else threading.Event()
    server_finished = threading.Event()
    completions = []  # the ServerApp hands over the rest of the run: the last evaluation and the summary
    after_ray_init = signals.reinstall if signals is not None else (lambda: None)
    node_map = registered_partitions if options.known_simulation_nodes else None
    try:
        # a shared engine holds the adjustments, Ray and the OpenBLAS limit for all its runs
        own_engine = engine is None
        with engine_adjustments(options, after_ray_init) if own_engine else contextlib.nullcontext(), \
                single_threaded_openblas() if own_engine else contextlib.nullcontext():
            run_simulation(
                server_app=make_server_app(scenario, folder, progress, checkpoints=scenario.output.checkpoints,
                                           on_rounds_done=completions.append, stop=stop, finished=server_finished,
                                           options=options, node_map=node_map),
                client_app=client_app if client_app is not None else CompactClientApp.of(scenario, state_dir),
                num_supernodes=scenario.federation.num_clients,
                backend_name="ray",
                backend_config=backend,
                verbose_logging=verbose,
            )
    except BaseException:
        stop.set()
        server_finished.wait(options.stop_grace_seconds)
        raise
    if stop.is_set() and not completions:
        raise RunStopped(f"the run was stopped; completed rounds are in {run_dir}")
    for complete in completions:  # the engine has stopped its actors and Ray meanwhile
        complete()
    if not folder.summary_file.exists():
        raise RuntimeError(f"the simulation ended without finishing the run; partial results are in {run_dir}")
    return run_dir
