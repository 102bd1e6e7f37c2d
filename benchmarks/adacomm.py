"""AdaComm against fixed local periods on the federation clock (Wang & Joshi, MLSys 2019; docs/adacomm.md).

The claim: "AdaComm can take 3 times less time than fully synchronous SGD, and still reach the same
final training loss", and the paper compares it with fixed communication periods too. Here every
run is local-update SGD on scenarios/systems/adacomm.yaml (8 clients, all in every round, IID
MNIST, plain SGD at a fixed lr), timed on the simulated clock, each run stopped at the first round
that closes after `--horizon` simulated seconds; `--jitter σ` sets systems.jitter for every run
(each client-round's times multiplied by exp(σ·N(0,1)): random straggling):

1. fixed τ for each of `--taus` (federation.local_steps = τ; τ = 1 is fully synchronous SGD);
2. AdaComm (systems.adacomm) with T0 = `--interval` simulated seconds and, as the paper picks it,
   τ0 = the fixed τ whose global model has the lowest test loss at the end of the first interval
   (per seed, from step 1's runs), unless `--tau0` names one.

For each seed it prints, from the runs' rounds.jsonl: the global model's test loss and accuracy at
the horizon, the first simulated time each run's global model reached each target test loss
(`--targets`; and fully synchronous SGD's loss at the horizon, the paper's "same final loss"), the
best fixed τ for each target, and AdaComm's time over the best fixed τ's and τ = 1's over
AdaComm's. Then AdaComm's F_0 (round 1's `start_loss`: the clients' mean first-batch loss at the
initial model) beside the initial model's test loss, and each re-evaluation of τ replayed from
rounds.jsonl: the round's start, the F_l it divided (the previous round's `start_loss`), F_l / F_0
and the τ it gave, checked against the `local_steps` the rounds recorded. Only measured numbers
are printed; a target a run did not reach within the horizon is "-".

All runs share one Ray engine (fedsim/engine/shared.py), `--jobs` in flight; a run whose folder
already reached the horizon is read, not run again (an AdaComm run without `start_loss` in its
rounds, recorded before fedsim measured F at the global model, is run again). Simulated times do
not depend on this machine's speed; the wall time does (docs/adacomm.md gives it).

`--scenario` names another base scenario (scenarios/systems/adacomm_noniid.yaml: a Dirichlet label
split and a larger lr, where client drift should give a large τ an error floor); its runs go to
results/<the scenario file's name> unless `--out` says otherwise (results/adacomm_noniid), so the
folders of different scenarios never mix.

Run: `FEDSIM_DATA_DIR=... .venv/bin/python benchmarks/adacomm.py [--scenario ...] [--seeds 0,1] [--jitter 0.5] [--out results/adacomm]`
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROUNDS_CAP = 5000  # every run is stopped at the horizon long before this


def read_rounds(run_dir: Path) -> list[dict]:
    path = run_dir / "rounds.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def reached_horizon(rounds: list[dict], horizon: float) -> bool:
    return any((r.get("sim_time") or 0.0) >= horizon for r in rounds)


def evaluated(rounds: list[dict], horizon: float) -> list[tuple[float, float, float]]:
    """(simulated time, test loss, test accuracy) of the global model after each round, from the
    initial model (time 0) up to the first round that closes at or after the horizon."""
    out = []
    for r in rounds:
        if r.get("main_loss") is None:
            continue
        t = 0.0 if r["round"] == 0 else r.get("sim_time")
        if t is None:
            continue
        out.append((float(t), float(r["main_loss"]), float(r["main_accuracy"])))
        if t >= horizon:
            break
    return out


def stale(raw: dict, rounds: list[dict]) -> bool:
    """An AdaComm run recorded before its rounds carried `start_loss` (F at the global model)."""
    return bool(raw.get("systems", {}).get("adacomm")) and not any("start_loss" in r for r in rounds)


def replay_adacomm(rounds: list[dict], tau0: int, interval: float) -> tuple[float | None, list[tuple], list[int]]:
    """AdaComm's rule (fedsim/clock/adacomm.py, lr not coupled) replayed from the recorded
    `start_loss` of each round: F_0 (round 1's), the re-evaluations as (round, its start, F_l,
    F_l / F_0, τ), and the rounds whose recorded `local_steps` differ from the replayed τ."""
    f0, tau, start, last, evals, mismatched = None, tau0, 0.0, None, [], []
    for r in rounds:
        if r.get("local_steps") is None:
            continue
        now = float(r["sim_start"])
        if f0 is None and last is not None:
            f0 = last
        if f0 and last is not None and now - start >= interval:
            ratio = last / f0
            tau = max(1, math.ceil(math.sqrt(max(ratio, 0.0)) * tau0 - 1e-9))
            evals.append((r["round"], now, last, ratio, tau))
            elapsed = now - start
            start += elapsed - math.fmod(elapsed, interval)
        if r["local_steps"] != tau:
            mismatched.append(r["round"])
        last = r.get("start_loss")
    return f0, evals, mismatched


def first_time(curve, loss: float) -> float | None:
    return next((t for t, l, _ in curve if l <= loss), None)


def at_time(curve, t: float) -> tuple[float, float] | None:
    """Test loss and accuracy of the last global model evaluated at or before time t."""
    before = [(l, a) for s, l, a in curve if s <= t]
    return before[-1] if before else None


class Runs:
    """Runs scenarios on one shared engine, each stopped at the horizon."""

    def __init__(self, out: Path, horizon: float, jobs: int, verbose: bool) -> None:
        self.out, self.horizon, self.jobs, self.verbose = out, horizon, jobs, verbose
        self.engine = None

    def run(self, named: list[tuple[str, dict]]) -> None:
        from fedsim.runs.folder import RunFolder
        from fedsim.runs.sweep import SweepRun, _run_in_threads
        from fedsim.scenario import validate_scenario

        todo = []
        for name, raw in named:
            asked = json.dumps(raw, sort_keys=True)
            made = self.out / name / "benchmark-scenario.json"  # what the folder's run was asked to be
            rounds = read_rounds(self.out / name)
            if reached_horizon(rounds, self.horizon) and made.exists() and made.read_text() == asked and not stale(raw, rounds):
                print(f"  {name}: already at the horizon, read")
                continue
            if (self.out / name).exists():  # a run cut short: start it again (no checkpoints)
                import shutil

                shutil.rmtree(self.out / name)
            todo.append(SweepRun(name, {}, validate_scenario(dict(raw, name=name), name)))
        if not todo:
            return
        engine = self.start_engine(todo[0].scenario)

        def runner(scenario, run_dir):
            from fedsim.engine.simulate import simulate
            from fedsim.flower.stoppable_grid import RunStopped

            stop, started = threading.Event(), time.perf_counter()

            def on_round(record: dict) -> None:
                if (record.get("sim_time") or 0.0) >= self.horizon:
                    stop.set()

            try:
                simulate(scenario, run_dir=run_dir, verbose=self.verbose, progress=on_round, stop=stop, engine=engine)
            except RunStopped:
                pass
            rounds = read_rounds(run_dir)
            (run_dir / "benchmark-scenario.json").write_text(asked[scenario.name])
            if not reached_horizon(rounds, self.horizon):
                raise RuntimeError(f"{scenario.name} ended before the horizon ({len(rounds) - 1} rounds); see {run_dir}")
            print(f"  {scenario.name}: {len(rounds) - 1} rounds to {rounds[-1]['sim_time']:.0f} simulated s, "
                  f"{time.perf_counter() - started:.0f} s wall", flush=True)

        asked = {name: json.dumps(raw, sort_keys=True) for name, raw in named}

        def prepare_and_run(run):
            run_dir = RunFolder.at(self.out / run.name, run.scenario, replace_scenario=True).path
            return runner(run.scenario, run_dir)

        if engine is None or self.jobs <= 1:
            for run in todo:
                prepare_and_run(run)
        else:
            _run_in_threads(self.out, todo, lambda scenario, run_dir: runner(scenario, run_dir), None, self.jobs)

    def start_engine(self, scenario):
        from fedsim.engine.shared import SharedEngine

        if self.engine is None:
            engine = SharedEngine(verbose=self.verbose).begin()
            engine.start(scenario)
            if not SharedEngine.available():
                engine.close()
                print("  (this Flower lacks what a shared engine needs: each run starts its own Ray)")
                self.engine = False
            else:
                engine.open()
                self.engine = engine
        return self.engine or None

    def close(self) -> None:
        if self.engine:
            self.engine.close()


def fixed_case(base: dict, tau: int, seed: int) -> dict:
    raw = json.loads(json.dumps(base))
    raw["seed"] = seed
    raw["federation"] = dict(raw["federation"], local_steps=tau, rounds=ROUNDS_CAP)
    raw["federation"]["local_epochs"] = max(int(raw["federation"].get("local_epochs", 1)), 1)
    raw["systems"] = {k: v for k, v in raw["systems"].items() if k != "adacomm"}
    raw.setdefault("output", {})["checkpoints"] = False
    return raw


def adacomm_case(base: dict, tau0: int, interval: float, seed: int) -> dict:
    raw = fixed_case(base, 1, seed)
    raw["federation"]["local_steps"] = None
    raw["systems"]["adacomm"] = {"tau0": tau0, "interval": interval}
    return raw


def window_mean(curve, a: float, b: float) -> str:
    """Mean test loss of the global models evaluated after rounds closing in (a, b] simulated s."""
    losses = [l for t, l, _ in curve if a < t <= b]
    return f"{sum(losses) / len(losses):.4f}" if losses else "-"


def fmt_t(t: float | None) -> str:
    return "-" if t is None else f"{t:.0f}"


def fmt_ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None or b == 0 else f"{a / b:.2f}"


def table(rows: list[list[str]], head: list[str]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(head, *rows)]
    line = lambda cells: "| " + " | ".join(str(c).rjust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join([line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", default=str(REPO / "scenarios/systems/adacomm.yaml"))
    parser.add_argument("--taus", default="1,5,20,50,100", help="fixed local periods (τ = 1: fully synchronous SGD)")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--horizon", type=float, default=600.0, help="simulated seconds each run trains for")
    parser.add_argument("--interval", type=float, default=60.0, help="AdaComm's T0, simulated seconds")
    parser.add_argument("--tau0", type=int, default=None, help="AdaComm's τ0 (default: the best fixed τ at T0, per seed)")
    parser.add_argument("--jitter", type=float, default=None,
                        help="systems.jitter σ for every run (random straggling; default: the scenario's, 0)")
    parser.add_argument("--targets", default="0.5,0.3,0.2,0.15,0.12,0.1", help="test losses of the global model")
    parser.add_argument("--windows", type=float, default=None,
                        help="also print each run's mean test loss over consecutive windows of this many simulated s "
                             "(whether a run's loss still falls late in the horizon, or has stopped at a floor)")
    parser.add_argument("--jobs", type=int, default=2, help="runs in flight on the shared engine")
    parser.add_argument("--out", default=None, help="folder of the runs (reused: finished runs are read); "
                        "default results/<the scenario file's name>: results/adacomm for the default scenario")
    parser.add_argument("--set", action="append", default=[], help="scenario overrides KEY=VALUE for every run")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args()

    from fedsim.scenario import apply_overrides, read_yaml

    taus = [int(x) for x in args.taus.split(",")]
    seeds = [int(x) for x in args.seeds.split(",")]
    targets = [float(x) for x in args.targets.split(",")]
    base = apply_overrides(read_yaml(args.scenario), args.set)
    if args.jitter is not None:
        base["systems"] = {k: v for k, v in base["systems"].items() if k != "jitter"}
        if args.jitter > 0:  # jitter 0 leaves the scenario as it was: its runs are the same folders
            base["systems"]["jitter"] = args.jitter
    jitter = float(base["systems"].get("jitter", 0.0) or 0.0)
    out = Path(args.out) if args.out else Path("results") / Path(args.scenario).stem
    tag = f"h{args.horizon:g}" + (f"-j{jitter:g}" if jitter else "")
    runs = Runs(out, args.horizon, args.jobs, args.verbose)
    wall = time.perf_counter()
    try:
        if Path(args.scenario).resolve() != (REPO / "scenarios/systems/adacomm.yaml").resolve():
            print(f"scenario {args.scenario} ({base.get('name')}), runs in {out}", flush=True)
        print(f"fixed τ in {taus}, seeds {seeds}, {args.horizon:g} simulated s each, jitter {jitter:g}", flush=True)
        runs.run([(f"fixed-tau{tau}-seed{seed}-{tag}", fixed_case(base, tau, seed)) for seed in seeds for tau in taus])
        curves = {(tau, seed): evaluated(read_rounds(out / f"fixed-tau{tau}-seed{seed}-{tag}"), args.horizon)
                  for seed in seeds for tau in taus}
        tau0s = {}
        for seed in seeds:
            if args.tau0 is not None:
                tau0s[seed] = args.tau0
                continue
            at_t0 = {tau: at_time(curves[tau, seed], args.interval) for tau in taus}
            scored = {tau: v[0] for tau, v in at_t0.items() if v is not None}
            tau0s[seed] = min(scored, key=lambda tau: (scored[tau], tau))
        ada_name = lambda seed: f"adacomm-tau0{tau0s[seed]}-T{args.interval:g}-seed{seed}-{tag}"  # noqa: E731
        print(f"AdaComm, T0 = {args.interval:g} s, τ0 per seed {tau0s}", flush=True)
        runs.run([(ada_name(seed), adacomm_case(base, tau0s[seed], args.interval, seed)) for seed in seeds])
    finally:
        runs.close()
    wall = time.perf_counter() - wall

    ratios = {}
    for seed in seeds:
        ada_rounds = read_rounds(out / ada_name(seed))
        ada = evaluated(ada_rounds, args.horizon)
        sync_final = curves[1, seed][-1][1] if 1 in taus else None
        levels = targets + ([sync_final] if sync_final is not None else [])
        head = ["run", "loss@H", "acc@H"] + [f"t(loss<={x:.3f})" if i == len(targets) else f"t(loss<={x:g})"
                                              for i, x in enumerate(levels)]
        rows = []
        for tau in taus:
            c = curves[tau, seed]
            rows.append([f"fixed τ={tau}", f"{c[-1][1]:.4f}", f"{c[-1][2]:.4f}"] + [fmt_t(first_time(c, x)) for x in levels])
        rows.append([f"AdaComm τ0={tau0s[seed]}", f"{ada[-1][1]:.4f}", f"{ada[-1][2]:.4f}"] +
                    [fmt_t(first_time(ada, x)) for x in levels])
        best = []
        for x in levels:
            times = {tau: first_time(curves[tau, seed], x) for tau in taus}
            times = {tau: t for tau, t in times.items() if t is not None}
            best.append(min(times.items(), key=lambda kv: (kv[1], kv[0])) if times else None)
        rows.append(["best fixed τ", "", ""] + ["-" if b is None else f"τ={b[0]}: {b[1]:.0f}" for b in best])
        rows.append(["AdaComm / best fixed", "", ""] +
                    [fmt_ratio(first_time(ada, x), None if b is None else b[1]) for x, b in zip(levels, best)])
        if 1 in taus:
            rows.append(["τ=1 / AdaComm", "", ""] + [fmt_ratio(first_time(curves[1, seed], x), first_time(ada, x)) for x in levels])
        for x, b in zip(levels, best):
            ratios.setdefault(x if x in targets else "sync", []).append(
                (first_time(ada, x) / b[1]) if b is not None and first_time(ada, x) is not None else None)
        print(f"\nseed {seed}, jitter {jitter:g}: test loss of the global model against simulated seconds "
              f"(H = {args.horizon:g} s; the last column is τ=1's loss at H)")
        print(table(rows, head))
        if args.windows:
            edges = [0.0]
            while edges[-1] < args.horizon - 1e-9:
                edges.append(min(edges[-1] + args.windows, args.horizon))
            spans = list(zip(edges, edges[1:]))
            wrows = [[name] + [window_mean(c, a, b) for a, b in spans] + [f"{min(l for _, l, _ in c):.4f}"]
                     for name, c in [(f"fixed τ={tau}", curves[tau, seed]) for tau in taus] + [(f"AdaComm τ0={tau0s[seed]}", ada)]]
            print(f"mean test loss of the global model over windows of simulated seconds (rounds closing in (a, b]; "
                  f"the last column: the lowest of any round, through the first that closes at or after H)")
            print(table(wrows, ["run"] + [f"{a:g}-{b:g} s" for a, b in spans] + ["min"]))
        changes, last = [], None
        for r in ada_rounds:
            if r.get("local_steps") is not None and r["local_steps"] != last:
                last = r["local_steps"]
                changes.append(f"{r['sim_start']:.0f}s:{last}")
        print(f"AdaComm τ from round starts (time:τ): {' '.join(changes)}")
        f0, evals, mismatched = replay_adacomm(ada_rounds, tau0s[seed], args.interval)
        if f0 is not None:
            print(f"AdaComm's F_0 (round 1's start_loss: mean first-batch loss at the initial model) {f0:.4f}; "
                  f"the initial model's test loss {ada_rounds[0]['main_loss']:.4f}")
        print("AdaComm's re-evaluations (round start: F_l = the previous round's start_loss, F_l/F_0 -> τ): " +
              "; ".join(f"{t:.0f}s: {f:.4f}, {q:.4f} -> {tau}" for _, t, f, q, tau in evals))
        n = sum(1 for r in ada_rounds if r.get("local_steps") is not None)
        print(f"replayed τ equals the recorded local_steps in {n - len(mismatched)} of {n} rounds"
              + (f" (differs in rounds {mismatched[:10]})" if mismatched else ""))
    print(f"\nAdaComm's time over the best fixed τ's, per seed: " +
          ", ".join(f"loss<={k if k == 'sync' else format(k, 'g')}: " + " ".join("-" if v is None else f"{v:.2f}" for v in vs)
                    for k, vs in ratios.items()))
    print(f"wall time on this machine: {wall:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
