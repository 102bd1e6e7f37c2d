"""fedsim against a plain PyTorch loop doing the same federated work, side by side in one benchmark run.

Run: `.venv/bin/python benchmarks/overhead.py [--rounds 10] [--only mnist|digits]
[--repeat 3]`; it waits first for the benchmark lock (benchmarks/bench_lock.py), so no two benchmarks
time each other. The machine's speed drifts (here by 10-40% within minutes on a shared host): `--repeat`
interleaves the two sides and reports the median pair.

Each side of each pair runs in a fresh Python process started by this script (as a user's script
or `fedsim run` would): fedsim sets glibc malloc thresholds in its own process
(fedsim/engine/allocator.py), which a plain loop run later in the same process would inherit, and a
process that has already run a loop is warmer than a new one (a plain loop's first run here was
5-10 s slower than its second in the same process). `--plain-allocator fedsim` gives the plain
loop fedsim's malloc settings too.

Two scenarios, each run first as a plain single-process loop written here and then through fedsim
(Flower's Ray simulation engine):

* `mnist`: MNIST + LeNet, 200 clients (Dirichlet 0.5), 10 sampled per round, 2 local epochs, batch
  32, an ARDIS edge-case attacker (black-box) in rounds 5 and 10, 10 rounds, full central
  evaluation (10,000 test images + the ARDIS backdoor set) after every round. Needs mnist.npz and
  ardis_iv.npz in $FEDSIM_DATA_DIR or ../shared/data.
* `digits`: the quickstart (scenarios/quickstart.yaml): 20 clients, 10 per round, 15 rounds.

The plain loop is what a careful researcher writes without a framework: one process, torch's
default thread count, data loaded once, clients trained one after another on the same clients,
partitions, attacker data, seeds and hyper-parameters fedsim uses (taken from fedsim's data helpers
so both sides see identical arrays), FedAvg by example count, the same central evaluation.

Printed per scenario: wall time of each and the ratio fedsim / plain, the final metrics of both
(they match closely but not bit for bit: the plain loop trains with two threads, fedsim's clients
with one), and the time split. For the plain loop the split is sequential and adds up to the wall
time. For fedsim the work categories are busy seconds, measured where the work runs (clients time
their handler calls; the server logs its own encode/decode, aggregation and evaluation seconds to
the `fedsim.timing` logger), and they overlap: clients train two at a time (and the central
evaluation of round t runs beside round t+1's training, `evaluation.overlap`), so they add
up to more than the wall time.
`framework` is the wall time outside the rounds (Ray and actor start-up, teardown) plus the
server's time inside rounds spent neither on its own work nor waiting for a client to train.
The cores used by the run itself come from the CPU time of this process and everything it
started (Ray's processes included, sampled from /proc); the cores used by anything else are the
machine's busy time (/proc/stat) minus that: a measurement with much of the latter is skewed.
Nothing is asserted about time.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent

import fedsim.engine.simulate  # noqa: E402,F401  (sets Flower/Ray environment defaults before they are imported)
from fedsim.flower.options import EngineOptions  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402

from fedsim.attacks.schedules import sample_round  # noqa: E402
from fedsim.client.app import make_client_app  # noqa: E402
from fedsim.runs.results import read_rounds  # noqa: E402
from fedsim.runtime import Runtime  # noqa: E402
from fedsim.scenario import load_scenario, validate_scenario  # noqa: E402
from fedsim.seeding import SAMPLE, TRAIN, derive_seed, numpy_rng  # noqa: E402
from machine_cpu import TreeCPU, cores_busy, cpu_jiffies, wait_for_quiet  # noqa: E402  (this folder is on sys.path)
from plain_steps import local_sgd  # noqa: E402

REPO = _HERE.parent


def data_dir() -> str:
    env = os.environ.get("FEDSIM_DATA_DIR")
    return env if env else str(REPO.parent / "shared" / "data")


def mnist_scenario(rounds: int):
    return validate_scenario(
        {
            "name": "overhead_mnist",
            "seed": 0,
            "data": {"dataset": "mnist", "dir": data_dir(),
                     "partition": {"name": "dirichlet", "alpha": 0.5, "min_partition_size": 10}},
            "model": "lenet",
            "federation": {"num_clients": 200, "clients_per_round": 10, "rounds": rounds, "local_epochs": 2,
                           "batch_size": 32, "lr": 0.05, "momentum": 0.9, "weight_decay": 1e-4},
            "aggregator": "fedavg",
            "attack": {"name": "edge_case", "mode": "blackbox", "num_attackers": 1,
                       "schedule": {"name": "fixed_frequency", "every": 5, "first": 5},
                       "edge_set": {"name": "ardis", "source_class": 7, "target_class": 1},
                       "num_edge": 66, "num_clean": 100},
            "evaluation": {"every": 1, "initial": False},
        },
        "overhead_mnist",
    )


def digits_scenario(rounds: int | None):
    overrides = [f"federation.rounds={rounds}"] if rounds else []
    return load_scenario(REPO / "scenarios" / "quickstart.yaml", overrides)


# --- the plain loop ---------------------------------------------------------------------------
def plain_loop(scenario) -> dict:
    """The same federated work as fedsim, written as one plain loop; returns wall time, split, metrics."""
    fed, ev = scenario.federation, scenario.evaluation
    if scenario.aggregator.name != "fedavg" or scenario.defenses or scenario.compression.name != "none":
        raise SystemExit("the plain loop implements FedAvg without defenses or compression only")
    split = dict.fromkeys(["load", "train", "aggregate", "evaluate"], 0.0)
    cpu0, tree, t0 = cpu_jiffies(), TreeCPU(), time.perf_counter()

    rt = Runtime(scenario)  # fedsim's loaders: the very arrays fedsim's clients and server use
    def tensor(a):  # into memory: fedsim's cache hands large arrays over memory-mapped, read-only
        return torch.from_numpy(np.array(a))

    x_train, y_train = tensor(rt.data.x_train), tensor(rt.data.y_train)
    parts = [torch.from_numpy(p) for p in rt.partitions]
    x_test, y_test = tensor(rt.data.x_test), tensor(rt.data.y_test)
    x_bd, y_bd = (torch.from_numpy(a) for a in rt.attack.backdoor_test_set(rt)) if rt.attack else (None, None)
    source = scenario.attack.edge_set.source_class if rt.attack else None
    model = rt.build_model()
    rt.layout.load_into(model, rt.initial_weights())  # the same initial model as fedsim's
    split["load"] = time.perf_counter() - t0

    metrics = {}
    for rnd in range(1, fed.rounds + 1):
        t = time.perf_counter()
        rng = numpy_rng(scenario.seed, SAMPLE, rnd)
        if rt.attack is not None:
            sampled, strikers = sample_round(scenario.attack.schedule, rnd, fed.num_clients, fed.clients_per_round,
                                             rt.attackers, rng)
        else:
            sampled, strikers = sorted(rng.choice(fed.num_clients, fed.clients_per_round, replace=False).tolist()), []
        lr = fed.lr * fed.lr_decay ** (rnd - 1)
        total, weighted = 0, None
        for pid in sampled:
            if pid in strikers:
                xa, ya = rt.attack.training_set(rt, pid)
                x, y = torch.from_numpy(xa), torch.from_numpy(ya)
            else:
                x, y = x_train[parts[pid]], y_train[parts[pid]]
            seed = derive_seed(scenario.seed, TRAIN, rnd, pid)
            local = local_sgd(model, x, y, lr=lr, epochs=fed.local_epochs, batch_size=fed.batch_size, seed=seed,
                              momentum=fed.momentum, weight_decay=fed.weight_decay)
            n = len(x)
            state = {k: v.detach() * n for k, v in local.state_dict().items()}
            weighted = state if weighted is None else {k: weighted[k] + state[k] for k in state}
            total += n
        t_agg = time.perf_counter()
        split["train"] += t_agg - t
        model.load_state_dict({k: v / total for k, v in weighted.items()})
        t_eval = time.perf_counter()
        split["aggregate"] += t_eval - t_agg
        model.eval()
        with torch.no_grad():
            logits = torch.cat([model(x_test[i : i + ev.batch_size]) for i in range(0, len(x_test), ev.batch_size)])
            pred = logits.argmax(1)
            metrics = {
                "main_accuracy": float((pred == y_test).float().mean()),
                "main_loss": float(torch.nn.functional.cross_entropy(logits, y_test)),
            }
            if x_bd is not None:
                bd = torch.cat([model(x_bd[i : i + ev.batch_size]).argmax(1) for i in range(0, len(x_bd), ev.batch_size)])
                metrics["backdoor_success"] = float((bd == y_bd).float().mean())
                mask = y_test == source
                metrics["source_class_accuracy"] = float((pred[mask] == source).float().mean())
        split["evaluate"] += time.perf_counter() - t_eval
    wall = time.perf_counter() - t0
    cores = cores_busy(cpu0, cpu_jiffies())
    return {"wall": wall, "split": split, "metrics": metrics, "cores": cores, "own_cores": tree.seconds() / wall}


# --- fedsim, with the clients' handler calls timed ------------------------------------------------
class TimedClientApp(ClientApp):
    """Delegates every message to the scenario's ClientApp and appends (start, end) of each call to a
    file in `folder` (one per worker process), so the benchmark can add up client busy time."""

    def __init__(self, inner: ClientApp, folder: str) -> None:
        super().__init__()
        self.inner, self.folder = inner, folder

    def __call__(self, message, context):
        start = time.time()
        reply = self.inner(message, context)
        line = json.dumps({"type": message.metadata.message_type, "start": start, "end": time.time()})
        with open(Path(self.folder) / f"calls-{os.getpid()}.jsonl", "a") as fh:
            fh.write(line + "\n")
        return reply


class TimingRecords(logging.Handler):
    """Collects the per-round timings ScenarioStrategy logs on `fedsim.timing`."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.rounds: dict[int, dict] = {}

    def emit(self, record: logging.LogRecord) -> None:
        if hasattr(record, "fedsim_timing"):
            self.rounds[record.fedsim_round] = record.fedsim_timing


# Levers that are scenario settings: "off" runs the scenario with these overrides instead
SCENARIO_LEVERS = {
    "one-thread-actors": ("two single-threaded client actors, not one actor with two threads",
                          {"federation": {"client_cpus": 2.0}}),
    "no-round-0-eval": ("no evaluation of the initial model", {"evaluation": {"initial": True}}),
}


# Levers that turn one engine option off, to measure what it buys (--disable NAME): what each does,
# and the EngineOptions field (fedsim/flower/options.py) with its value when off.
LEVERS = {
    "compact-app": ("ClientApp pickled as the scenario's JSON, not by value, with every message", None),
    "overlap": ("evaluation of round t on one thread beside round t+1's training (evaluation.overlap)",
                ("overlap_evaluation", False)),
    "known-nodes": ("node -> partition map taken from the engine, no QUERY round", ("known_simulation_nodes", False)),
    "nodes-on-demand": ("a simulated node registered with the link state when first messaged, not all before round 1",
                        ("nodes_on_demand", False)),
    "fast-delivery": ("one scan of stored messages per delivery sweep", ("fast_message_delivery", False)),
    "light-actor": ("fedsim's client actor class, cheap to import (not Flower's)", ("light_actor", False)),
    "largest-first": ("the round's messages go out largest client first", ("largest_first", False)),
    "prestarted-workers": ("a local Ray started without a job runtime environment, so actors take Ray's prestarted workers",
                           ("prestarted_workers", False)),
    "malloc": ("glibc malloc thresholds raised in this process and the Ray workers (fedsim/engine/allocator.py)",
               ("malloc_settings", False)),
    "prompt-stop": ("the engine's threads wait at most 0.05 s on their queues (Flower: 1 s) before seeing the stop",
                    ("queue_wait_seconds", 1.0)),
    **{k: (what, None) for k, (what, _) in SCENARIO_LEVERS.items()},
}


def engine_options(disabled: tuple[str, ...]) -> EngineOptions:
    """The engine options with the `disabled` levers off (the defaults otherwise)."""
    off = dict(LEVERS[name][1] for name in disabled if LEVERS[name][1] is not None)
    return EngineOptions(**off)


def with_overrides(scenario, overrides: dict):
    from fedsim.scenario import scenario_dict

    raw = scenario_dict(scenario)
    for section, values in overrides.items():
        raw[section] = {**raw[section], **values}
    return validate_scenario(raw, scenario.name)


def run_fedsim(scenario, disabled: tuple[str, ...] = ()) -> dict:
    from ray import cloudpickle

    from fedsim.engine.ray_actor import CompactClientApp
    from fedsim.engine.simulate import simulate

    if __name__ != "__main__":  # imported (not run as a script): the actors cannot import this module
        cloudpickle.register_pickle_by_value(sys.modules[__name__])

    for name in disabled:
        if name in SCENARIO_LEVERS:
            scenario = with_overrides(scenario, SCENARIO_LEVERS[name][1])
    handler = TimingRecords()
    timing_logger = logging.getLogger("fedsim.timing")
    timing_logger.setLevel(logging.INFO)
    timing_logger.addHandler(handler)
    try:
        with tempfile.TemporaryDirectory(prefix="fedsim-overhead-") as tmp:
            calls = Path(tmp) / "calls"
            calls.mkdir()
            inner = make_client_app(scenario) if "compact-app" in disabled else CompactClientApp.of(scenario)
            app = TimedClientApp(inner, str(calls))
            cpu0, tree, t0_epoch, t0 = cpu_jiffies(), TreeCPU(), time.time(), time.perf_counter()
            run_dir = simulate(scenario, run_dir=Path(tmp) / "run", client_app=app, options=engine_options(disabled))
            wall, t1_epoch = time.perf_counter() - t0, time.time()
            cores = cores_busy(cpu0, cpu_jiffies())
            own_cores = tree.seconds() / wall
            rounds = read_rounds(run_dir)
            records = [json.loads(line) for f in calls.glob("*.jsonl") for line in f.read_text().splitlines()]
    finally:
        timing_logger.removeHandler(handler)
    train_calls = [r for r in records if r["type"] == "train"]
    query_calls = [r for r in records if r["type"] != "train"]
    timing = [handler.rounds.get(r["round"], {}) for r in rounds]

    def total(key):
        return sum(t.get(key, 0.0) for t in timing)

    round_wall = sum(r["wall_seconds"] for r in rounds)
    client_busy = sum(r["end"] - r["start"] for r in train_calls)
    first_train = min((r["start"] for r in train_calls), default=t0_epoch)
    # inside a round the server encodes, waits for the clients, decodes, aggregates, and waits for
    # the previous round's evaluation; the last round's evaluation (all of them with the overlap
    # off) is on the round's path too. What is left of the round is framework.
    inline_eval = total("evaluate") if "overlap" in disabled else (timing[-1].get("evaluate", 0.0) if timing else 0.0)
    server_path = sum(total(k) for k in ("encode", "waiting_for_clients", "decode", "aggregate", "evaluation_wait"))
    server_path += inline_eval
    split = {
        "local training": client_busy,
        "serialization": total("encode") + total("decode"),
        "aggregation": total("aggregate"),
        "evaluation": total("evaluate"),
        "framework": max(wall - round_wall, 0.0) + max(round_wall - server_path, 0.0),
    }
    final = next((r for r in reversed(rounds) if r.get("main_accuracy") is not None), {})
    return {
        "wall": wall,
        "split": split,
        "metrics": {k: final.get(k) for k in ("main_accuracy", "main_loss", "backdoor_success", "source_class_accuracy")},
        "cores": cores,
        "own_cores": own_cores,
        "start_up": first_train - t0_epoch,
        "teardown": t1_epoch - max((r["end"] for r in train_calls), default=t1_epoch),
        "round_wall": [r["wall_seconds"] for r in rounds],
        "queries": len(query_calls),
        "client_calls": len(train_calls),
    }


# --- report -------------------------------------------------------------------------------------
def fmt(v) -> str:
    return "-" if v is None else (f"{v:.4f}" if isinstance(v, float) else str(v))


def report(name: str, plain: dict, fed: dict) -> None:
    print(f"\n## {name}\n")
    print("| | plain loop | fedsim |")
    print("|---|---:|---:|")
    print(f"| wall time (s) | {plain['wall']:.1f} | {fed['wall']:.1f} |")
    print(f"| **ratio fedsim / plain** | | **{fed['wall'] / plain['wall']:.2f}x** |")
    print(f"| cores used by the run itself (of {os.cpu_count()}) | {plain['own_cores']:.2f} | {fed['own_cores']:.2f} |")
    print(f"| cores used by anything else on the machine meanwhile | {max(plain['cores'] - plain['own_cores'], 0):.2f} "
          f"| {max(fed['cores'] - fed['own_cores'], 0):.2f} |")
    ps = plain["split"]
    rows = [
        ("local training", ps["train"], fed["split"]["local training"]),
        ("serialization", 0.0, fed["split"]["serialization"]),
        ("aggregation", ps["aggregate"], fed["split"]["aggregation"]),
        ("evaluation", ps["evaluate"], fed["split"]["evaluation"]),
        ("framework / data loading", ps["load"], fed["split"]["framework"]),
    ]
    for label, a, b in rows:
        print(f"| {label} (s) | {a:.1f} | {b:.1f} |")
    print(f"| fedsim: start-up until the first client trains (s) | | {fed['start_up']:.1f} |")
    print(f"| fedsim: last client reply until the run returns (s) | | {fed['teardown']:.1f} |")
    for key in ("main_accuracy", "backdoor_success", "source_class_accuracy"):
        print(f"| final {key} | {fmt(plain['metrics'].get(key))} | {fmt(fed['metrics'].get(key))} |")
    print(f"\nfedsim round walls (s): {', '.join(f'{w:.1f}' for w in fed['round_wall'])}; "
          f"{fed['client_calls']} client trainings, {fed['queries']} other client messages")


def run_side(side: str, name: str, args, disabled: tuple[str, ...] = ()) -> dict:
    """One side of a pair (`plain` or `fedsim`) in a fresh Python process, so that neither side
    inherits the other's process state: fedsim sets malloc thresholds in its process
    (fedsim/engine/allocator.py), and a process that has already run a loop is warmer than a new one."""
    import subprocess

    with tempfile.TemporaryDirectory(prefix="fedsim-overhead-side-") as tmp:
        out = Path(tmp) / "side.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--side", side, "--only", name, "--side-out", str(out),
               "--rounds", str(args.rounds)]
        if args.digits_rounds:
            cmd += ["--digits-rounds", str(args.digits_rounds)]
        if args.plain_allocator:
            cmd += ["--plain-allocator", args.plain_allocator]
        for lever in disabled:
            cmd += ["--disable", lever]
        subprocess.run(cmd, check=True)
        return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10, help="rounds of the MNIST scenario (default 10)")
    parser.add_argument("--digits-rounds", type=int, default=None, help="rounds of the quickstart (default: its 15)")
    parser.add_argument("--only", choices=["mnist", "digits"], default=None)
    parser.add_argument("--repeat", type=int, default=1, metavar="N",
                        help="run plain loop and fedsim N times, interleaved; the median pair is shown (default 1)")
    parser.add_argument("--json", type=Path, default=None, help="also write the raw numbers to this file")
    parser.add_argument("--disable", action="append", default=[], choices=sorted(LEVERS),
                        help="run fedsim with this lever off (repeatable): " + "; ".join(
                            f"{k}: {v[0]}" for k, v in LEVERS.items()))
    parser.add_argument("--wait-quiet", type=float, default=0, metavar="SECONDS",
                        help="before each scenario, wait up to this long for the machine to be idle")
    parser.add_argument("--compare", action="store_true",
                        help="also run fedsim once per lever with that lever off (to see what each buys)")
    parser.add_argument("--levers", default=",".join(LEVERS), help="with --compare: which levers, comma-separated")
    parser.add_argument("--plain-allocator", choices=["default", "fedsim"], default=None,
                        help="fedsim: the plain loop runs with fedsim's malloc settings too (default: glibc's)")
    parser.add_argument("--side", choices=["plain", "fedsim"], default=None, help=argparse.SUPPRESS)
    parser.add_argument("--side-out", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    scenarios = {"mnist": lambda: mnist_scenario(args.rounds), "digits": lambda: digits_scenario(args.digits_rounds)}
    if args.side:  # a child process: one side of one pair
        scenario = scenarios[args.only]()
        if args.side == "plain":
            if args.plain_allocator == "fedsim":
                from fedsim.engine.allocator import apply_to_this_process

                apply_to_this_process()
            result = plain_loop(scenario)
        else:
            result = run_fedsim(scenario, tuple(args.disable))
        args.side_out.write_text(json.dumps(result))
        return
    out = {}
    for name in scenarios:
        if args.only and name != args.only:
            continue
        scenario = scenarios[name]()
        if args.wait_quiet:
            print(f"background load before {name}: {wait_for_quiet(args.wait_quiet):.2f} cores", flush=True)
        pairs = []
        for _ in range(args.repeat):  # interleaved, so that a drift in the machine's speed hits both sides
            plain = run_side("plain", name, args)
            pairs.append((plain, run_side("fedsim", name, args, tuple(args.disable))))
        ratios = [f["wall"] / p["wall"] for p, f in pairs]
        plain, fed = pairs[sorted(range(len(pairs)), key=ratios.__getitem__)[len(pairs) // 2]]  # the median pair
        off = f", levers off: {', '.join(args.disable)}" if args.disable else ""
        report(f"{name} ({scenario.federation.num_clients} clients, {scenario.federation.clients_per_round} per "
               f"round, {scenario.federation.rounds} rounds{off})", plain, fed)
        if len(pairs) > 1:
            print(f"\n{len(pairs)} interleaved pairs (plain / fedsim s, ratio): " + "; ".join(
                f"{p['wall']:.1f} / {f['wall']:.1f} ({r:.2f}x)" for (p, f), r in zip(pairs, ratios))
                + f". Shown above: the median pair ({fed['wall'] / plain['wall']:.2f}x).")
        out[name] = {"plain": plain, "fedsim": fed, "ratio": fed["wall"] / plain["wall"], "ratios": ratios,
                     "pairs": [{"plain": p["wall"], "fedsim": f["wall"]} for p, f in pairs]}
        if args.compare:
            print(f"\n### {name}: each lever off in turn (a fresh process each; plain loop {plain['wall']:.1f} s)\n")
            print("| lever off | what it does | fedsim wall (s) | ratio | start-up (s) |")
            print("|---|---|---:|---:|---:|")
            print(f"| (none) | | {fed['wall']:.1f} | {fed['wall'] / plain['wall']:.2f}x | {fed['start_up']:.1f} |")
            for lever, (what, _) in LEVERS.items():
                if lever not in args.levers.split(","):
                    continue
                res = run_side("fedsim", name, args, (lever,))
                out[name][f"without {lever}"] = res
                print(f"| {lever} | {what} | {res['wall']:.1f} | {res['wall'] / plain['wall']:.2f}x | {res['start_up']:.1f} |",
                      flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    from bench_lock import bench_lock  # one benchmark at a time (lock in the system's temp folder)

    with bench_lock():
        main()
