"""fedsim's forking ClientApp executor for `flower-supernode --isolation process`
(`fedsim deploy executor`; fedsim/deploy/commands.py builds its command line).

Flower's SuperNode runtime is non-public API: it is reached through
fedsim/flower/compat.py (probe `forking-executor`).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from fedsim.deploy.commands import FAST_POLL_SECONDS, PRELOAD, source_app_dir


class _Stop(Exception):
    """SIGTERM or SIGINT reached `serve_clientapps`."""


def _app_packages() -> set[str]:
    """Top-level packages of this app: those of fedsim's source tree (fedsim, attacks, defenses,
    aggregators, ...) when it runs from one, else fedsim alone (after a regular install the folder
    above the package is site-packages, whose packages, torch and flwr among them, a child must
    keep: they are what the executor preloads)."""
    source = source_app_dir()
    if source is None:
        return {__name__.partition(".")[0]}
    return {p.name for p in source.iterdir() if (p / "__init__.py").is_file()}


def serve_clientapps(runtime_api: str, runtime_root_cert: Path | None = None, poll_interval: float = FAST_POLL_SECONDS,
                     preload: Sequence[str] = PRELOAD) -> int:
    """Run ClientApps for a `flower-supernode --isolation process` until SIGTERM/SIGINT; returns 0.

    Why: a fresh `flwr-clientapp` process spends ~2 s importing flwr and ~2 s importing torch
    (more when a device's cores are shared) before the ClientApp starts, for every message. In
    flwr 1.41 `flwr-clientapp` handles exactly one message and exits (`run_clientapp` ends in
    `flwr_exit`), and the warm executor pools of `flower-superexec` exist only for the Kubernetes
    executor and not for ClientApps. So this executor imports flwr's ClientApp runtime and the
    `preload` modules once, then, like `flower-superexec`, polls the SuperNode's Runtime API
    (`AcquireTask`, every `poll_interval` s while idle) and for each task forks a child that runs
    Flower's `run_clientapp` (through fedsim/flower/compat.py) with the task's token: the same code `flwr-clientapp`
    runs, so the message, Context, FAB and reply go through the SuperNode exactly as before.

    What the child does not inherit: the app itself. Modules of this app that the parent
    imported (fedsim.cli, fedsim.deploy.commands) are dropped from `sys.modules` in the child, so the
    ClientApp is imported from the run's FAB, as `flwr-clientapp` does; only third-party modules
    are shared. The parent runs no torch computation (no OpenMP pool exists when it forks), and
    each child exits with `os._exit`, so no handler of the parent runs twice. POSIX only (fork).
    """
    import importlib
    import threading
    import traceback
    from logging import ERROR, INFO, WARNING

    from fedsim.flower import compat as flower_compat

    api = flower_compat.runtime_api()  # Flower's SuperNode runtime, non-public: FlowerCompatError if absent
    log, run_clientapp = api.log, api.run_clientapp

    if not hasattr(os, "fork"):
        raise RuntimeError("the forking executor needs os.fork (Linux, macOS); use flower-superexec instead")
    t0 = time.perf_counter()
    for name in preload:
        importlib.import_module(name)
    if threading.active_count() > 1:  # a preloaded module started a thread: a fork copies it locked or not at all
        log(WARNING, "fedsim executor: %d Python threads after preloading %s; forking may deadlock",
            threading.active_count(), ",".join(preload))
    app_packages = _app_packages()
    certificates = None if runtime_root_cert is None else Path(runtime_root_cert).read_bytes()
    client = api.connect(runtime_api, certificates)
    log(INFO, "fedsim executor: Runtime API %s, %d modules preloaded in %.1f s, polling every %.2f s",
        runtime_api, len(preload), time.perf_counter() - t0, poll_interval)

    executor_pid = os.getpid()

    def on_signal(signum, _frame):  # also interrupts a wait for a SuperNode that is gone (retried forever)
        if os.getpid() != executor_pid:  # a child that has not yet reset its handlers
            os._exit(128 + signum)
        raise _Stop(signum)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    children: dict[int, int] = {}  # pid -> task id
    request = api.acquire_task_request(supported_task_types=[api.client_app_task_type])

    def reap() -> None:
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                task_id = children.pop(pid)
                code = os.waitstatus_to_exitcode(status)
                if code != 0:
                    log(WARNING, "fedsim executor: ClientApp process for task %d exited with %d", task_id, code)

    def run_child(token: str) -> None:
        code = 1
        try:
            for sig in previous:
                signal.signal(sig, signal.SIG_DFL)
            for name in [m for m in sys.modules if m.partition(".")[0] in app_packages]:
                del sys.modules[name]  # the ClientApp comes from the FAB, not from this process
            run_clientapp(runtime_api_address=runtime_api, token=token, insecure=runtime_root_cert is None,
                          certificates=certificates, parent_pid=os.getppid(), runtime_dependency_install=False)
            code = 0
        except SystemExit as ex:  # run_clientapp always ends in flwr_exit -> sys.exit
            code = ex.code if isinstance(ex.code, int) else (0 if ex.code is None else 1)
        except BaseException:  # noqa: BLE001 - report anything, then leave without the parent's cleanup
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)

    try:
        while True:
            reap()
            response = client.AcquireTask(request)
            if response.HasField("task") and response.token:
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    run_child(response.token)  # never returns
                children[pid] = response.task.task_id
                log(INFO, "fedsim executor: task %d -> ClientApp process %d", response.task.task_id, pid)
                continue  # another task may be waiting already
            time.sleep(poll_interval)
    except _Stop:
        pass
    except Exception as ex:  # noqa: BLE001 - e.g. the SuperNode refused us: say so, stop the children
        log(ERROR, "fedsim executor stopped: %r", ex)
        raise
    finally:
        for sig in previous:
            signal.signal(sig, signal.SIG_IGN)  # a second signal must not interrupt the clean-up
        client.close()
        for pid in children:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.time() + 10
        while children and time.time() < deadline:
            reap()
            time.sleep(0.1)
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    log(INFO, "fedsim executor: stopped")
    return 0


