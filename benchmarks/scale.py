"""What registered clients that are not sampled cost: 10,000 / 100,000 / 1,000,000 registered, 1,000 a round.

Run: `FEDSIM_DATA_DIR=../shared/data .venv/bin/python benchmarks/scale.py [--clients 10000,100000,1000000]
[--partitions dirichlet,natural] [--rounds 2] [--per-round 1000]` (it waits first for the benchmark
lock, benchmarks/bench_lock.py: no two benchmarks time each other).

Each (partition, registered count) runs in a fresh child process that calls `simulate`; the
parent samples the child's whole process tree (the simulation, Ray's GCS, raylet and agents, the
client actors) from /proc every 0.2 s. Per row it prints only what it measured:

* before round 1: seconds from the child's start (its `Popen`) to round 1's opening (the driver's
  sampling); the start-up: imports, the scenario, the partition (computed: every run has a fresh
  partition cache), Ray and its actors start meanwhile;
* round 1 ends: seconds from the child's start to round 1's line in rounds.jsonl (evaluated);
* peak RSS of the process tree (GiB, summed over processes: shared pages count once per process,
  so it over-states) and peak PSS (shared pages split between the processes that map them);
* `ok` when round 1 ended within 60 s and the peak RSS stayed under 8 GiB (issue #34's target).

The rounds: `min(per-round, registered)` clients sampled, 1 local epoch, batch 32, central
evaluation every round.

* `dirichlet`: MNIST (mnist.npz in $FEDSIM_DATA_DIR or ../shared/data), Dirichlet(0.5) label
  skew with `min_partition_size: 0`, a 784-64-10 MLP. 60,000 images over N clients: at 1,000,000
  clients 94% hold no image (fedsim/data/partition.py says what that means).
* `natural`: a synthetic LEAF Shakespeare the script writes into its temp folder (one JSON line
  per speaking role: N roles with one 80-character line each, plus 2,000 test lines), the
  `natural` partitioner (one role per client) and a 1-layer character LSTM (embedding 8, hidden
  64). The text is random, the next character the line's last: it measures cost, not learning.

Both datasets are decoded once into the script's own cache folder before the timed runs (the
seconds are printed apart), as a second run of any scenario finds them; partitions are not cached
between runs. Nothing is asserted: what the numbers mean is in docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

_HERE = Path(__file__).resolve().parent
REPO = _HERE.parent
TARGET_SECONDS, TARGET_GIB = 60.0, 8.0


def data_dir() -> str:
    return os.environ.get("FEDSIM_DATA_DIR") or str(REPO.parent / "shared" / "data")


# --- the scenarios ----------------------------------------------------------------------------------
def scenario_for(partition: str, num_clients: int, rounds: int, per_round: int, folder: Path):
    from fedsim.scenario import validate_scenario

    fed = {"num_clients": num_clients, "clients_per_round": min(per_round, num_clients), "rounds": rounds,
           "local_epochs": 1, "batch_size": 32, "lr": 0.05}
    if partition == "dirichlet":
        data = {"dataset": "mnist", "dir": data_dir(),
                "partition": {"name": "dirichlet", "alpha": 0.5, "min_partition_size": 0}}
        model = {"name": "mlp", "hidden": [64]}
    elif partition == "natural":
        data = {"dataset": "shakespeare", "dir": str(shakespeare_dir(folder, num_clients)), "partition": {"name": "natural"}}
        model = {"name": "char_lstm", "embed_dim": 8, "hidden": 64, "layers": 1}
    else:
        raise SystemExit(f"unknown partition {partition!r}: dirichlet or natural")
    name = f"scale_{partition}_{num_clients}"
    return validate_scenario({"name": name, "seed": 0, "data": data, "model": model, "federation": fed,
                              "evaluation": {"every": 1}}, name)


def shakespeare_dir(folder: Path, roles: int) -> Path:
    return folder / f"shakespeare-{roles}"


def write_shakespeare(root: Path, roles: int, test: int = 2000, per_file: int = 100_000, seed: int = 0) -> None:
    """LEAF's layout (fedsim/data/leaf.py): `roles` users with one 80-character line each, the
    target being the line's last character; `test` more lines for the central evaluation."""
    from fedsim.data.leaf import SHAKESPEARE_VOCAB

    rng = np.random.default_rng(seed)
    vocab = np.frombuffer(SHAKESPEARE_VOCAB[1:].encode(), dtype=np.uint8)  # no newline inside a line
    for split, n in (("train", roles), ("test", test)):
        (root / "shakespeare" / split).mkdir(parents=True, exist_ok=True)
        lines = vocab[rng.integers(0, len(vocab), size=(n, 80))].view("S80").ravel()
        for start in range(0, n, per_file):
            names = [f"role{i:07d}" for i in range(start, min(n, start + per_file))]
            data = {name: {"x": [line.decode()], "y": [chr(line[-1])]} for name, line in zip(names, lines[start:])}
            with open(root / "shakespeare" / split / f"part{start // per_file:03d}.json", "w") as f:
                json.dump({"users": names, "num_samples": [1] * len(names), "user_data": data}, f)


def prepare(partitions: list[str], clients: list[int], rounds: int, per_round: int, folder: Path) -> dict[str, float]:
    """Write the synthetic datasets and decode every dataset once into the cache (in this process:
    FEDSIM_CACHE_DIR is already the script's own); seconds per dataset."""
    from fedsim.runtime import Runtime

    seconds = {}
    for partition in partitions:
        for n in clients if partition == "natural" else clients[:1]:
            started = time.perf_counter()
            if partition == "natural":
                write_shakespeare(shakespeare_dir(folder, n), n)
            Runtime(scenario_for(partition, n, rounds, per_round, folder)).data  # noqa: B018  (decodes and caches)
            seconds[f"{partition} {n:,}" if partition == "natural" else partition] = time.perf_counter() - started
    return seconds


# --- one run, in a child process ------------------------------------------------------------------
def child(partition: str, num_clients: int, rounds: int, per_round: int, folder: Path, out: Path) -> None:
    from fedsim.engine.simulate import simulate
    from fedsim.runs.results import read_rounds

    scenario = scenario_for(partition, num_clients, rounds, per_round, folder)
    lines_at = {}

    def progress(record: dict) -> None:
        lines_at.setdefault(record["round"], time.time())

    with tempfile.TemporaryDirectory(prefix="fedsim-scale-run-") as tmp:
        run_dir = simulate(scenario, run_dir=Path(tmp) / "run", progress=progress)
        rounds_ = read_rounds(run_dir)
    first = next(r for r in rounds_ if r["round"] == 1)
    out.write_text(json.dumps({
        "round1_line_at": lines_at[1], "round1_wall": first["wall_seconds"],
        "round_walls": [r["wall_seconds"] for r in rounds_ if r["round"] > 0],
        "clients_trained": len(first.get("aggregated") or []),
        "accuracy": rounds_[-1].get("main_accuracy"), "ended_at": time.time(),
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


def measure(partition: str, num_clients: int, rounds: int, per_round: int, folder: Path) -> dict:
    out = folder / f"result-{partition}-{num_clients}.json"
    cmd = [sys.executable, __file__, "--child", partition, str(num_clients), "--rounds", str(rounds),
           "--per-round", str(per_round), "--folder", str(folder), "--out", str(out)]
    started = time.time()
    proc = subprocess.Popen(cmd)
    peak_rss = peak_pss = 0
    while proc.poll() is None:
        rss = pss = 0
        for pid in tree(proc.pid):
            r, p = memory_kib(pid)
            rss, pss = rss + r, pss + p
        peak_rss, peak_pss = max(peak_rss, rss), max(peak_pss, pss)
        time.sleep(0.2)
    if proc.returncode != 0:
        raise SystemExit(f"the {partition} run with {num_clients} clients failed (exit {proc.returncode})")
    r = json.loads(out.read_text())
    round1_end = r["round1_line_at"] - started
    return {"partition": partition, "clients": num_clients, "per_round": min(per_round, num_clients),
            "before_round1_s": round1_end - r["round1_wall"], "round1_end_s": round1_end,
            "total_s": r["ended_at"] - started, "round_walls": r["round_walls"], "clients_trained": r["clients_trained"],
            "peak_rss_gib": peak_rss / 1024**2, "peak_pss_gib": peak_pss / 1024**2,
            "ok": round1_end < TARGET_SECONDS and peak_rss / 1024**2 < TARGET_GIB}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", default="10000,100000,1000000", help="registered clients per run, comma-separated")
    parser.add_argument("--partitions", default="dirichlet,natural", help="dirichlet, natural or both")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--per-round", type=int, default=1000)
    parser.add_argument("--json", type=Path, default=None, help="also write the raw numbers to this file")
    parser.add_argument("--child", nargs=2, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--folder", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        child(args.child[0], int(args.child[1]), args.rounds, args.per_round, args.folder, args.out)
        return
    clients = [int(v) for v in args.clients.split(",")]
    partitions = args.partitions.split(",")
    with tempfile.TemporaryDirectory(prefix="fedsim-scale-") as tmp:
        folder = Path(tmp)
        os.environ["FEDSIM_CACHE_DIR"] = str(folder / "cache")  # this process's and the children's
        prepared = prepare(partitions, clients, args.rounds, args.per_round, folder)
        print(f"{os.cpu_count()} cores; {args.rounds} rounds; datasets decoded into the cache first: "
              + ", ".join(f"{k} {v:.1f} s" for k, v in prepared.items()) + "\n")
        print("| partition | registered | sampled a round | before round 1 (s) | round 1 ends (s) "
              "| peak RSS, tree (GiB) | peak PSS (GiB) | round 2 (s) | < 60 s and < 8 GiB |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
        results = []
        for partition in partitions:
            for n in clients:
                r = measure(partition, n, args.rounds, args.per_round, folder)
                results.append(r)
                later = f"{r['round_walls'][1]:.1f}" if len(r["round_walls"]) > 1 else "-"
                print(f"| {partition} | {n:,} | {r['per_round']:,} | {r['before_round1_s']:.1f} | {r['round1_end_s']:.1f} "
                      f"| {r['peak_rss_gib']:.2f} | {r['peak_pss_gib']:.2f} | {later} | {'ok' if r['ok'] else 'missed'} |",
                      flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    if "--child" in sys.argv:
        main()
    else:
        from bench_lock import bench_lock  # one benchmark at a time (lock in the system's temp folder)

        with bench_lock():
            main()
