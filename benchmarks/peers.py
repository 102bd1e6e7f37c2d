"""fedsim against pfl-research and a plain PyTorch loop on pfl-research's simulator benchmark shape.

The shape (Apple's pfl-research, arXiv 2404.06430, its CIFAR-10 IID benchmark): 1,000 users with
50 images each, 50 users per round, one local epoch of batch 10 (five SGD steps per user), local
lr 0.1, FedAvg weighted by examples, a small CNN. Here on Fashion-MNIST (MNIST when
$FEDSIM_DATA_DIR has no fashion_mnist.npz): its first 50,000 training images (written to a
temporary copy of the dataset file, so fedsim's IID partitioner cuts exactly 50 per user), the
full 10,000-image test set for one central evaluation after the last round, seed 0. Two models:

* `lenet`: fedsim's `lenet` (conv 32, conv 64, max-pool, dropout, FC 128, dropout, FC 10: the
  PyTorch MNIST example net, which is also pfl-research's `simple_cnn`), 50 rounds by default;
* `mlp`: fedsim's `mlp` with `hidden: [100]` (784-100-10), 100 rounds by default.

Sides, each run in a fresh process (`--sides`, comma-separated; default all):

* `plain`: a plain sequential PyTorch loop written here (as benchmarks/overhead.py's): one
  process, `--threads` torch threads (default 2), the clients trained one after another with
  `torch.optim.SGD`, FedAvg by example count. It takes fedsim's own partitions, initial weights,
  per-round client sample and per-client training seeds from fedsim's runtime, so it trains the
  same users from the same model as fedsim.
* `fedsim-off`: the fedsim scenario (Flower's Ray simulation engine, one single-threaded client
  actor per core) with `federation.vectorize: off`: every client trained on its own.
* `fedsim-on`: the same with `federation.vectorize: on`: an actor's cohort of clients trained as
  one vectorised computation. Where fedsim's scenario schema has no `vectorize` field yet,
  `fedsim-off` runs the scenario as it is and `fedsim-on` is skipped, with a printed line.
  Both fedsim sides run with `output.checkpoints: false` (the other sides keep no checkpoints) and
  evaluate only after the last round (`evaluation.every` = rounds), as the other sides do.
* `pfl`: pfl-research itself (benchmarks/pfl_driver.py, run by the Python of pfl's own virtual
  environment): pfl's `FederatedAveraging` on its `SimulatedBackend`, with the same users (fedsim's
  partitions, the very arrays fedsim trains on, handed over as .npy files), the same initial
  weights, the same users sampled in each round (fedsim's sample, replayed through pfl's user
  sampler), the same hyper-parameters, the same architecture (a module with the same layers and
  state-dict keys), and the same central evaluation at the end. Where no pfl Python is given
  (`--pfl-python PATH`, else $FEDSIM_PFL_PYTHON) the side is skipped with a printed line.

Installing pfl's environment (outside the repository; torch pinned to the CPU wheel fedsim uses,
any other torch spec pulls gigabytes of CUDA packages):

    python3 -m venv ../pflenv
    ../pflenv/bin/pip install 'pfl[pytorch]==0.6.0' torch==2.13.0
    export FEDSIM_PFL_PYTHON=$PWD/../pflenv/bin/python

Run: `FEDSIM_DATA_DIR=../shared/data .venv/bin/python benchmarks/peers.py [--only lenet|mlp]
[--rounds N] [--repeat N] [--sides plain,fedsim-off,fedsim-on,pfl]`. It waits first for the
benchmark lock (benchmarks/bench_lock.py), so no two benchmarks time each other. The machine's
speed drifts (10-40% within minutes on a shared host): `--repeat N` runs the sides N times,
interleaved (plain, fedsim-off, fedsim-on, pfl, plain, ...), and shows each side's median run.

Reading the table (one per model): `wall time` is the whole run as a user sees it, from starting
the side's process to its exit (Python start, imports, data loading, Ray's start and stop for
fedsim, every round, the final evaluation). `outside the rounds` is the wall time minus the
rounds' seconds: start-up, teardown and the final evaluation; `first 3 rounds` their seconds.
`s / round` is the median of the per-round seconds after the first 3 rounds (of all rounds when
there are no more than 3), so wall ~ outside + first 3 + (rounds - 3) x s / round. fedsim's
come from the run folder's rounds.jsonl (`wall_seconds`: seconds since the previous round's line,
so they add up to the time in rounds), pfl's from a callback after every central iteration, the
plain loop's from its own clock. The first rounds are left out because they pay one-time costs
(pfl evaluates the first cohort's users before and after training in round 1, fedsim's actors
warm up). `final test accuracy` is on the full test set after the last round. The ratios divide
each side's wall time (and its per-round seconds) by the plain loop's in the same repetition, the
median over repetitions. The plain loop follows fedsim's seeds (sample, shuffles, dropout), so
the two agree to the last digit or nearly (fedsim's clients train on one thread each); pfl agrees
to within noise (its dropout draws differ, and it keeps each user's data order where the others
shuffle each epoch). `cores used by the side` is the CPU time of the side's process and all it
started (Ray's processes included, sampled from /proc) over its wall time; `cores used by anything
else` is the machine's busy time (/proc/stat) minus that: a run with much of the latter is skewed.
Nothing is asserted about time.

Measure on a quiet machine (`--wait-quiet SECONDS`): with other work on the cores, a torch loop
on two threads (the plain loop, pfl) slows far more than fedsim's single-threaded actors, as its
threads wait on each other (50 MLP clients: 0.10 s on one thread, 7.3 s on two, with a load of 5
on 2 cores).
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

from machine_cpu import TreeCPU, cores_busy, cpu_jiffies, wait_for_quiet  # this folder is on sys.path
from plain_steps import local_sgd

_HERE = Path(__file__).resolve().parent
REPO = _HERE.parent

# pfl-research's benchmark shape
USERS, IMAGES_PER_USER, COHORT, LOCAL_EPOCHS, BATCH, LR = 1000, 50, 50, 1, 10, 0.1
SEED = 0
MODELS = {
    "lenet": {"spec": "lenet", "rounds": 50},
    "mlp": {"spec": {"name": "mlp", "hidden": [100]}, "rounds": 100},
}
SIDES = {
    "plain": "plain loop",
    "fedsim-off": "fedsim sequential",
    "fedsim-on": "fedsim vectorised",
    "pfl": "pfl",
}
WARM_ROUNDS = 3  # rounds left out of the steady-state median


def data_dir() -> str:
    env = os.environ.get("FEDSIM_DATA_DIR")
    return env if env else str(REPO.parent / "shared" / "data")


def source_dataset() -> tuple[str, Path]:
    """(fedsim dataset name, .npz file): Fashion-MNIST, else MNIST, from the data directory."""
    for name in ("fashion_mnist", "mnist"):
        path = Path(data_dir()) / f"{name}.npz"
        if path.is_file():
            return name, path
    raise SystemExit(f"neither fashion_mnist.npz nor mnist.npz in {data_dir()} (set FEDSIM_DATA_DIR)")


def write_subset(name: str, source: Path, folder: Path) -> Path:
    """`folder/<name>.npz`: the dataset file with only its first USERS x IMAGES_PER_USER training
    images (the test set whole), so that fedsim's IID partitioner gives each user exactly
    IMAGES_PER_USER. The copy takes the source's modification time: fedsim's dataset cache is
    keyed by the data folder's file names, sizes and times, so every run of this benchmark finds
    the entry the first one wrote instead of adding one."""
    import numpy as np

    n = USERS * IMAGES_PER_USER
    with np.load(source) as d:
        arrays = {"x_train": d["x_train"][:n], "y_train": d["y_train"][:n], "x_test": d["x_test"], "y_test": d["y_test"]}
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / f"{name}.npz"
    np.savez(out, **arrays)
    st = source.stat()
    os.utime(out, ns=(st.st_atime_ns, st.st_mtime_ns))
    return folder


def has_vectorize() -> bool:
    from fedsim.scenario import FederationSection

    return "vectorize" in FederationSection.model_fields


def peers_scenario(model: str, rounds: int, dataset: str, folder: str, vectorize: str | None = None,
                   device: str = "cpu"):
    """The benchmark shape as a fedsim scenario; `vectorize` sets `federation.vectorize` (None: left out);
    `device` cuda puts the clients (a quarter of the GPU per actor), the server and the evaluation there."""
    from fedsim.scenario import validate_scenario

    federation = {"num_clients": USERS, "clients_per_round": COHORT, "rounds": rounds, "local_epochs": LOCAL_EPOCHS,
                  "batch_size": BATCH, "lr": LR}
    if vectorize is not None:
        federation["vectorize"] = vectorize
    evaluation = {"every": rounds, "initial": False}
    extra = {}
    if device != "cpu":
        federation.update(client_gpus=0.25, device=device)
        evaluation["device"] = device
        extra["server"] = {"device": device}
    return validate_scenario(
        {
            "name": f"peers_{model}",
            "seed": SEED,
            "data": {"dataset": dataset, "dir": folder, "partition": {"name": "iid"}},
            "model": MODELS[model]["spec"],
            "federation": federation,
            "aggregator": "fedavg",
            "evaluation": evaluation,
            "output": {"checkpoints": False},
            **extra,
        },
        f"peers_{model}",
    )


def sampled_clients(scenario, rnd: int) -> list[int]:
    """The clients fedsim's server samples in round `rnd` (fedsim/server/driver.py, no attack)."""
    from fedsim.seeding import SAMPLE, numpy_rng

    fed = scenario.federation
    rng = numpy_rng(scenario.seed, SAMPLE, rnd)
    return sorted(rng.choice(fed.num_clients, fed.clients_per_round, replace=False).tolist())


# --- the plain loop ---------------------------------------------------------------------------
def plain_loop(scenario, threads: int, device: str = "cpu") -> dict:
    """The same FedAvg as fedsim's scenario, as one plain sequential loop; per-round seconds, metrics."""

    import numpy as np
    import torch

    from fedsim.runtime import Runtime
    from fedsim.seeding import TRAIN, derive_seed

    torch.set_num_threads(threads)
    fed = scenario.federation
    rt = Runtime(scenario)  # fedsim's loaders and partitions: the very arrays fedsim's clients use

    def tensor(a):  # into memory: fedsim's cache hands large arrays over memory-mapped, read-only
        return torch.from_numpy(np.array(a)).to(device)

    x_train, y_train = tensor(rt.data.x_train), tensor(rt.data.y_train)
    x_test, y_test = tensor(rt.data.x_test), tensor(rt.data.y_test)
    parts = [torch.from_numpy(p).to(device) for p in rt.partitions]
    model = rt.build_model()
    rt.layout.load_into(model, rt.initial_weights())  # the same initial model as fedsim's
    model.to(device)

    walls = []
    for rnd in range(1, fed.rounds + 1):
        t = time.perf_counter()
        total, weighted = 0, None
        for pid in sampled_clients(scenario, rnd):
            x, y = x_train[parts[pid]], y_train[parts[pid]]
            seed = derive_seed(scenario.seed, TRAIN, rnd, pid)  # fedsim's seed for this client's training
            local = local_sgd(model, x, y, lr=fed.lr, epochs=fed.local_epochs, batch_size=fed.batch_size, seed=seed,
                              device=device)
            n = len(x)
            state = {k: v.detach() * n for k, v in local.state_dict().items()}
            weighted = state if weighted is None else {k: weighted[k] + state[k] for k in state}
            total += n
        model.load_state_dict({k: v / total for k, v in weighted.items()})
        if device != "cpu":
            torch.cuda.synchronize()
        walls.append(time.perf_counter() - t)
    model.eval()
    bs = scenario.evaluation.batch_size
    with torch.no_grad():
        logits = torch.cat([model(x_test[i : i + bs]) for i in range(0, len(x_test), bs)])
    metrics = {"main_accuracy": float((logits.argmax(1) == y_test).float().mean()),
               "main_loss": float(torch.nn.functional.cross_entropy(logits, y_test))}
    return {"round_wall": walls, "metrics": metrics, "threads": torch.get_num_threads()}


# --- fedsim ------------------------------------------------------------------------------------
def run_fedsim(scenario) -> dict:
    import fedsim.engine.simulate  # noqa: F401  (sets Flower/Ray environment defaults before they are imported)
    from fedsim.engine.simulate import simulate
    from fedsim.runs.results import read_rounds

    with tempfile.TemporaryDirectory(prefix="fedsim-peers-") as tmp:
        run_dir = simulate(scenario, run_dir=Path(tmp) / "run")
        rounds = [r for r in read_rounds(run_dir) if r["round"] >= 1]
    final = next((r for r in reversed(rounds) if r.get("main_accuracy") is not None), {})
    return {"round_wall": [r["wall_seconds"] for r in rounds],
            "metrics": {k: final.get(k) for k in ("main_accuracy", "main_loss")}}


# --- pfl ---------------------------------------------------------------------------------------
def write_problem(scenario, folder: Path) -> Path:
    """What benchmarks/pfl_driver.py reads: fedsim's arrays, partitions, initial weights and
    per-round sample, and the hyper-parameters (its docstring lists the files)."""
    import numpy as np
    import torch

    from fedsim.runtime import Runtime

    fed = scenario.federation
    rt = Runtime(scenario)
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("x_train", "y_train", "x_test", "y_test"):
        np.save(folder / f"{name}.npy", np.ascontiguousarray(getattr(rt.data, name)))
    parts = rt.partitions
    np.save(folder / "partitions.npy", np.concatenate(parts).astype(np.int64))
    np.save(folder / "sizes.npy", np.array([len(p) for p in parts], dtype=np.int64))
    np.save(folder / "schedule.npy", np.array([sampled_clients(scenario, r) for r in range(1, fed.rounds + 1)]))
    model = rt.build_model()
    rt.layout.load_into(model, rt.initial_weights())
    torch.save(model.state_dict(), folder / "init.pt")
    spec = scenario.model
    (folder / "config.json").write_text(json.dumps({
        "model": spec.name, "hidden": list(getattr(spec, "hidden", [])), "dropout": bool(getattr(spec, "dropout", True)),
        "input_shape": list(rt.data.x_train.shape[1:]), "num_classes": int(rt.data.num_classes),
        "lr": fed.lr, "batch_size": fed.batch_size, "local_epochs": fed.local_epochs, "rounds": fed.rounds,
        "cohort": fed.clients_per_round, "eval_batch_size": scenario.evaluation.batch_size, "seed": scenario.seed,
    }))
    return folder


# --- running the sides -----------------------------------------------------------------------
class SideFailed(Exception):
    pass


def run_side(side: str, model: str, args, setup: dict) -> dict:
    """One side in a fresh process; its wall time measured here, from start to exit."""
    with tempfile.TemporaryDirectory(prefix="fedsim-peers-side-") as tmp:
        out, log = Path(tmp) / "side.json", Path(tmp) / "side.log"
        if side == "pfl":
            cmd = [setup["pfl_python"], str(_HERE / "pfl_driver.py"), "--problem", str(setup["problem"][model]),
                   "--out", str(out), "--threads", str(args.threads)]
        else:
            cmd = [sys.executable, str(Path(__file__).resolve()), "--side", side, "--only", model, "--side-out", str(out),
                   "--rounds", str(setup["rounds"][model]), "--dataset", setup["dataset"], "--data-folder",
                   str(setup["folder"]), "--threads", str(args.threads), "--device", args.device]
            if side.startswith("fedsim") and not setup["vectorize"]:
                cmd.append("--no-vectorize-field")
        with open(log, "w") as fh:
            cpu0, tree, t0 = cpu_jiffies(), TreeCPU(), time.perf_counter()
            proc = subprocess.run(cmd, stdout=None if args.verbose else fh, stderr=subprocess.STDOUT if not args.verbose
                                  else None, cwd=str(REPO))
            wall = time.perf_counter() - t0
            busy = cores_busy(cpu0, cpu_jiffies())
            own = tree.seconds() / wall
        if proc.returncode != 0 or not out.exists():
            tail = log.read_text().strip().splitlines()[-15:] if log.exists() else []
            raise SideFailed(f"exit code {proc.returncode}" + ("\n    " + "\n    ".join(tail) if tail else ""))
        result = json.loads(out.read_text())
    result["wall"], result["own_cores"], result["other_cores"] = wall, own, max(busy - own, 0.0)
    walls = result["round_wall"]
    steady = walls[WARM_ROUNDS:] if len(walls) > WARM_ROUNDS else walls
    result["per_round"] = statistics.median(steady) if steady else None
    result["outside_rounds"] = wall - sum(walls)
    return result


# --- report -------------------------------------------------------------------------------------
def fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def report(title: str, sides: list[str], runs: dict[str, list[dict]], labels: dict[str, str]) -> dict:
    """The table of one model: each side's median run (by wall time) and the median ratios."""
    shown, out = {}, {}
    for side in sides:
        ok = [r for r in runs[side] if r is not None]
        if ok:
            shown[side] = sorted(ok, key=lambda r: r["wall"])[len(ok) // 2]
    plain_runs = runs.get("plain", [])

    def ratio(side: str, key: str):
        pairs = [(r[key], p[key]) for r, p in zip(runs[side], plain_runs) if r is not None and p is not None
                 and r[key] and p[key]]
        return statistics.median(a / b for a, b in pairs) if pairs else None

    cols = [s for s in sides if s in shown]
    print(f"\n## {title}\n")
    print("| | " + " | ".join(labels[s] for s in cols) + " |")
    print("|---|" + "---:|" * len(cols))
    rows = [
        ("wall time, whole run (s)", lambda s: fmt(shown[s]["wall"], ".1f")),
        ("outside the rounds: start-up, teardown, final evaluation (s)", lambda s: fmt(shown[s]["outside_rounds"], ".1f")),
        (f"first {WARM_ROUNDS} rounds (s)", lambda s: fmt(sum(shown[s]["round_wall"][:WARM_ROUNDS]), ".1f")),
        (f"s / round, median after round {WARM_ROUNDS}", lambda s: fmt(shown[s]["per_round"], ".3f")),
        ("final test accuracy", lambda s: fmt(shown[s]["metrics"].get("main_accuracy"), ".4f")),
        (f"cores used by the side (of {os.cpu_count()})", lambda s: fmt(shown[s]["own_cores"], ".2f")),
        ("cores used by anything else meanwhile", lambda s: fmt(shown[s]["other_cores"], ".2f")),
        ("**wall time / plain loop's**", lambda s: fmt(ratio(s, "wall"), ".2f") + "x" if ratio(s, "wall") else "-"),
        ("**s / round / plain loop's**", lambda s: fmt(ratio(s, "per_round"), ".2f") + "x"
         if ratio(s, "per_round") else "-"),
    ]
    if "plain" not in shown:
        rows = rows[:-2]  # no plain loop to divide by
    for label, cell in rows:
        print(f"| {label} | " + " | ".join(cell(s) for s in cols) + " |")
    for side in cols:
        out[side] = {"shown": shown[side], "walls": [r["wall"] if r else None for r in runs[side]],
                     "ratio_wall": ratio(side, "wall"), "ratio_per_round": ratio(side, "per_round")}
    if any(len(runs[s]) > 1 for s in cols):
        print(f"\nwall time of each repetition (s): " + "; ".join(
            f"{labels[s]} " + " / ".join(fmt(r and r["wall"], ".1f") for r in runs[s]) for s in cols)
            + ". Shown above: each side's median run, and the median of the per-repetition ratios.")
    return out


def child(args) -> None:
    """A child process: one side of one run."""
    vectorize = None if args.no_vectorize_field else {"fedsim-off": "off", "fedsim-on": "on"}.get(args.side)
    scenario = peers_scenario(args.only, args.rounds, args.dataset, str(args.data_folder), vectorize, args.device)
    result = plain_loop(scenario, args.threads, args.device) if args.side == "plain" else run_fedsim(scenario)
    args.side_out.write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=sorted(MODELS), default=None, help="one model (default: lenet, then mlp)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="rounds of every model run (default: " + ", ".join(f"{m} {v['rounds']}" for m, v in MODELS.items()) + ")")
    parser.add_argument("--repeat", type=int, default=1, metavar="N",
                        help="run every side N times, interleaved; each side's median run is shown (default 1)")
    parser.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated, of {', '.join(SIDES)} (default: all)")
    parser.add_argument("--pfl-python", default=os.environ.get("FEDSIM_PFL_PYTHON"), metavar="PATH",
                        help="the Python of pfl's virtual environment (default: $FEDSIM_PFL_PYTHON)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cuda: the plain loop and fedsim's clients, server and evaluation on the GPU (pfl stays on CPU)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the plain loop and pfl (default 2)")
    parser.add_argument("--wait-quiet", type=float, default=0, metavar="SECONDS",
                        help="before each model, wait up to this long for the machine to be idle")
    parser.add_argument("--json", type=Path, default=None, help="also write the raw numbers to this file")
    parser.add_argument("--verbose", action="store_true", help="show the sides' own output")
    parser.add_argument("--side", choices=[s for s in SIDES if s != "pfl"], default=None, help=argparse.SUPPRESS)
    parser.add_argument("--side-out", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--dataset", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--data-folder", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--no-vectorize-field", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        child(args)
        return

    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    unknown = [s for s in sides if s not in SIDES]
    if unknown:
        parser.error(f"unknown side(s) {', '.join(unknown)}; choose from {', '.join(SIDES)}")
    labels = dict(SIDES)
    skipped: dict[str, str] = {}
    vectorize = has_vectorize()
    if not vectorize:
        if "fedsim-on" in sides:
            skipped["fedsim-on"] = "fedsim's scenario schema has no federation.vectorize field yet"
        labels["fedsim-off"] = "fedsim (no vectorize field: as is)"
    if "pfl" in sides:
        if not args.pfl_python:
            skipped["pfl"] = "no pfl Python given (--pfl-python PATH or $FEDSIM_PFL_PYTHON; the docstring says how to install it)"
        elif not Path(args.pfl_python).exists():
            skipped["pfl"] = f"{args.pfl_python} does not exist"
        else:
            probe = subprocess.run([args.pfl_python, "-c", "import pfl, torch; print(pfl.__version__, torch.__version__)"],
                                   capture_output=True, text=True)
            if probe.returncode != 0:
                skipped["pfl"] = "pfl does not import there: " + (probe.stderr.strip().splitlines() or ["?"])[-1]
            else:
                pfl_version, pfl_torch = probe.stdout.split()
                labels["pfl"] = f"pfl {pfl_version}"
    sides = [s for s in sides if s not in skipped]

    dataset, source = source_dataset()
    models = [m for m in MODELS if not args.only or m == args.only]
    rounds = {m: args.rounds or MODELS[m]["rounds"] for m in models}
    out = {}
    with tempfile.TemporaryDirectory(prefix="fedsim-peers-") as tmp:
        folder = write_subset(dataset, source, Path(tmp) / "data")
        setup = {"dataset": dataset, "folder": folder, "rounds": rounds, "vectorize": vectorize,
                 "pfl_python": args.pfl_python, "problem": {}}
        print(f"{dataset}: its first {USERS * IMAGES_PER_USER:,} training images, {USERS:,} users x {IMAGES_PER_USER} "
              f"(fedsim's iid partition), {COHORT} per round, {LOCAL_EPOCHS} local epoch of batch {BATCH} (lr {LR}), "
              f"seed {SEED}; the full test set after the last round. Sides: {', '.join(labels[s] for s in sides)}.",
              flush=True)
        for side, why in skipped.items():
            print(f"{SIDES[side]}: skipped, {why}", flush=True)
        if "pfl" in sides:
            print(f"pfl: {labels['pfl']} with torch {pfl_torch}, from {args.pfl_python}", flush=True)
        for model in models:
            scenario = peers_scenario(model, rounds[model], dataset, str(folder), "off" if vectorize else None)
            if "pfl" in sides:
                setup["problem"][model] = write_problem(scenario, Path(tmp) / f"pfl-{model}")
            if args.wait_quiet:
                print(f"background load before {model}: {wait_for_quiet(args.wait_quiet):.2f} cores", flush=True)
            runs: dict[str, list] = {s: [] for s in sides}
            failures: dict[str, str] = {}
            for rep in range(args.repeat):  # interleaved, so that a drift in the machine's speed hits every side
                for side in sides:
                    if side in failures:
                        runs[side].append(None)
                        continue
                    try:
                        res = run_side(side, model, args, setup)
                    except SideFailed as err:
                        failures[side] = str(err)
                        runs[side].append(None)
                        print(f"{labels[side]} ({model}): failed, {err}", flush=True)
                        continue
                    runs[side].append(res)
                    print(f"  [{model} {rep + 1}/{args.repeat}] {labels[side]}: {res['wall']:.1f} s, "
                          f"{fmt(res['per_round'], '.3f')} s / round, accuracy "
                          f"{fmt(res['metrics'].get('main_accuracy'), '.4f')}", flush=True)
            title = (f"{model} on {dataset} ({USERS:,} users x {IMAGES_PER_USER} images, {COHORT} per round, "
                     f"{LOCAL_EPOCHS} epoch of batch {BATCH}, lr {LR}, {rounds[model]} rounds)")
            out[model] = report(title, sides, runs, labels)
            for side, why in failures.items():
                out[model].setdefault("failed", {})[side] = why
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    from bench_lock import bench_lock  # one benchmark at a time (lock in the system's temp folder)

    with bench_lock():  # a side's process inherits the parent's hold (bench_lock.HELD)
        main()
