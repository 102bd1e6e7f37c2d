"""Starting Ray for fedsim, in a module cheap enough to import before anything else.

A sweep starts its Ray and its client actors first and validates and imports the rest while the
actors warm up (fedsim/engine/shared.py), so what a start needs lives here rather than in
fedsim/engine/simulate.py, which imports the server (torch, Flower's simulation) to run one.
Importing this module sets the environment that flwr and Ray read when they are imported.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings

from fedsim.engine.allocator import in_child_environment

# Before flwr/ray are imported: no telemetry, no update check, no Ray accelerator warning, a
# bounded object store (Ray's default is 30% of RAM in /dev/shm).
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
# OpenBLAS libraries loaded from now on (scipy's, the Ray workers' numpy) run single-threaded;
# see single_threaded_openblas() for why, and the client actors are single-threaded anyway.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

OBJECT_STORE_BYTES = 256 * 1024**2


def quiet_logs(verbose: bool) -> None:
    level = logging.INFO if verbose else logging.ERROR
    logging.getLogger("flwr").setLevel(level)
    logging.getLogger("ray").setLevel(level)
    logging.getLogger("fedsim").setLevel(logging.INFO if verbose else logging.WARNING)
    if not verbose:
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        warnings.filterwarnings("ignore", category=FutureWarning)


def ray_address(scenario) -> str | None:
    """The Ray cluster to attach to: `federation.ray_address`, else $RAY_ADDRESS, else None (start one)."""
    return scenario.federation.ray_address or os.environ.get("RAY_ADDRESS") or None


def client_resources(scenario) -> dict:
    """What each client actor asks Ray for (Flower's `client_resources`, passed to `.options()`).

    With `max_restarts` and `max_task_retries` a crashed actor (segfault, OOM kill, a lost cluster
    node) is restarted by Ray and the message it was running is retried once there (a client that
    crashes again is reported as rejected). Without them Flower's pool keeps handing the dead actor
    later messages, and every one fails for the rest of the run.

    `federation.client_memory_gb` is declared as the actor's `memory` (bytes): Ray then places no
    more client actors on a node than their limits fit in its memory resource (the limit itself is
    enforced in the client's process, fedsim/client/memory_limit.py; Ray's `memory` only schedules),
    and `actor_pool_size` creates no more actors than the cluster can place."""
    fed = scenario.federation
    resources = {"num_cpus": fed.client_cpus, "num_gpus": fed.client_gpus, "max_restarts": -1, "max_task_retries": 1}
    if fed.client_memory_gb:
        resources["memory"] = int(fed.client_memory_gb * 1024**3)
    return resources


def actor_pool_size(client_resources: dict) -> int:
    """How many client actors of `client_resources` the running Ray cluster can place: Flower's rule
    (node by node, the actors its CPUs and GPUs fit), with the actors' `memory` counted as well.
    Flower's own rule ignores `memory`, so an actor beyond what the nodes' memory fits would be
    created anyway, never placed, and the messages handed to it would wait for ever."""
    import ray

    total = 0
    for node in ray.nodes():
        have = node.get("Resources") or {}
        if not have or not node.get("Alive", True):  # a node that left the cluster
            continue
        fits = int(have.get("CPU", 0) / client_resources["num_cpus"])
        if client_resources.get("num_gpus", 0) > 0:
            fits = min(fits, int(have.get("GPU", 0) / client_resources["num_gpus"]))
        if client_resources.get("memory", 0) > 0:
            fits = min(fits, int(have.get("memory", 0) / client_resources["memory"]))
        total += fits
    if total == 0:
        raise ValueError(f"no node of the Ray cluster can host a client with resources {client_resources}")
    return total


def workers_pythonpath() -> str:
    """This process's import path, as Flower hands it to Ray's workers (PYTHONPATH)."""
    pythonpath = os.pathsep.join(sys.path)
    if os.environ.get("PYTHONPATH"):
        pythonpath = f"{pythonpath}{os.pathsep}{os.environ['PYTHONPATH']}"
    return pythonpath


def init_local_ray(init_args: dict, malloc_settings: bool) -> None:
    """`ray.init` of a local Ray whose workers inherit PYTHONPATH and (optionally) fedsim's malloc
    settings from this process's environment, with no job runtime environment (see
    fedsim/engine/simulate.py start_local_ray)."""
    import ray

    init_args = dict(init_args)
    init_args.setdefault("include_dashboard", False)
    os.environ["PYTHONPATH"] = workers_pythonpath()  # as Flower's init_ray sets it
    with in_child_environment() if malloc_settings else contextlib.nullcontext():  # the workers' malloc
        ray.init(**init_args)


def single_threaded_openblas():
    """Limit the OpenBLAS libraries already loaded in this process to one thread (restored after).

    OpenBLAS stops its worker threads before every fork (pthread_atfork). The ServerApp thread
    starts computing (e.g. the edge set's PCA density check, an eigendecomposition that OpenBLAS
    parallelises) while the main thread starts Ray, which forks a dozen processes: a threaded
    call caught by a fork waits for workers that are gone and spins forever (seen here about one
    run in five). With one thread OpenBLAS never hands work to its pool. Libraries loaded later
    read OPENBLAS_NUM_THREADS=1, set when this module is imported.
    """
    from threadpoolctl import threadpool_info, threadpool_limits

    prefixes = {lib["prefix"] for lib in threadpool_info() if lib.get("internal_api") == "openblas"}
    return threadpool_limits(limits={p: 1 for p in prefixes}) if prefixes else contextlib.nullcontext()


def actor_lost(actor, client_resources: dict, pool_actors: int) -> bool:
    """Whether a client actor that has not answered yet is lost for good: Ray holds it dead, or is
    restarting it (its process died) while the live cluster can no longer place all `pool_actors`
    actors of the pool (a node left it). Ray then waits for room that may never come, and every
    message handed to the actor waits with it: Flower's pool is sized to fill the cluster, so the
    actors of a lost node have nowhere to go. An actor restarting where the cluster still has room
    for it (its process was killed on a node that remains) is not lost. Reads Ray's actor table
    from its GCS (fedsim/flower/compat.py `ray_actor_state`: ~1 ms, no dashboard needed)."""
    from fedsim.flower.compat import ray_actor_state

    state = ray_actor_state(actor)
    if state in (None, "ALIVE"):
        return False
    if state == "DEAD":
        return True
    try:
        room = actor_pool_size(client_resources)
    except ValueError:  # no node left that can host a client
        room = 0
    return room < pool_actors
