"""Compression in time: simulated time to accuracy per uplink bandwidth x codec (issue #34 item 6).

Run: `.venv/bin/python benchmarks/compression_time.py [--out DIR] [--train-at 1]
[--verify-at 100[,...]] [--verify-codecs none,...] [--target 0.9] [--jobs 2] [--set seed=1]`, or
`... --from DIR` to print the table of a finished sweep folder (`fedsim sweep
scenarios/sweeps/compression_time.yaml` makes one with all 20 runs). A rerun with the same `--out`
skips the runs already finished, so more real cells can be added to a folder later.

The grid is scenarios/sweeps/compression_time.yaml: LeNet on MNIST on the federation clock
(scenarios/systems/compression_time.yaml), every client on one network class whose uplink is the
swept value, times the codecs none, top-k 1%, QSGD 8-bit, PowerSGD rank 2 and Pufferfish.

What is run. The training does not depend on the uplink: the clients sampled, what they train and
the bytes they send are drawn from the seed, and under wait_for_all every reply is aggregated
whenever it arrives; only the clock's times change. So each codec is trained at `--train-at`
Mbit/s, and the codecs of `--verify-codecs` (default: all) once more at each `--verify-at` uplink
(by default 10 runs through `fedsim sweep`, run folders named as the full sweep's). The table's
other cells are *re-timed* from the codec's run at the lowest uplink with the clock's own formula:
a client's upload is its recorded reply bytes * 8 / uplink + latency, its download and compute are
as recorded, a round lasts until its slowest client has finished (wait_for_all), then
`systems.server_seconds`. The re-timing is checked before any re-timed number is printed: for
every codec run at two or more uplinks, its runs must have the same clients, bytes, download and
compute seconds and accuracies in every round, and each re-timed to another's uplink must give that
run's simulated time in every round (to 1 ms: client_seconds are recorded to the microsecond). If
a check fails, or none could be made, only the real runs' cells are printed. A codec not itself run
at two uplinks is re-timed on the strength of the others' checks, and its rows say so.

Printed per uplink x codec: MB uploaded per client-round (the mean of the recorded reply bytes),
the simulated time (and round) at which the main accuracy first reached each of `systems.targets`,
the mean round's length, how much of its slowest client's time was upload, the final accuracy, and
where the row comes from (run / re-timed). `*` marks the fastest codec to each target at each
uplink; one line per uplink gives each codec's speed-up over no compression at `--target`.
Simulated times do not depend on this machine: nothing here is timed on its clock (no benchmark
lock needed). Without mnist.npz in $FEDSIM_DATA_DIR it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
SWEEP = REPO / "scenarios" / "sweeps" / "compression_time.yaml"
TOLERANCE_S = 1e-3  # re-timed vs real simulated time, per round (client_seconds are rounded to 1e-6 s)


@dataclass
class Run:
    codec: str
    uplink: float  # Mbit/s
    latency_s: float
    server_s: float
    targets: list[float]
    rounds: list[dict]  # trained rounds (round > 0), in order
    source: str = "run"
    times: list[float] = field(default_factory=list)  # sim_time at each round's close

    def __post_init__(self):
        if not self.times:
            self.times = [r["sim_time"] for r in self.rounds]


def load_run(folder: Path) -> Run:
    summary = json.loads((folder / "summary.json").read_text())
    sc = summary["scenario"]
    values = json.loads((folder / "sweep.json").read_text())
    codec = values["codec"]["label"] if isinstance(values.get("codec"), dict) else str(values.get("codec"))
    nets = sc["systems"]["networks"]
    if len(nets) != 1 or nets[0]["spread"] != 0:
        raise SystemExit(f"{folder}: expected one network class without spread, got {nets}")
    server = sc["systems"]["server_seconds"]
    if server == "measured" or sc["systems"]["round"]["name"] != "wait_for_all":
        raise SystemExit(f"{folder}: re-timing needs wait_for_all and a modelled server_seconds")
    rounds = [json.loads(line) for line in (folder / "rounds.jsonl").read_text().splitlines() if line.strip()]
    rounds = [r for r in rounds if r["round"] > 0]
    return Run(codec, float(nets[0]["up_mbps"]), nets[0]["latency_ms"] / 1e3, float(server),
               list(sc["systems"]["targets"]), rounds)


def retime(run: Run, uplink: float) -> Run:
    """The same run with every client's upload timed at `uplink` Mbit/s (the clock's formula)."""
    now, times = 0.0, []
    for r in run.rounds:
        finish = []
        for pid, (down, compute, _up) in r["client_seconds"].items():
            up = r["bytes_up_per_client"][pid] * 8.0 / (uplink * 1e6) + run.latency_s
            finish.append(down + compute + up)
        now += (max(finish) if finish else 0.0)
        times.append(now)
        now += run.server_s
    return Run(run.codec, uplink, run.latency_s, run.server_s, run.targets, run.rounds, "re-timed", times)


def same_training(a: Run, b: Run) -> str | None:
    """Why runs `a` and `b` did not train the same (None when they did, round for round)."""
    if len(a.rounds) != len(b.rounds):
        return f"{len(a.rounds)} vs {len(b.rounds)} rounds"
    for ra, rb in zip(a.rounds, b.rounds):
        for key in ("sampled", "aggregated", "bytes_up_per_client", "bytes_down_per_client", "main_accuracy", "stragglers"):
            if ra.get(key) != rb.get(key):
                return f"round {ra['round']}: {key} differs"
        if {k: v[:2] for k, v in ra["client_seconds"].items()} != {k: v[:2] for k, v in rb["client_seconds"].items()}:
            return f"round {ra['round']}: download or compute seconds differ"
    return None


def first_reach(run: Run, target: float) -> tuple[float, int] | None:
    for r, t in zip(run.rounds, run.times):
        if (r.get("main_accuracy") or 0.0) >= target:
            return t, r["round"]
    return None


def stats(run: Run) -> dict:
    up_bytes = [b for r in run.rounds for b in r["bytes_up_per_client"].values()]
    starts = [0.0] + [t + run.server_s for t in run.times[:-1]]
    durations = [t - s for t, s in zip(run.times, starts)]
    up_share = []
    for r in run.rounds:  # the round's slowest client: how much of its time was its upload
        parts = {p: (down + compute, r["bytes_up_per_client"][p] * 8.0 / (run.uplink * 1e6) + run.latency_s)
                 for p, (down, compute, _up) in r["client_seconds"].items()}
        rest, up = max(parts.values(), key=sum)
        up_share.append(up / (rest + up))
    accs = [r["main_accuracy"] for r in run.rounds if r.get("main_accuracy") is not None]
    return {"mb_up": sum(up_bytes) / len(up_bytes) / 1e6, "round_s": sum(durations) / len(durations),
            "up_share": sum(up_share) / len(up_share), "final": accs[-1] if accs else float("nan")}


def fmt_time(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"


def table(cells: dict[tuple[float, str], Run], codecs: list[str], target: float) -> str:
    targets = next(iter(cells.values())).targets
    head = ["uplink", "codec", "MB up/client-round"] + [f"to {t:.0%}" for t in targets] + [
        "mean round", "upload share", "final acc", "source"]
    rows, notes = [], []
    for up in sorted({u for u, _ in cells}):
        here = [(c, cells[(up, c)]) for c in codecs if (up, c) in cells]
        reach = {(c, t): first_reach(run, t) for c, run in here for t in targets}
        best = {t: min((reach[(c, t)][0] for c, _ in here if reach[(c, t)]), default=None) for t in targets}
        for c, run in here:
            s = stats(run)
            cols = [f"{up:g} Mbit/s", c, f"{s['mb_up']:.3f}"]
            for t in targets:
                got = reach[(c, t)]
                cols.append("never" if got is None else
                            f"{fmt_time(got[0])} (r{got[1]}){' *' if best[t] is not None and got[0] == best[t] else ''}")
            cols += [fmt_time(s["round_s"]), f"{s['up_share']:.0%}", f"{s['final']:.1%}", run.source]
            rows.append(cols)
        base = reach.get(("none", target))
        if base is not None:
            parts = []
            for c, _ in here:
                got = reach[(c, target)]
                parts.append(f"{c} {base[0] / got[0]:.2f}x" if got else f"{c} never")
            notes.append(f"{up:g} Mbit/s, speed-up over none to {target:.0%}: " + ", ".join(parts))
        rows.append(None)
    widths = [max(len(head[i]), *(len(r[i]) for r in rows if r)) for i in range(len(head))]
    line = lambda cols: "| " + " | ".join(c.ljust(w) for c, w in zip(cols, widths)) + " |"  # noqa: E731
    out = [line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(r) for r in rows if r]
    return "\n".join(out + [""] + notes)


def run_sweep(out: Path, codecs: list[str], uplinks: list[str], jobs: int, tag: str, sets: list[str] = ()) -> Path:
    """The ready sweep restricted to `codecs` x `uplinks` (labels), run with `fedsim sweep` into `out`."""
    raw = yaml.safe_load(SWEEP.read_text())
    raw["base"] = str((SWEEP.parent / raw["base"]).resolve())  # the generated file lives in `out`
    for axis, keep in (("codec", codecs), ("uplink", uplinks)):
        known = [v["label"] for v in raw["sweep"][axis]]
        missing = [k for k in keep if k not in known]
        if missing:
            raise SystemExit(f"{axis} {missing} not in {SWEEP.relative_to(REPO)} (it has {known})")
        raw["sweep"][axis] = [v for v in raw["sweep"][axis] if v["label"] in keep]
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"compression_time_{tag}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    cmd = [sys.executable, "-m", "fedsim.cli", "sweep", str(path), "--output", str(out), "--jobs", str(jobs)]
    cmd += [arg for s in sets for arg in ("--set", s)]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    return out / raw["name"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--from", dest="source", type=Path, help="a finished sweep folder: print its table, run nothing")
    ap.add_argument("--out", type=Path, help="parent folder of the runs (default: a new temporary folder)")
    ap.add_argument("--train-at", default="1", help="uplink label the codecs are trained at (default 1)")
    ap.add_argument("--verify-at", default="100", help="uplink labels the re-timing is checked at, comma-separated (default 100)")
    ap.add_argument("--verify-codecs", default="all", help="codecs also run at --verify-at, comma-separated (default all)")
    ap.add_argument("--target", type=float, default=0.9, help="accuracy of the speed-up line (one of systems.targets)")
    ap.add_argument("--jobs", type=int, default=2, help="runs in flight (fedsim sweep --jobs)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="passed to fedsim sweep, e.g. seed=1 (use another --out: run names do not carry it)")
    args = ap.parse_args(argv)

    raw = yaml.safe_load(SWEEP.read_text())
    codecs = [c["label"] for c in raw["sweep"]["codec"]]
    uplinks = [float(u["label"]) for u in raw["sweep"]["uplink"]]
    if args.source is not None:
        folder = args.source
    else:
        data = Path(os.environ.get("FEDSIM_DATA_DIR", ""))
        if not os.environ.get("FEDSIM_DATA_DIR") or not (data / "mnist.npz").exists():
            print("skipped: needs mnist.npz in $FEDSIM_DATA_DIR (LeNet on MNIST); see docs/datasets.md")
            return 0
        verify_at = args.verify_at.split(",")
        if args.train_at in verify_at:
            raise SystemExit("--verify-at must differ from --train-at")
        out = args.out or Path(tempfile.mkdtemp(prefix="compression_time_"))
        verify = codecs if args.verify_codecs == "all" else args.verify_codecs.split(",")
        if verify == codecs:  # one grid: both uplinks' runs in flight together
            folder = run_sweep(out, codecs, [args.train_at, *verify_at], args.jobs, "train_verify", args.set)
        else:
            run_sweep(out, codecs, [args.train_at], args.jobs, "train", args.set)
            folder = run_sweep(out, verify, verify_at, args.jobs, "verify", args.set)

    runs = [load_run(p) for p in sorted(folder.iterdir()) if (p / "summary.json").exists()]
    if not runs:
        raise SystemExit(f"no finished runs in {folder}")
    real = {(r.uplink, r.codec): r for r in runs}
    cells: dict[tuple[float, str], Run] = dict(real)
    print(f"runs: {len(runs)} finished in {folder}")

    # The re-timing, checked: every codec with real runs at two or more uplinks, both ways.
    verified, failed = set(), []
    for codec in codecs:
        mine = sorted((r for r in runs if r.codec == codec), key=lambda r: r.uplink)
        pairs, worst = 0, 0.0
        for a in mine:
            for b in mine:
                if a is b:
                    continue
                why = same_training(a, b)
                if why is None:
                    err = max(abs(x - y) for x, y in zip(retime(a, b.uplink).times, b.times))
                    worst = max(worst, err)
                    if err > TOLERANCE_S:
                        why = f"re-timed {a.uplink:g} -> {b.uplink:g} Mbit/s is off by {err:.3g} s"
                    else:
                        pairs += 1
                if why is not None:
                    failed.append(f"{codec} {a.uplink:g} vs {b.uplink:g} Mbit/s: {why}")
        if pairs and pairs == len(mine) * (len(mine) - 1):
            verified.add(codec)
            print(f"check {codec}: real runs at {', '.join(f'{r.uplink:g}' for r in mine)} Mbit/s train the same (clients, "
                  f"bytes, accuracies); each re-timed to the others' uplinks gives their sim_time to {worst:.1g} s "
                  f"in every one of {len(mine[0].rounds)} rounds")
    for f in failed:
        print("CHECK FAILED:", f)
    if verified and not failed:
        for codec in codecs:
            mine = [r for r in runs if r.codec == codec]
            if not mine:
                continue
            src = min(mine, key=lambda r: r.uplink)
            for up in uplinks:
                if (up, codec) not in cells:
                    cells[(up, codec)] = retime(src, up)
                    if codec not in verified:
                        cells[(up, codec)].source = "re-timed, unchecked codec"
    elif len(cells) < len(codecs) * len(uplinks):
        print("re-timing not verified: only the real runs' cells are printed")

    print()
    print(table(cells, codecs, args.target))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
