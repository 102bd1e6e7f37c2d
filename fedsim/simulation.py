"""Run a scenario on Flower's simulation engine (Ray backend), quietly unless asked."""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from pathlib import Path

# Before flwr/ray are imported: no telemetry, no update check, no Ray accelerator warning, a
# bounded object store (Ray's default is 30% of RAM in /dev/shm).
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
# OpenBLAS libraries loaded from now on (the Ray workers' numpy and scipy) run single-threaded;
# see single_threaded_openblas() for why. The client actors are single-threaded anyway.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from fedsim.client_app import make_client_app  # noqa: E402
from fedsim.results import new_run_dir  # noqa: E402
from fedsim.scenario import dump_scenario  # noqa: E402
from fedsim.server_app import make_server_app  # noqa: E402

OBJECT_STORE_BYTES = 256 * 1024**2


def quiet_logs(verbose: bool) -> None:
    level = logging.INFO if verbose else logging.ERROR
    logging.getLogger("flwr").setLevel(level)
    logging.getLogger("ray").setLevel(level)
    logging.getLogger("fedsim").setLevel(logging.INFO if verbose else logging.WARNING)
    if not verbose:
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        warnings.filterwarnings("ignore", category=FutureWarning)


def backend_config(scenario, verbose: bool) -> dict:
    cpus = os.cpu_count() or 1
    return {
        "client_resources": {"num_cpus": scenario.federation.client_cpus, "num_gpus": 0.0},
        "init_args": {
            "num_cpus": cpus,
            "object_store_memory": OBJECT_STORE_BYTES,
            "logging_level": "INFO" if verbose else "ERROR",
            "log_to_driver": verbose,
            "include_dashboard": False,
        },
    }


def single_threaded_openblas():
    """Limit the OpenBLAS libraries already loaded in this process to one thread (restored after).

    Flower starts the ServerApp in a thread while the main thread starts Ray, which forks a dozen
    processes. OpenBLAS stops its worker threads before every fork (pthread_atfork); when the
    ServerApp thread is inside a threaded OpenBLAS call at that moment (the edge set's PCA density
    check is an `eigh`), that call waits for workers that are gone and spins forever. This hung
    about one simulation in three on 2 cores. With one thread OpenBLAS never uses its pool.
    """
    from threadpoolctl import threadpool_info, threadpool_limits

    prefixes = {lib["prefix"] for lib in threadpool_info() if lib.get("internal_api") == "openblas"}
    return threadpool_limits(limits={p: 1 for p in prefixes}) if prefixes else contextlib.nullcontext()


def simulate(scenario, run_dir: Path | None = None, verbose: bool = False, progress=None, client_app=None) -> Path:
    """Run `scenario` on Ray-simulated clients; returns the run folder.

    A `run_dir` that already holds completed rounds (and checkpoints) is resumed, not restarted.
    `client_app` replaces the scenario's ClientApp (tests inject failing clients this way).
    """
    from flwr.simulation import run_simulation

    quiet_logs(verbose)
    if run_dir is None:
        run_dir = new_run_dir(scenario)
    elif not (run_dir / "scenario.yaml").exists():
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "scenario.yaml").write_text(dump_scenario(scenario))
    with single_threaded_openblas():
        run_simulation(
            server_app=make_server_app(scenario, run_dir, progress, checkpoints=scenario.output.checkpoints),
            client_app=client_app if client_app is not None else make_client_app(scenario),
            num_supernodes=scenario.federation.num_clients,
            backend_name="ray",
            backend_config=backend_config(scenario, verbose),
            verbose_logging=verbose,
        )
    if not (run_dir / "summary.json").exists():
        raise RuntimeError(f"the simulation ended without finishing the run; partial results are in {run_dir}")
    return run_dir
