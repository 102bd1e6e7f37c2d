"""Run a scenario on Flower's simulation engine (Ray backend), quietly unless asked.

While `simulate` runs, two functions of Flower's simulation engine (flwr 1.41, `vce_api`) are
wrapped or replaced, and restored afterwards:

* node registration: Flower registers every one of `num_supernodes` nodes with the link state and
  makes each a run-info store with its Context before the first round (1,000,000 nodes: 93 s and
  2.7 GB in this process). fedsim registers a node when the server first messages it
  (`SimulatedNodes`): a round costs the nodes it samples, the others cost nothing. The engine's
  node id -> partition id map is recorded, so the ServerApp takes it from there instead of sending
  every registered node a QUERY (200 messages and several seconds at start-up for 200 clients;
  deployment still asks, see fedsim/server/nodes.py);
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
* the actor pool's size: Flower fits actors to the nodes' CPUs and GPUs only; fedsim's rule
  (fedsim/engine/ray_start.py `actor_pool_size`) also counts `federation.client_memory_gb`, the
  actors' `memory`, so that no actor is created that Ray cannot place;
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
from collections.abc import Mapping
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
    OBJECT_STORE_BYTES, actor_pool_size, client_resources, init_local_ray, quiet_logs, ray_address, single_threaded_openblas,
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
class SimulatedNodes(Mapping):
    """The simulation's nodes, each registered with the link state when the server first needs it.

    Flower's engine takes this where it takes `_register_nodes`' {node id: partition id}: as that
    mapping it holds the nodes registered so far (messages can only be for those), which the
    delivery loop tests messages against and the workers' run-info stores (`NodeInfoStores`) are
    made from. The server sees `by_partition`, {partition id: node id} over all
    `num_partitions` partitions: reading a partition's node registers it (Flower's own
    `create_node` and heartbeat, fedsim/flower/compat.py `register_node`) the first time.
    Registration is under a lock: the server and the engine's threads read it at once."""

    def __init__(self, state, num_partitions: int) -> None:
        self.state, self.num_partitions = state, num_partitions
        self.lock = threading.Lock()
        self._node: dict[int, int] = {}  # partition id -> node id, registered ones
        self._partition: dict[int, int] = {}  # node id -> partition id
        self.by_partition = PartitionNodes(self)

    # Flower's side: {node id: partition id} of the nodes registered so far
    def __getitem__(self, node_id: int) -> int:
        return self._partition[node_id]

    def __contains__(self, node_id) -> bool:
        return node_id in self._partition

    def __iter__(self):
        return iter(list(self._partition))  # a copy: the server may register a node meanwhile

    def __len__(self) -> int:
        return len(self._partition)

    # the server's side
    def node_of(self, partition_id: int) -> int:
        node = self._node.get(partition_id)
        if node is not None:
            return node
        if not 0 <= partition_id < self.num_partitions:
            raise KeyError(partition_id)
        with self.lock:
            node = self._node.get(partition_id)
            if node is None:
                node = flower_compat.register_node(self.state)
                self._partition[node] = partition_id  # before the server can address a message to it
                self._node[partition_id] = node
        return node

    def partition_of(self, node_id: int, default: int = -1) -> int:
        return self._partition.get(node_id, default)


class PartitionNodes(Mapping):
    """{partition id: node id} over every partition of a `SimulatedNodes`, registering on first read.
    Iterating it registers every node: the server reads the nodes of the clients it samples."""

    def __init__(self, nodes: SimulatedNodes) -> None:
        self.nodes = nodes

    def __getitem__(self, partition_id: int) -> int:
        return self.nodes.node_of(partition_id)

    def __contains__(self, partition_id) -> bool:
        return isinstance(partition_id, int) and 0 <= partition_id < self.nodes.num_partitions

    def __iter__(self):
        return iter(range(self.nodes.num_partitions))

    def __len__(self) -> int:
        return self.nodes.num_partitions

    def pid_of(self, node_id: int, default: int = -1) -> int:
        return self.nodes.partition_of(node_id, default)


class NodeInfoStores(dict):
    """{node id: Flower's run-info store} for `SimulatedNodes`, each store made (as
    `_register_node_info_stores` makes it, fedsim/flower/compat.py `node_info_store`) when the
    engine's worker first looks a node up, so a node never messaged has none."""

    def __init__(self, nodes: SimulatedNodes, run, app_dir: str | None) -> None:
        super().__init__()
        self.nodes, self.run, self.app_dir = nodes, run, app_dir
        self.lock = threading.Lock()

    def __missing__(self, node_id: int):
        with self.lock:
            if node_id not in self:
                store = flower_compat.node_info_store(node_id, self.nodes[node_id], self.nodes.num_partitions,
                                                      self.run, self.app_dir)
                self[node_id] = store
            return dict.__getitem__(self, node_id)


class NodeMaps:
    """{partition id: node id} per link state, recorded where the engine registers its nodes.

    One per process (the engine's functions are patched process-wide); `simulate` calls may nest
    or overlap, so maps are keyed by the link state they belong to."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.active = 0  # simulate() calls in progress in this process
        self.maps: dict[int, Mapping[int, int]] = {}

    def record(self, state, mapping: Mapping[int, int]) -> None:
        """`mapping`: the engine's {node id: partition id}, a `SimulatedNodes` or Flower's dict."""
        by_partition = mapping.by_partition if isinstance(mapping, SimulatedNodes) else \
            {pid: node for node, pid in mapping.items()}
        with self.lock:
            self.maps[id(state)] = by_partition

    def lookup(self, grid, timeout: float) -> Mapping[int, int] | None:
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
                return dict(found) if isinstance(found, dict) else found
            if time.monotonic() > deadline:
                raise TimeoutError(f"the simulation engine registered no nodes within {timeout:.0f}s")
            time.sleep(0.02)


NODE_MAPS = NodeMaps()


def registered_partitions(grid, timeout: float) -> Mapping[int, int] | None:
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

    on_demand = options.nodes_on_demand and options.known_simulation_nodes  # a QUERY per node needs them all

    def register_nodes(num_nodes, state_factory):
        if on_demand:
            mapping = SimulatedNodes(state_factory.state(), num_nodes)
        else:
            mapping = flower["register_nodes"](num_nodes=num_nodes, state_factory=state_factory)
        NODE_MAPS.record(state_factory.state(), mapping)
        return mapping

    def node_info_stores(nodes_mapping, run, app_dir=None):
        if isinstance(nodes_mapping, SimulatedNodes):
            return NodeInfoStores(nodes_mapping, run, app_dir)
        return flower["node_info_stores"](nodes_mapping=nodes_mapping, run=run, app_dir=app_dir)

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
    adjusted = {"register_nodes": register_nodes, "node_info_stores": node_info_stores, "deliver": deliver, "terminate_all_actors": terminate_all_actors,
                "queue": prompt_stop_queue(options.queue_wait_seconds), "pool_size": actor_pool_size}
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
