"""Per-round time on Flower's deployment engine, for each way of running the ClientApps.

Run (it waits first for the benchmark lock, benchmarks/bench_lock.py: no other benchmark meanwhile):

    .venv/bin/python benchmarks/deployment_overhead.py \\
        [--configs default,poll,process,fork] [--rounds 4] [--repeat 1] [--trace] [--quiet-wait 600] \\
        [--app-dir DIR] [--no-cache]

Each configuration starts a loopback SuperLink and 3 SuperNodes, `flwr run`s the quickstart
restricted to 3 clients (all sampled every round, client 0 an attacker), and reads the wall time
of every round as the ServerApp measured it (rounds.jsonl). Round 1 includes the first start of
everything, so the mean is over rounds 2..N. The configurations are cumulative:

* `default`: Flower's defaults. Each SuperNode starts its own `flower-superexec`, which polls for
  tasks every 1 s and starts a fresh `flwr-clientapp` process per message.
* `poll`: the same with `FLWR_SUPEREXEC_TASK_POLL_INTERVAL=0.2` on every process (what
  `fedsim deploy` sets).
* `process`: plus `flower-supernode --isolation process` with Flower's `flower-superexec` started
  beside each SuperNode (the engine's own process-isolation mode; still one fresh process per
  message).
* `fork`: plus `--isolation process` with fedsim's forking executor (`fedsim deploy executor`):
  one long-running process per SuperNode imports flwr, torch, numpy once and forks per message.

For reference, the same scenario is also run in this process on an in-process grid (clients one
after another, everything imported and cached): its per-round time is the compute, and
`overhead` = deployment round - in-process round. `--trace` runs the nodes with
`FLWR_LOG_LEVEL=DEBUG` (timestamped logs, slightly slower) and splits each message's time on the
SuperNode: from receiving it to the ClientApp process asking for its input (executor poll,
process start, flwr import), from there to the reply (FAB install, app and torch import, data,
training), and forwarding the reply to the SuperLink; what the round spends beyond the slowest
node is polling (the SuperNode's 3 s pull interval and the ServerApp's 3 s reply poll, both fixed
in flwr 1.41) and the server's own work. `--app-dir` runs another checkout of this project (to
compare versions); `--no-cache` sets FEDSIM_CACHE=0 on every process.

On a shared machine other work is timed as overhead, so before each run the benchmark waits (up
to `--quiet-wait` s) until both cores are under 25% busy, and it prints how busy the machine was
during each run (/proc/stat, the run's own processes included) and how much of it other people's
processes took (from /proc/<pid>/stat of every process outside the run's sessions). Runs where
that exceeds 10% are starred; the table gives the median over `--repeat` runs. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

from fedsim.deploy import commands as deploy  # noqa: E402

OVERRIDES = ["federation.num_clients=3", "federation.clients_per_round=3", "attack.attacker_ids=[0]",
             "attack.schedule={name: every_round}"]


@dataclass(frozen=True)
class Config:
    poll: float                # FLWR_SUPEREXEC_TASK_POLL_INTERVAL on every process
    isolation: str             # flower-supernode --isolation
    executor: str | None       # beside a `process` SuperNode: "flower" (flower-superexec) or "fork" (fedsim's)
    label: str


CONFIGS = {
    "default": Config(1.0, "subprocess", None, "Flower defaults (subprocess isolation, 1 s task poll)"),
    "poll": Config(deploy.FAST_POLL_SECONDS, "subprocess", None, f"+ {deploy.POLL_ENV}={deploy.FAST_POLL_SECONDS}"),
    "process": Config(deploy.FAST_POLL_SECONDS, "process", "flower", "+ --isolation process, flower-superexec per node"),
    "fork": Config(deploy.FAST_POLL_SECONDS, "process", "fork", "+ --isolation process, fedsim forking executor"),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise TimeoutError(f"nothing listens on port {port}")


def cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine, from /proc/stat."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def busy_share(since: tuple[int, int]) -> float:
    busy, total = cpu_times()
    return (busy - since[0]) / max(total - since[1], 1)


def others_cpu(mine: set[int]) -> dict[int, int]:
    """CPU jiffies (user + system) of every process outside the sessions in `mine`, by pid."""
    out = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) not in mine:
            out[int(stat.parent.name)] = int(fields[11]) + int(fields[12])
    return out


def others_share(before: dict[int, int], after: dict[int, int], seconds: float) -> float:
    """Share of both cores used by other people's processes meanwhile (ones that both started and
    ended within the window are missed, so this is a lower bound)."""
    jiffies = sum(t - before.get(pid, 0) for pid, t in after.items() if t >= before.get(pid, 0))
    return jiffies / os.sysconf("SC_CLK_TCK") / seconds / (os.cpu_count() or 1)


def wait_quiet(limit: float) -> float:
    """Wait (up to `limit` s) until the machine is nearly idle: other work would be timed as overhead."""
    deadline = time.time() + limit
    while True:
        start = cpu_times()
        time.sleep(3)
        share = busy_share(start)
        if share < 0.25 or time.time() > deadline:
            return share


def run_config(name: str, cfg: Config, args, tmp: Path) -> dict:
    """One deployment of the scenario; every process started here is killed before returning."""
    env = deploy.deploy_env(tmp / "flwr_home")
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    env["FEDSIM_CACHE_DIR"] = str(tmp / "cache")
    env[deploy.POLL_ENV] = str(cfg.poll)
    if args.no_cache:
        env["FEDSIM_CACHE"] = "0"
    if args.trace:
        env["FLWR_LOG_LEVEL"] = "DEBUG"
    port = free_port()
    procs = []

    def start(cmd, log_name):
        log = open(tmp / f"{log_name}.log", "w")
        procs.append(subprocess.Popen(cmd, env=env, cwd=tmp, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))

    try:
        start(deploy.superlink_cmd(port=port, tls=None, database=tmp / "state.db"), "superlink")
        wait_port(port)
        for i in range(3):
            node = free_port()
            start(deploy.supernode_cmd(i, 3, f"127.0.0.1:{port}", port=node, isolation=cfg.isolation), f"supernode{i}")
            if cfg.executor is not None:
                runtime_api = f"127.0.0.1:{node}"
                cmd = deploy.executor_cmd(runtime_api) if cfg.executor == "fork" else deploy.superexec_cmd(runtime_api)
                start(cmd, f"executor{i}")
        deploy.write_connection(tmp / "flwr_home", "bench", f"127.0.0.1:{port}")
        overrides = OVERRIDES + [f"federation.rounds={args.rounds}"]
        cmd = ["flwr", "run", str(args.app_dir), "bench", "--run-config",
               f'scenario="{args.app_dir / "scenarios/quickstart.yaml"}" overrides="{";".join(overrides)}" '
               f'output-dir="{tmp / "results"}"', "--stream"]
        mine = {os.getsid(0)} | {proc.pid for proc in procs}  # every process started here has its own session
        t0, cpu0, others0 = time.time(), cpu_times(), others_cpu(mine)
        subprocess.run(cmd, env=env, cwd=tmp, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=900)
        total, cpu = time.time() - t0, busy_share(cpu0)
        others = others_share(others0, others_cpu(mine), total)
        found = sorted((tmp / "results").glob("*/rounds.jsonl"))
        if not found:
            raise RuntimeError(f"{name}: no rounds.jsonl; logs in {tmp}")
        rounds = [json.loads(line) for line in found[0].read_text().splitlines()]
    finally:
        for proc in reversed(procs):
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=10)
            except ProcessLookupError:
                pass
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    if len(rounds) != args.rounds:
        raise RuntimeError(f"{name}: {len(rounds)} of {args.rounds} rounds completed; logs in {tmp}")
    out = {"total": total, "cpu": cpu, "others": others, "rounds": [r["wall_seconds"] for r in rounds], "metrics": strip(rounds)}
    if args.trace:
        out["trace"] = trace(tmp)
    return out


def strip(rounds: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "wall_seconds"} for r in rounds]


STAMP = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}):")


PHASES = ("to ClientApp start", "ClientApp (import, data, train)", "reply to SuperLink")


def trace(tmp: Path) -> dict[str, dict[str, float]]:
    """Mean seconds per message on each SuperNode (node i = partition i), from their DEBUG logs.

    A SuperNode handles one message at a time, so its log reads receive -> the ClientApp pulls
    its input -> the ClientApp pushes its reply -> the reply is sent, message after message.
    """
    out = {}
    for i in range(3):
        phases: dict[str, list[float]] = {k: [] for k in PHASES}
        msg: dict[str, float] = {}
        for line in (tmp / f"supernode{i}.log").read_text(errors="replace").splitlines():
            stamp = STAMP.search(re.sub(r"\x1b\[[0-9;]*m", "", line))
            if stamp is None:
                continue
            t = datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            for key, marker in (("recv", "Receiving: train message"), ("start", "Runtime.PullTaskInput"),
                                ("reply", "Runtime.PushMessages"), ("sent", "Sent successfully")):
                if marker in line:
                    if key == "recv":
                        msg = {"recv": t}
                    elif msg and key not in msg:
                        msg[key] = t
            if len(msg) == 4:
                for name, (a, b) in zip(PHASES, (("recv", "start"), ("start", "reply"), ("reply", "sent"))):
                    phases[name].append(msg[b] - msg[a])
                msg = {}
        out[f"node {i}"] = {k: statistics.mean(v) if v else float("nan") for k, v in phases.items()}
    return out


def in_process(args) -> dict:
    """The same scenario on an in-process grid: the compute a round needs, without any engine."""
    import logging

    from fedsim.flower.local_grid import LocalGrid

    from fedsim.client.app import make_client_app
    from fedsim.runs.folder import RunFolder
    from fedsim.runs.results import read_rounds
    from fedsim.scenario import load_scenario
    from fedsim.server.app import run_server

    logging.getLogger("flwr").setLevel(logging.WARNING)
    scenario = load_scenario(args.app_dir / "scenarios/quickstart.yaml", OVERRIDES + [f"federation.rounds={args.rounds}"])
    folder = RunFolder.create(scenario, Path(tempfile.mkdtemp(prefix="fedsim-deploy-bench-local-"))).path
    run_server(LocalGrid(make_client_app(scenario), 3), scenario, folder)
    rounds = read_rounds(folder)
    return {"rounds": [r["wall_seconds"] for r in rounds], "metrics": strip(rounds)}


def mean_later(secs: list[float]) -> float:
    return statistics.mean(secs[1:]) if len(secs) > 1 else secs[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=1, help="run the configurations this many times, interleaved")
    parser.add_argument("--trace", action="store_true", help="DEBUG logs on the nodes and a per-message split")
    parser.add_argument("--quiet-wait", type=float, default=600,
                        help="before each run, wait up to this many seconds for the machine to be <25%% busy")
    parser.add_argument("--app-dir", type=Path, default=REPO)
    parser.add_argument("--no-cache", action="store_true")
    args = parser.parse_args()
    args.app_dir = args.app_dir.resolve()
    names = [n for n in args.configs.split(",") if n]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown or args.rounds < 2:
        parser.error(f"unknown configurations {unknown}" if unknown else "--rounds must be at least 2")

    os.environ.setdefault("FEDSIM_CACHE_DIR", tempfile.mkdtemp(prefix="fedsim-deploy-bench-cache-"))
    if args.no_cache:
        os.environ["FEDSIM_CACHE"] = "0"
    local = in_process(args)
    print(f"in-process grid: per round {', '.join(f'{s:.2f}' for s in local['rounds'])} s", flush=True)

    results: dict[str, list[dict]] = {n: [] for n in names}
    for rep in range(args.repeat):
        for name in names:
            idle = wait_quiet(args.quiet_wait)
            tmp = Path(tempfile.mkdtemp(prefix=f"fedsim-deploy-bench-{name}-"))
            res = run_config(name, CONFIGS[name], args, tmp)
            res["busy_before"] = idle
            res["same_metrics"] = res.pop("metrics") == local["metrics"]
            results[name].append(res)
            print(f"[{rep + 1}/{args.repeat}] {name}: flwr run {res['total']:.1f} s; per round "
                  f"{', '.join(f'{s:.1f}' for s in res['rounds'])} s; metrics as in-process: {res['same_metrics']}; "
                  f"machine busy {100 * idle:.0f}% before, {100 * res['cpu']:.0f}% during, other people's processes "
                  f"{100 * res['others']:.0f}%; logs {tmp}", flush=True)
            if args.trace:
                for node, phases in res["trace"].items():
                    print(f"    {node} per message: " + ", ".join(f"{k} {v:.2f} s" for k, v in phases.items()), flush=True)

    base = mean_later(local["rounds"])
    print(f"\napp {args.app_dir}, cache {'off' if args.no_cache else 'on'}, {args.rounds} rounds, "
          f"{args.repeat} run(s) per configuration, in-process round (rounds 2..{args.rounds}) {base:.2f} s; "
          "median over runs, each run's value in brackets (* = other people's processes used over 10% of the "
          "machine during that run)\n")
    print(f"| configuration | `flwr run` total (s) | per round, rounds 2..{args.rounds} (s) | overhead per round (s) "
          "| machine busy (others) |")
    print("|---|---:|---:|---:|---:|")
    for name in names:
        runs = results[name]
        per_run = [mean_later(r["rounds"]) for r in runs]
        per_round = statistics.median(per_run)
        total = statistics.median(r["total"] for r in runs)
        spread = "" if len(runs) == 1 else " (" + ", ".join(
            f"{v:.1f}{'*' if r['others'] > 0.1 else ''}" for v, r in zip(per_run, runs)) + ")"
        cpu = ", ".join(f"{100 * r['cpu']:.0f}% ({100 * r['others']:.0f}%)" for r in runs)
        print(f"| `{name}`: {CONFIGS[name].label} | {total:.1f} | {per_round:.1f}{spread} | {per_round - base:.1f} "
              f"| {cpu} |")
    if args.trace:
        print("\nper message on the SuperNodes (rounds 1..N), seconds (mean over messages, median over runs); "
              "node 0 is the attacker:\n")
        print("| configuration | node | " + " | ".join(PHASES) + " |")
        print("|---|---|" + "---:|" * len(PHASES))
        for name in names:
            for node in results[name][0]["trace"]:
                vals = [statistics.median(r["trace"][node][k] for r in results[name]) for k in PHASES]
                print(f"| `{name}` | {node} | " + " | ".join(f"{v:.2f}" for v in vals) + " |")


if __name__ == "__main__":
    from bench_lock import bench_lock  # one benchmark at a time (lock in the system's temp folder)

    with bench_lock():
        main()
