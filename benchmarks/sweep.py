"""A 12-run grid through `fedsim sweep` against the same 12 runs as plain loops in one process.

Run: `.venv/bin/python benchmarks/sweep.py [--only digits|mnist]
[--jobs 2] [--mnist-rounds 10] [--repeat N]` (it waits first for the benchmark lock, benchmarks/bench_lock.py:
no two benchmarks time each other).

Two grids of 12 runs, each 6 seeds x the edge-case attacker on or off:

* `digits`: the quickstart (scenarios/quickstart.yaml: 20 clients, 10 per round, 15 rounds), the
  size where a run's start-up (Ray, actors importing torch) used to be most of its time;
* `mnist`: benchmarks/overhead.py's MNIST scenario (LeNet, 200 clients, 10 per round, 2 local
  epochs, ARDIS attacker, full evaluation every round), `--mnist-rounds` rounds.

Each side runs in a fresh Python process started here, as a user would start it: `fedsim sweep FILE
--jobs N` (one Ray engine for the grid, N runs in flight, fedsim/engine/shared.py), and one process
that runs the 12 scenarios one after another through benchmarks/overhead.py's plain loop (data
loaded by fedsim's loaders, FedAvg, the same central evaluation; torch's default threads). The
sweep's wall time includes its start (imports, Ray), its report and its exit; the plain side's
includes its imports. Printed per grid: both wall times, the ratio sweep / plain, the machine's
busy cores meanwhile (above the side's own use: someone else was running), and the mean
final main accuracy of each side (close, not bit-equal: the plain loop trains on two threads).
`--repeat` interleaves the sides and prints every pair and the median ratio. Nothing is asserted
about time.
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
sys.path.insert(0, str(_HERE))

SEEDS = list(range(6))


def grid_file(name: str, folder: Path, mnist_rounds: int) -> Path:
    """The grid as a sweep file: the scenario, with `seed` x attack on/off swept (12 runs)."""
    import yaml

    from overhead import digits_scenario, mnist_scenario

    from fedsim.scenario import scenario_dict

    scenario = mnist_scenario(mnist_rounds) if name == "mnist" else digits_scenario(None)
    raw = scenario_dict(scenario)
    raw["name"] = f"bench_{name}"
    raw["sweep"] = {"seed": SEEDS, "attacked": [{"label": "edge_case", "attack": raw["attack"]},
                                                {"label": "none", "attack": None}]}
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def cpu_jiffies() -> tuple[int, int]:
    with open("/proc/stat") as fh:
        fields = [int(v) for v in fh.readline().split()[1:]]
    idle = fields[3] + fields[4]
    return sum(fields[:8]) - idle, sum(fields[:8])


def timed(cmd: list[str], env: dict) -> dict:
    """Run `cmd`; its wall time and the machine's busy cores meanwhile (this side's and anyone else's)."""
    cpu0, t0 = cpu_jiffies(), time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    busy, total = (b - a for a, b in zip(cpu0, cpu_jiffies()))
    machine = (os.cpu_count() or 1) * busy / max(total, 1)
    return {"wall": wall, "machine_cores": machine, "stdout": proc.stdout}


def run_plain(path: Path, threads: int | None) -> None:
    """`--side plain`: the grid's runs as plain loops, one after another, in this process."""
    import torch
    from overhead import plain_loop

    if threads:
        torch.set_num_threads(threads)

    from fedsim.runs.sweep import expand

    _, runs = expand(path)
    finals = []
    for run in runs:
        finals.append(plain_loop(run.scenario)["metrics"]["main_accuracy"])
    print(json.dumps({"final_main_accuracy": finals}))


def sweep_finals(out: Path) -> list[float]:
    return [json.loads(p.read_text())["final_main_accuracy"] for p in sorted(out.glob("*/*/summary.json"))]


def one_pair(name: str, path: Path, jobs: int, env: dict, work: Path, index: int, quiet: float,
             plain_threads: int | None) -> dict:
    from overhead import wait_for_quiet

    if quiet:
        wait_for_quiet(quiet)
    threads = ["--plain-threads", str(plain_threads)] if plain_threads else []
    plain = timed([sys.executable, __file__, "--side", "plain", "--grid", str(path), *threads], env)
    plain["finals"] = json.loads(plain["stdout"].strip().splitlines()[-1])["final_main_accuracy"]
    out = work / f"{name}-{index}"
    if quiet:
        wait_for_quiet(quiet)
    fed = timed([sys.executable, "-m", "fedsim.cli", "sweep", str(path), "--jobs", str(jobs), "--output", str(out)], env)
    fed["finals"] = sweep_finals(out)
    return {"plain": plain, "sweep": fed, "ratio": fed["wall"] / plain["wall"]}


def report(name: str, pairs: list[dict], jobs: int, threads: str) -> None:
    print(f"\n{name}: 12 runs, fedsim sweep --jobs {jobs} vs 12 plain loops in one process ({threads})")
    print(f"{'pair':>4} {'plain s':>9} {'sweep s':>9} {'ratio':>7} {'busy cores, plain':>18} {'busy cores, sweep':>18}"
          f" {'acc plain':>10} {'acc sweep':>10}")
    for i, p in enumerate(pairs, 1):
        accs = [statistics.mean(p[s]["finals"]) for s in ("plain", "sweep")]
        print(f"{i:>4} {p['plain']['wall']:>9.1f} {p['sweep']['wall']:>9.1f} {p['ratio']:>6.2f}x"
              f" {p['plain']['machine_cores']:>18.2f} {p['sweep']['machine_cores']:>18.2f} {accs[0]:>10.4f} {accs[1]:>10.4f}")
    print(f"{name}: ratio sweep / plain loops = {statistics.median(p['ratio'] for p in pairs):.2f}x"
          + (f" (median of {len(pairs)} pairs)" if len(pairs) > 1 else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["digits", "mnist"], default=None)
    parser.add_argument("--jobs", type=int, default=2, help="runs in flight in the sweep (default 2)")
    parser.add_argument("--mnist-rounds", type=int, default=10, help="rounds of each MNIST run (default 10)")
    parser.add_argument("--repeat", type=int, default=1, metavar="N", help="N interleaved pairs per grid")
    parser.add_argument("--wait-quiet", type=float, default=0, metavar="SECONDS",
                        help="before each side, wait up to this long for the machine to be idle (others' work skews both)")
    parser.add_argument("--plain-threads", type=int, default=None, metavar="N",
                        help="torch threads of the plain loops (default: torch's own, 2 on two cores). On a busy "
                             "machine two spinning threads per loop lose far more than they gain; 1 is then the fair baseline")
    parser.add_argument("--json", type=Path, default=None, help="also write the raw numbers to this file")
    parser.add_argument("--side", choices=["plain"], default=None, help=argparse.SUPPRESS)
    parser.add_argument("--grid", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side == "plain":
        return run_plain(args.grid, args.plain_threads)

    env = dict(os.environ, COLUMNS="200")
    env.setdefault("FEDSIM_DATA_DIR", str(REPO.parent / "shared" / "data"))
    os.environ["FEDSIM_DATA_DIR"] = env["FEDSIM_DATA_DIR"]
    results = {}
    with tempfile.TemporaryDirectory(prefix="fedsim-bench-sweep-") as tmp:
        work = Path(tmp)
        for name in [args.only] if args.only else ["digits", "mnist"]:
            path = grid_file(name, work, args.mnist_rounds)
            # caches (partitions, edge sets) written once, outside the timings
            subprocess.run([sys.executable, "-m", "fedsim.cli", "validate", str(path)], env=env, check=True,
                           capture_output=True)
            pairs = [one_pair(name, path, args.jobs, env, work, i, args.wait_quiet, args.plain_threads)
                     for i in range(args.repeat)]
            threads = f"plain loops on {args.plain_threads} torch thread(s)" if args.plain_threads else "plain loops on torch's default threads"
            report(name + (f" ({args.mnist_rounds} rounds)" if name == "mnist" else ""), pairs, args.jobs, threads)
            results[name] = [{s: {k: v for k, v in p[s].items() if k != "stdout"} for s in ("plain", "sweep")}
                             | {"ratio": p["ratio"]} for p in pairs]
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    from bench_lock import bench_lock  # one benchmark at a time (lock in the system's temp folder)

    with bench_lock():
        main()
