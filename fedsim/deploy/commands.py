"""Real deployment on Flower's deployment engine: a SuperLink, SuperNodes on devices, `flwr run`.

Most helpers here only build the standard Flower command lines (printed by `fedsim deploy ... --dry-run`)
and the connection entry `flwr run` needs; the ServerApp and ClientApp are the very ones the
simulation runs. `fedsim deploy run` ships the Flower app of the current directory (or `--app`)
with the scenario inside it, named relative to the app directory (`find_app_dir`, `scenario_in_app`).
Security: TLS with SuperNode authentication unless `--insecure` is given, which is meant for
loopback tests only.

Speed (see docs/deployment.md, "Cost per round"): in flwr 1.41 every message a SuperNode receives
runs in a fresh `flwr-clientapp` process, whatever the isolation mode, and that process spends
seconds importing flwr and torch before the ClientApp starts. `serve_clientapps` is an executor
for `flower-supernode --isolation process` that pays those imports once: it is a long-running
process that asks the SuperNode's Runtime API for tasks the way `flower-superexec` does, and
forks a child per message that runs Flower's own `run_clientapp` (fedsim/deploy/executor.py).
One process per message is kept (crash isolation, memory returned after every message); only
the start-up is shared.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

# The folder above this package: fedsim's source tree (a Flower app: pyproject.toml) when fedsim
# runs from a checkout or from a FAB, site-packages after a regular install (no app there).
SOURCE_TREE = Path(__file__).resolve().parents[2]
# What `fedsim deploy run` passes in `--run-config`: these keys must exist in the app's
# [tool.flwr.app.config] (flwr refuses unknown keys).
RUN_CONFIG_KEYS = ("scenario", "overrides", "output-dir")
# Passed only by `fedsim deploy run --resume DIR` (so an app that lacks it still runs fresh):
# the run folder, on the ServerApp's machine, that the ServerApp continues.
RESUME_KEY = "resume-dir"
# The scenario travels in the FAB, which ships only some file types (flwr 1.41: py, toml, md,
# yaml/yml, json/jsonl, LICENSE); a scenario is YAML.
SCENARIO_SUFFIXES = (".yaml", ".yml")
QUIET_ENV = {
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",  # never `uv sync` a different torch at run time
}
# How often `flower-superexec` asks its Runtime API for a new task (flwr 1.41 reads this variable;
# its default is 1 s). The SuperNode's superexec launches every ClientApp, the SuperLink's launches
# the ServerApp, so 1 s is added to every message on average 0.5 s. A poll is one loopback request.
POLL_ENV = "FLWR_SUPEREXEC_TASK_POLL_INTERVAL"
FAST_POLL_SECONDS = 0.2
# Imported once by `serve_clientapps` before it forks: what every fedsim ClientApp process imports
# anyway. Only third-party modules: the app's own code must come from the FAB in each child.
# Not torch._dynamo: fedsim's training no longer creates a torch.optim optimizer, which imported it.
# Not scikit-learn: importing it starts threads, and a process with threads should not fork.
PRELOAD = ("torch", "numpy", "pydantic", "yaml")


@dataclass(frozen=True)
class Tls:
    """Certificates for a TLS SuperLink: the CA that signed the server certificate, and that certificate."""

    ca_cert: Path
    server_cert: Path | None = None
    server_key: Path | None = None


def superlink_cmd(host: str = "127.0.0.1", port: int = 8000, tls: Tls | None = None, auth: bool = True,
                  database: Path | None = None, health_address: str | None = None) -> list[str]:
    """`health_address`: where Flower's gRPC health service listens (`--health-server-address`, no TLS)."""
    cmd = ["flower-superlink", "--host", host, "--port", str(port), "--disable-runtime-dependency-installation"]
    if tls is None:
        cmd.append("--insecure")
    else:
        cmd += ["--ssl-ca-certfile", str(tls.ca_cert), "--ssl-certfile", str(tls.server_cert), "--ssl-keyfile", str(tls.server_key)]
        if auth:
            cmd.append("--enable-supernode-auth")
    if database is not None:
        cmd += ["--database", str(database)]
    if health_address is not None:
        cmd += ["--health-server-address", health_address]
    return cmd


def node_port(partition: int, port: int | None = None) -> int:
    """A SuperNode's local Runtime API port: 9094 + partition unless given (must differ per node on one host)."""
    return port if port is not None else 9094 + partition


def supernode_cmd(partition: int, num_partitions: int, superlink: str = "127.0.0.1:8000", port: int | None = None,
                  root_cert: Path | None = None, auth_key: Path | None = None, data_dir: Path | None = None,
                  max_retries: int | None = None, isolation: str = "subprocess", state_dir: Path | None = None,
                  health_address: str | None = None, local_data: Path | None = None) -> list[str]:
    """A SuperNode holding partition `partition` of `num_partitions` (its node config).

    `local_data`: the device's own training set (an image folder, .npz/.npy or CSV; node config
    `local-data`, docs/local_data.md), used instead of its partition of the central dataset;
    `data_dir`: the device's data folder; `state_dir`: where its ClientApp keeps its memory
    between rounds (error feedback), on the device's own disk, so a restarted device continues.
    `health_address`: where Flower's gRPC health service listens (`--health-server-address`, no
    TLS; without it none is started), for a supervisor's liveness probe.

    `isolation="process"` makes the SuperNode start no executor of its own: one must be started
    next to it against its Runtime API (`superexec_cmd` or `executor_cmd`).
    """
    if isolation not in ("subprocess", "process"):
        raise ValueError(f"isolation must be 'subprocess' or 'process', not {isolation!r}")
    node_config = f"partition-id={partition} num-partitions={num_partitions}"
    if data_dir is not None:
        node_config += f' data-dir="{data_dir}"'
    if state_dir is not None:
        node_config += f' state-dir="{state_dir}"'
    if local_data is not None:
        node_config += f' local-data="{local_data}"'
    cmd = ["flower-supernode", "--superlink", superlink, "--port", str(node_port(partition, port)),
           "--node-config", node_config]
    if isolation == "process":
        cmd += ["--isolation", "process"]
    cmd += ["--insecure"] if root_cert is None else ["--root-certificates", str(root_cert)]
    if auth_key is not None:
        cmd += ["--auth-supernode-private-key", str(auth_key)]
    if max_retries is not None:
        cmd += ["--max-retries", str(max_retries)]
    if health_address is not None:
        cmd += ["--health-server-address", health_address]
    return cmd


def connection_entry(name: str, address: str, root_cert: Path | None = None) -> str:
    """The `[superlink.<name>]` table of `$FLWR_HOME/config.toml` through which `flwr run` finds a SuperLink."""
    if not re.fullmatch(r"[A-Za-z0-9_-]+", name):
        raise ValueError(f"connection name {name!r} must be letters, digits, '-' or '_'")
    entry = f'[superlink.{name}]\naddress = "{address}"\n'
    return entry + ("insecure = true\n" if root_cert is None else f'root-certificates = "{Path(root_cert).resolve()}"\n')


def write_connection(flwr_home: Path, name: str, address: str, root_cert: Path | None = None) -> Path:
    """Add (or replace) `[superlink.<name>]` in `$FLWR_HOME/config.toml`, the way `flwr run` finds a SuperLink."""
    entry = connection_entry(name, address, root_cert)
    path = Path(flwr_home) / "config.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    text = path.read_text() if path.exists() else ""
    text = re.sub(rf"(?ms)^\[superlink\.{name}\]\n.*?(?=^\[|\Z)", "", text).rstrip()
    path.write_text((text + "\n\n" + entry).lstrip())
    return path


class DeployError(ValueError):
    """`fedsim deploy` was asked for something it cannot do; the message says what to pass instead."""


def flower_app_config(directory: Path) -> dict | None:
    """`[tool.flwr.app]` of `directory/pyproject.toml`, or None when there is no such table."""
    path = Path(directory) / "pyproject.toml"
    if not path.is_file():
        return None
    try:
        config = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError, OSError) as err:
        raise DeployError(f"{path} cannot be read as TOML: {err}") from None
    app = config.get("tool", {}).get("flwr", {}).get("app")
    return app if isinstance(app, dict) else None


def source_app_dir() -> Path | None:
    """fedsim's own source tree when it is a Flower app (a checkout, an editable install, a FAB)."""
    return SOURCE_TREE if flower_app_config(SOURCE_TREE) is not None else None


def find_app_dir(app: Path | None = None, cwd: Path | None = None, resume: bool = False) -> Path:
    """The Flower app `flwr run` builds into a FAB and ships: `app` when given, else the current
    directory. It must hold a pyproject.toml with [tool.flwr.app] whose [tool.flwr.app.config]
    declares the run config keys fedsim passes (RUN_CONFIG_KEYS, and RESUME_KEY with `resume`)."""
    where = Path(app) if app is not None else Path(cwd if cwd is not None else Path.cwd())
    config = flower_app_config(where)
    if config is None:
        source = source_app_dir()
        hint = f" (fedsim's source tree is one: --app {source})" if source is not None else ""
        given = f"--app {where}" if app is not None else f"the current directory {where.resolve()}"
        raise DeployError(f"{given} holds no Flower app (a pyproject.toml with [tool.flwr.app]); run "
                          f"`fedsim deploy run` from the app's directory or pass --app DIR{hint}")
    declared = config.get("config") if isinstance(config.get("config"), dict) else {}
    missing = [k for k in RUN_CONFIG_KEYS + ((RESUME_KEY,) if resume else ()) if k not in declared]
    if missing:
        raise DeployError(f"{where.resolve() / 'pyproject.toml'}: [tool.flwr.app.config] lacks {', '.join(missing)}; "
                          f"flwr run refuses run config keys the app does not declare. Add: "
                          + "; ".join(f'{k} = ""' for k in missing))
    return where.resolve()


def scenario_in_app(scenario: Path, app_dir: Path, cwd: Path | None = None) -> str:
    """The scenario's path relative to the app directory (POSIX), as the run config names it.

    The scenario travels inside the FAB; the SuperLink's ServerApp and the SuperNodes' ClientApps
    find it relative to where the FAB was unpacked on their machine (fedsim/deploy/run_config.py).
    A relative `scenario` is taken from the current directory, else from the app directory. A file
    outside the app directory is refused rather than copied into it: `flwr run` builds the FAB from
    the directory as it is on disk, so a copy would be a file written into the user's project.
    """
    app_dir = Path(app_dir).resolve()
    given = Path(scenario)
    here = Path(cwd) if cwd is not None else Path.cwd()
    candidates = [given] if given.is_absolute() else [here / given, app_dir / given]
    found = next((c.resolve() for c in candidates if c.is_file()), None)
    if found is None:
        raise DeployError(f"scenario {given}: no such file (looked for {', '.join(str(c) for c in candidates)})")
    if not found.is_relative_to(app_dir):
        raise DeployError(f"scenario {found} lies outside the app directory {app_dir}: only the app's files travel "
                          f"to the SuperLink (the FAB). Put the scenario under {app_dir} (e.g. {app_dir / 'scenarios'}) "
                          "and pass that path, or pass --app with a directory that holds it")
    if found.suffix not in SCENARIO_SUFFIXES:
        raise DeployError(f"scenario {found}: the FAB carries a scenario only as a .yaml/.yml file; name it *.yaml")
    return str(PurePosixPath(*found.relative_to(app_dir).parts))


def run_config(scenario: str, overrides: list[str] | None = None, output_dir: str | Path | None = None,
               resume_dir: str | Path | None = None) -> str:
    """The `--run-config` of a fedsim run: the scenario (relative to the app directory), the
    `--set` overrides, and the output folder, which is a path on the ServerApp's machine and
    passed as given (a relative one is relative to the directory its SuperLink was started in).
    `resume_dir`: the run folder (on the ServerApp's machine) to continue instead of a new one."""
    joined = ";".join(overrides or []).replace('"', "'")
    config = f'scenario="{scenario}" overrides="{joined}"'
    if output_dir is not None:
        config += f' output-dir="{output_dir}"'
    if resume_dir is not None:
        config += f' {RESUME_KEY}="{resume_dir}"'
    return config


def run_cmd(connection: str, scenario: Path | str, overrides: list[str] | None = None, output_dir: Path | None = None,
            stream: bool = True, app_dir: Path | None = None, resume_dir: str | Path | None = None,
            in_app: bool = False) -> list[str]:
    """`flwr run` of the Flower app at `app_dir` (default: fedsim's source tree) against a
    connection, with the scenario (a file inside the app directory) chosen by run config.
    `in_app`: `scenario` is already the path relative to the app directory (what a run folder's
    run_config.json records), not a file to look for from here. `resume_dir`: see `run_config`."""
    if app_dir is None:
        app_dir = source_app_dir()
        if app_dir is None:
            raise DeployError(f"fedsim at {SOURCE_TREE} is not a source tree: name the Flower app directory")
    app_dir = find_app_dir(app_dir, resume=resume_dir is not None)
    name = str(scenario) if in_app else scenario_in_app(Path(scenario), app_dir)
    config = run_config(name, overrides, output_dir, resume_dir)
    cmd = ["flwr", "run", str(app_dir), connection, "--run-config", config]
    return cmd + (["--stream"] if stream else [])


def resume_target(run_dir: str | Path) -> str:
    """The run folder `--resume` names, as the run config passes it to the ServerApp: absolute when
    it lies on this machine (the ServerApp's machine, run from anywhere), else as given."""
    path = Path(run_dir)
    return str(path.resolve()) if path.exists() else str(run_dir)


def resumable(scenario) -> None:
    """DeployError unless a deployed run of `scenario` can be resumed (the ServerApp checks the same
    again, with the run folder: fedsim/deploy/run_config.py: resumed_folder)."""
    from fedsim.clock.asynchrony import ASYNCHRONOUS

    if not scenario.output.checkpoints:
        raise DeployError("the scenario has output.checkpoints off: its runs keep no checkpoint to resume from")
    systems = scenario.systems
    if systems is not None and isinstance(systems.round, ASYNCHRONOUS):
        raise DeployError(f"an asynchronous round (systems.round={systems.round.name}) cannot resume on a SuperLink: "
                          "its messages in flight were the link's and are gone; start the run again")


def run_and_check(cmd: list[str], connection: str, env: dict[str, str]) -> int:
    """Run `flwr run ... --stream` (its output passed through), then ask the SuperLink how the run
    ended: flwr 1.41's `flwr run` exits 0 whatever became of the run, so a ServerApp that failed
    (e.g. every round skipped) would look like a success. Exit 1 unless the run completed."""
    import json

    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    run_id = folder = None
    for line in proc.stdout:
        sys.stdout.write(line)
        sys.stdout.flush()
        found = re.search(r"started run (\d+)", line)
        if found and run_id is None:
            run_id = found.group(1)
        found = re.search(r"fedsim: run folder (.+) \(on this machine\)", line)
        if found:
            folder = found.group(1).strip()
    code = proc.wait()
    if code != 0 or run_id is None:
        resume_hint(folder)
        return code or 1
    ls = subprocess.run(["flwr", "ls", connection, "--run-id", run_id, "--format", "json"], env=env,
                        capture_output=True, text=True)
    try:
        status = json.loads(ls.stdout)["runs"][0]["status"]
    except (ValueError, KeyError, IndexError, TypeError):
        print(f"could not read the status of run {run_id}: {ls.stdout[-500:]}{ls.stderr[-500:]}", file=sys.stderr)
        resume_hint(folder)
        return 1
    if not status.endswith(":completed"):
        print(f"run {run_id} ended {status}; see the log above or `flwr log {run_id} {connection}`", file=sys.stderr)
        resume_hint(folder)
        return 1
    return 0


def resume_hint(folder: str | None) -> None:
    """After a deployed run that did not complete: how to continue it, when its run folder (named
    by the ServerApp's log) may be resumed. Nothing when the run wrote its summary (it ended: a run
    whose every round was skipped fails, and resuming would only reload its checkpoint) or when it
    keeps no checkpoints. A folder this machine cannot see (the ServerApp's machine is another)
    gets the hint as well, to be run there."""
    if folder is None:
        return
    path = Path(folder)
    if (path / "summary.json").exists():
        return
    if (path / "scenario.yaml").is_file():
        import yaml

        try:
            keeps = (yaml.safe_load((path / "scenario.yaml").read_text()).get("output") or {}).get("checkpoints", True)
        except (OSError, yaml.YAMLError, AttributeError):
            keeps = True
        if not keeps:
            print(f"the run's folder is {path} (output.checkpoints is off: it cannot be resumed)", file=sys.stderr)
            return
    where = "" if path.exists() else " (on the ServerApp's machine)"
    print(f"the run did not complete; its rounds so far are in {path}{where}. Continue it with: "
          f"fedsim deploy run --resume {path}", file=sys.stderr)


def deploy_env(flwr_home: Path | None = None) -> dict[str, str]:
    """The environment of every Flower process fedsim starts: quiet, offline, and a 0.2 s task poll.

    A `FLWR_SUPEREXEC_TASK_POLL_INTERVAL` already in the environment is kept (set it to 1 for
    Flower's default).
    """
    env = dict(os.environ, **QUIET_ENV)
    env.setdefault(POLL_ENV, str(FAST_POLL_SECONDS))
    if flwr_home is not None:
        env["FLWR_HOME"] = str(flwr_home)
    return env


# --- `--isolation process`: the executor next to the SuperNode ------------------------------------

def superexec_cmd(runtime_api: str, runtime_root_cert: Path | None = None) -> list[str]:
    """Flower's own executor for a `--isolation process` SuperNode.

    It does what the SuperNode does itself in the default `subprocess` mode: poll the Runtime API
    and start a fresh `flwr-clientapp` process per message (which imports flwr, torch and the app).
    The Runtime API is plain HTTP unless the SuperNode was given `--ssl-*` options.
    """
    cmd = ["flower-superexec", "--runtime-api-address", runtime_api]
    return cmd + (["--insecure"] if runtime_root_cert is None else ["--root-certificates", str(runtime_root_cert)])


def executor_cmd(runtime_api: str, runtime_root_cert: Path | None = None, poll_interval: float = FAST_POLL_SECONDS,
                 preload: Sequence[str] = PRELOAD) -> list[str]:
    """fedsim's forking executor (`serve_clientapps`) as a command, the drop-in for `superexec_cmd`."""
    cmd = [sys.executable, "-m", "fedsim.cli", "deploy", "executor", "--runtime-api", runtime_api,
           "--poll-interval", str(poll_interval), "--preload", ",".join(preload)]
    if runtime_root_cert is not None:
        cmd += ["--runtime-root-cert", str(runtime_root_cert)]
    return cmd


def supervise(commands: Sequence[list[str]], env: dict[str, str] | None = None) -> int:
    """Run `commands` side by side (a SuperNode and its executor) as one unit.

    When one exits, or this process gets SIGTERM/SIGINT, the others are stopped (SIGTERM, then
    SIGKILL after 10 s), so a node never runs without its executor or the other way round.
    Returns the exit code of the first that ended on its own, or 0 when asked to stop.
    """
    stop: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, _frame: stop.append(signum)) for sig in (signal.SIGTERM, signal.SIGINT)}
    procs = [subprocess.Popen(cmd, env=env) for cmd in commands]
    code = 0
    try:
        while not stop:
            ended = [p for p in procs if p.poll() is not None]
            if ended:
                code = ended[0].returncode
                print(f"fedsim deploy: {ended[0].args[0]} exited with {code}; stopping the rest", file=sys.stderr)
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return code
