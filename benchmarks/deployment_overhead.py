"""Per-round time on Flower's deployment engine: a loopback SuperLink and 3 SuperNodes.

Run: `.venv/bin/python benchmarks/deployment_overhead.py [--app-dir DIR] [--rounds 4] [--no-cache]`.
Prints the wall time of each round as the ServerApp measured it (rounds.jsonl) and the mean over
rounds 2.. (round 1 includes the nodes' first start). `--app-dir` points at another checkout of
this project to compare versions; `--no-cache` sets FEDSIM_CACHE=0 on every process.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fedsim import deploy  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--app-dir", type=Path, default=REPO)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--no-cache", action="store_true")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="fedsim-deploy-bench-"))
    env = deploy.deploy_env(tmp / "flwr_home")
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    env["FEDSIM_CACHE_DIR"] = str(tmp / "cache")
    if args.no_cache:
        env["FEDSIM_CACHE"] = "0"
    port = free_port()
    procs = []

    def start(cmd, name):
        log = open(tmp / f"{name}.log", "w")
        procs.append(subprocess.Popen(cmd, env=env, cwd=tmp, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))

    try:
        start(deploy.superlink_cmd(port=port, tls=None, database=tmp / "state.db"), "superlink")
        time.sleep(3)
        for i in range(3):
            start(deploy.supernode_cmd(i, 3, f"127.0.0.1:{port}", port=free_port()), f"supernode{i}")
        deploy.write_connection(tmp / "flwr_home", "bench", f"127.0.0.1:{port}")
        overrides = ["federation.num_clients=3", "federation.clients_per_round=3", f"federation.rounds={args.rounds}",
                     "attack.attacker_ids=[0]", "attack.schedule={name: every_round}"]
        cmd = ["flwr", "run", str(args.app_dir), "bench", "--run-config",
               f'scenario="{args.app_dir / "scenarios/quickstart.yaml"}" overrides="{";".join(overrides)}" '
               f'output-dir="{tmp / "results"}"', "--stream"]
        t0 = time.time()
        subprocess.run(cmd, env=env, cwd=tmp, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=900)
        total = time.time() - t0
        run = next((tmp / "results").glob("*/rounds.jsonl"))
        rounds = [json.loads(line) for line in run.read_text().splitlines()]
        secs = [r["wall_seconds"] for r in rounds]
        print(f"app {args.app_dir}, cache {'off' if args.no_cache else 'on'}: flwr run {total:.1f} s for {args.rounds} rounds")
        print("per round (s): " + ", ".join(f"{s:.1f}" for s in secs))
        print(f"mean of rounds 2..{args.rounds}: {sum(secs[1:]) / len(secs[1:]):.1f} s")
    finally:
        for proc in reversed(procs):
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=10)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                os.killpg(proc.pid, signal.SIGKILL)


if __name__ == "__main__":
    main()
