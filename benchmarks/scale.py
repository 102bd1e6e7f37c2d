"""Memory and per-round time against the number of *registered* clients (100 / 1,000 / 10,000).

Run: `.venv/bin/python benchmarks/scale.py [--clients 100,1000,10000] [--rounds 5]`
(it waits first for the benchmark lock, benchmarks/bench_lock.py: no two benchmarks time each other).

Each size runs in a fresh child process (MNIST, a 784-32-10 MLP, 100 clients sampled per round, 1
local epoch, central evaluation on the 10,000 test images every round). Every client holds the
same amount of data whatever the number of registered clients (2 label-sorted shards of 3 images:
the `shard` partitioner with shard_size=3), so the work per round is the same in every row and
only the number of registered clients changes. Needs mnist.npz in $FEDSIM_DATA_DIR or
../shared/data.

Printed per size: peak memory of the whole process tree (the simulation's process, Ray's GCS,
raylet and agents, the client actors), as RSS summed over processes (counts shared pages once
per process, so it over-states) and as PSS (shared pages split between the processes that map
them); the median round time over rounds 2.. (round 1 includes the actors' start); time outside
the rounds (start-up and teardown). Nothing is asserted about time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
REPO = _HERE.parent


def data_dir() -> str:
    return os.environ.get("FEDSIM_DATA_DIR") or str(REPO.parent / "shared" / "data")


def scenario_for(num_clients: int, rounds: int, per_round: int):
    from fedsim.scenario import validate_scenario

    return validate_scenario(
        {
            "name": f"scale_{num_clients}",
            "seed": 0,
            "data": {"dataset": "mnist", "dir": data_dir(),
                     "partition": {"name": "shard", "num_shards_per_partition": 2, "shard_size": 3}},
            "model": {"name": "mlp", "hidden": [32]},
            "federation": {"num_clients": num_clients, "clients_per_round": min(per_round, num_clients),
                           "rounds": rounds, "local_epochs": 1, "batch_size": 32, "lr": 0.05},
            "evaluation": {"every": 1},
        },
        f"scale_{num_clients}",
    )


def child(num_clients: int, rounds: int, per_round: int, out: Path) -> None:
    """One simulation in this process; writes its timings to `out`."""
    from fedsim.runs.results import read_rounds
    from fedsim.engine.simulate import simulate

    scenario = scenario_for(num_clients, rounds, per_round)
    with tempfile.TemporaryDirectory(prefix="fedsim-scale-") as tmp:
        t0 = time.perf_counter()
        run_dir = simulate(scenario, run_dir=Path(tmp) / "run")
        wall = time.perf_counter() - t0
        rounds_ = read_rounds(run_dir)
    out.write_text(json.dumps({
        "wall": wall,
        "round_walls": [r["wall_seconds"] for r in rounds_],
        "accuracy": rounds_[-1].get("main_accuracy"),
        "clients_trained": sum(len(r["aggregated"]) for r in rounds_),
    }))


# --- memory of a process tree from /proc ----------------------------------------------------------
def tree(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def memory_kib(pid: int) -> tuple[int, int]:
    """(RSS, PSS) of one process in KiB; (0, 0) if it is gone."""
    rss = pss = 0
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Rss:"):
                rss = int(line.split()[1])
            elif line.startswith("Pss:"):
                pss = int(line.split()[1])
    except (OSError, ValueError):
        pass
    return rss, pss


def measure(num_clients: int, rounds: int, per_round: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="fedsim-scale-out-") as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, __file__, "--child", str(num_clients), "--rounds", str(rounds),
               "--per-round", str(per_round), "--out", str(out)]
        proc = subprocess.Popen(cmd)
        peak_rss = peak_pss = 0
        while proc.poll() is None:
            rss = pss = 0
            for pid in tree(proc.pid):
                r, p = memory_kib(pid)
                rss, pss = rss + r, pss + p
            peak_rss, peak_pss = max(peak_rss, rss), max(peak_pss, pss)
            time.sleep(0.5)
        if proc.returncode != 0:
            raise SystemExit(f"the {num_clients}-client run failed (exit {proc.returncode})")
        result = json.loads(out.read_text())
    result.update(clients=num_clients, peak_rss_gib=peak_rss / 1024**2, peak_pss_gib=peak_pss / 1024**2)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", default="100,1000,10000", help="registered clients per run, comma-separated")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--per-round", type=int, default=100)
    parser.add_argument("--json", type=Path, default=None, help="also write the raw numbers to this file")
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        child(args.child, args.rounds, args.per_round, args.out)
        return
    print(f"{args.per_round} clients sampled per round, {args.rounds} rounds, MLP 784-32-10 on MNIST, "
          "6 images per client\n")
    print("| registered clients | peak RSS, process tree (GiB) | peak PSS (GiB) | round time, median of rounds 2.. (s) "
          "| round 1 (s) | outside rounds (s) | total (s) |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    results = []
    for n in (int(v) for v in args.clients.split(",")):
        r = measure(n, args.rounds, args.per_round)
        results.append(r)
        walls = r["round_walls"]
        later = statistics.median(walls[1:]) if len(walls) > 1 else float("nan")
        print(f"| {n:,} | {r['peak_rss_gib']:.2f} | {r['peak_pss_gib']:.2f} | {later:.2f} | {walls[0]:.2f} "
              f"| {r['wall'] - sum(walls):.1f} | {r['wall']:.1f} |", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    from bench_lock import bench_lock  # one benchmark at a time (lock in the system's temp folder)

    with bench_lock():
        main()
