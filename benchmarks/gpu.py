"""GPU timings for the paper-scale Attack of the Tails task (issue #18, item 6).

Two measurements:

1. Per-round time on the CIFAR-10 + VGG-9 task (200 clients, 10 per round, 2 local epochs, batch 32,
   scenarios/paper/cifar10_southwest_blackbox.yaml without its attacker): fedsim's Ray simulation
   with 1, 2, 4 and 8 clients per GPU (`federation.client_gpus` 1, 0.5, 0.25, 0.125) against a plain
   single-process loop on the same GPU (for each sampled client: copy the global VGG-9, SGD over its
   ~250 images, then the FedAvg mean). fedsim's time is the median `wall_seconds` of its middle
   rounds (the first holds the actors' start, the last the central evaluation).
2. Server-side aggregation time at ResNet-18 size (d = 11,173,962) on n = 10/50/100 random updates,
   GPU against CPU, for fedavg, krum, multikrum, median, trimmed_mean, bulyan and (a defense) flame,
   each called as benchmarks/aggregators.py calls it (its helpers are imported, not copied).

Without a GPU it says so, times only the CPU side (the aggregation rules on CPU, and the plain
loop's one-client training on CPU as the reference a GPU run is compared with) and exits 0.
Random tensors stand in for CIFAR-10 when its files are absent; the output says which was used.

`--models vgg9 resnet18 --vectorize on off --shares 0.25` runs the per-round comparison for each
model and each `federation.vectorize` mode. fedsim refuses `on` for a model it cannot vectorise
(ResNet-18's BatchNorm keeps per-client running statistics: fedsim/cohort/vectorized.py's
`vector_refusal`), so that pair is skipped with a printed line instead of a failed run; under
`auto` and `off` such a model trains one client at a time. `benchmarks/gpu_cohorts.sh` runs it with
the rest of the GPU check of vectorised cohorts.

Run: `.venv/bin/python benchmarks/gpu.py [--quick]` (--quick: n in {10, 50}, d = 1,000,000 on CPU,
three local steps for the CPU reference; on a GPU, two rounds per share). Asserts nothing about time.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

_HERE = Path(__file__).resolve().parent
REPO = _HERE.parent
SCENARIO = REPO / "scenarios" / "paper" / "cifar10_southwest_blackbox.yaml"

# benchmarks/aggregators.py is a script, not a package module: load it by path (the repository root
# also has an `aggregators/` folder, which a plain `import aggregators` could pick up instead).
_spec = importlib.util.spec_from_file_location("fedsim_bench_aggregators", _HERE / "aggregators.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

from fedsim.registry import AGGREGATORS, DEFENSES, MODELS  # noqa: E402
from fedsim.cohort.vectorized import vector_refusal  # noqa: E402
from fedsim.training import TrainConfig  # noqa: E402

RESNET18_D = 11_173_962  # parameters of ResNet-18 for CIFAR-10 (10 classes)
RULE_NAMES = ("fedavg", "krum", "multikrum", "median", "trimmed_mean", "bulyan")
DEFENSE_NAMES = ("flame",)
SHARES = (1.0, 0.5, 0.25, 0.125)  # client_gpus: 1, 2, 4, 8 clients per GPU
CLIENTS_PER_ROUND, LOCAL_EPOCHS, BATCH, LR, PARTITION = 10, 2, 32, 0.02, 250  # the paper's task, 50000 / 200 images


def synced(fn, device: torch.device):
    """`fn` followed by a CUDA synchronize, so a timing covers the kernels, not their launch."""
    if device.type != "cuda":
        return fn

    def run():
        fn()
        torch.cuda.synchronize(device)

    return run


def cifar_files(root: Path | None) -> Path | None:
    if root is None:
        return None
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for folder in (root / "cifar-10-batches-py", root / "cifar10" / "cifar-10-batches-py"):
        if all((folder / n).is_file() for n in names):
            return folder
    return None


# --------------------------------------------------------------------------- 1. per-round time


def net(name: str = "vgg9") -> torch.nn.Module:
    entry = MODELS.get(name)
    return entry.obj((3, 32, 32), 10, entry.params())


def plain_client(global_model, x, y, device, steps: int | None = None, name: str = "vgg9") -> torch.Tensor:
    """One client's local training, the way a single-process script does it: returns its flat update."""
    model = net(name).to(device)
    model.load_state_dict(global_model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9, weight_decay=1e-4)
    loss_fn = torch.nn.CrossEntropyLoss()
    done = 0
    for _ in range(LOCAL_EPOCHS):
        order = torch.randperm(len(x), device=device)
        for i in range(0, len(x), BATCH):
            idx = order[i : i + BATCH]
            opt.zero_grad(set_to_none=True)
            loss_fn(model(x[idx]), y[idx]).backward()
            opt.step()
            done += 1
            if steps is not None and done >= steps:
                break
        if steps is not None and done >= steps:
            break
    new = torch.nn.utils.parameters_to_vector(model.parameters())
    return new - torch.nn.utils.parameters_to_vector(global_model.parameters())


def plain_round(global_model, data, device, name: str = "vgg9") -> float:
    """Seconds for one FedAvg round of 10 clients in one process."""
    start = time.perf_counter()
    updates = torch.stack([plain_client(global_model, x, y, device, name=name) for x, y in data])
    mean = updates.mean(dim=0)
    torch.nn.utils.vector_to_parameters(torch.nn.utils.parameters_to_vector(global_model.parameters()) + mean,
                                        global_model.parameters())
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def random_clients(device, n: int = CLIENTS_PER_ROUND, size: int = PARTITION):
    gen = torch.Generator().manual_seed(0)
    return [(torch.randn(size, 3, 32, 32, generator=gen).to(device), torch.randint(0, 10, (size,), generator=gen).to(device))
            for _ in range(n)]


def write_random_cifar(folder: Path) -> None:
    """Random uint8 images in the official python-version layout, for fedsim's cifar10 loader."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {b"data": rng.integers(0, 256, (10000, 3072), dtype=np.uint8),
                 b"labels": rng.integers(0, 10, 10000).tolist(), b"batch_label": name.encode()}
        with open(folder / name, "wb") as f:
            pickle.dump(batch, f, protocol=2)


def fedsim_round_seconds(share: float, rounds: int, data_dir: Path, out: Path, name: str = "vgg9",
                         vectorize: str = "auto") -> float:
    """Median wall_seconds of fedsim's middle rounds with `share` of a GPU per client actor."""
    sets = ["attack=null", f"federation.rounds={rounds}", f"federation.client_gpus={share}", "init.pretrain_epochs=0",
            "evaluation.initial=false", f"evaluation.every={rounds}", "output.checkpoints=false", f"data.dir={data_dir}",
            f"federation.vectorize={vectorize}"]
    if name != "vgg9":
        sets.append(f"model={{name: {name}}}")
    folder = out / f"{name}_{vectorize}_share_{share}"
    cmd = [sys.executable, "-m", "fedsim.cli", "run", str(SCENARIO), "--output", str(folder)]
    for s in sets:
        cmd += ["--set", s]
    subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    lines = [json.loads(line) for f in folder.rglob("rounds.jsonl") for line in f.read_text().splitlines() if line.strip()]
    secs = [r["wall_seconds"] for r in lines if r.get("round", 0) >= 1]
    middle = secs[1:-1] or secs  # drop the actors' start-up round and the evaluated last round
    return statistics.median(middle)


def per_round(args, gpu: bool) -> None:
    root = bench_data_dir()
    real = cifar_files(root)
    print("\n== 1. per-round time, CIFAR-10 + VGG-9 (200 clients, 10 per round, 2 local epochs, batch 32) ==")
    if not gpu:
        device = torch.device("cpu")
        steps = 3 if args.quick else None
        data = random_clients(device, n=1)
        model = net()
        secs = bench.median_seconds(lambda: plain_client(model, *data[0], device, steps), args.repeats, budget_s=30.0)
        what = f"{steps} SGD steps" if steps else f"{LOCAL_EPOCHS} epochs of {PARTITION} images"
        print("No GPU present: fedsim's GPU simulation and the plain GPU loop were not run.")
        print(f"CPU reference (random 3x32x32 tensors stand in for CIFAR-10): plain loop, one client, {what}: "
              f"{secs:.2f} s ({secs / (steps or LOCAL_EPOCHS * -(-PARTITION // BATCH)) * 1e3:.0f} ms per step of batch {BATCH})")
        return
    device = torch.device("cuda")
    data = random_clients(device)
    plain = {}
    for name in args.models:
        model = net(name).to(device)
        plain_round(model, data, device, name)  # warm-up: cuDNN autotuning, allocator
        plain[name] = statistics.median(plain_round(model, data, device, name) for _ in range(args.repeats))
        print(f"plain single-process loop, {name}, on {torch.cuda.get_device_name(device)} (random tensors, {PARTITION} "
              f"images a client): {plain[name]:.2f} s per round")
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = root
        if real is None:
            data_dir = Path(tmp) / "data"
            write_random_cifar(data_dir / "cifar-10-batches-py")
            print("CIFAR-10 files absent: fedsim runs on random images in the CIFAR-10 file layout")
        else:
            print(f"fedsim runs on the CIFAR-10 files in {real}")
        rounds = 3 if args.quick else 5
        print(f"{'model':>9} {'vectorize':>9} {'clients per GPU':>16} {'client_gpus':>12} {'fedsim s/round':>15} "
              f"{'fedsim / plain':>15}")
        for name in args.models:
            refusal = vector_refusal(net(name), TrainConfig(epochs=LOCAL_EPOCHS, batch_size=BATCH, lr=LR))
            for vectorize in args.vectorize:
                if vectorize == "on" and refusal:  # the scenario check would refuse the run (exit status 2)
                    print(f"{name:>9} {vectorize:>9}   skipped: fedsim refuses federation.vectorize=on here ({refusal})")
                    continue
                for share in args.shares:
                    head = f"{name:>9} {vectorize:>9} {round(1 / share):>16} {share:>12g}"
                    try:
                        secs = fedsim_round_seconds(share, rounds, data_dir, Path(tmp) / "runs", name, vectorize)
                    except subprocess.CalledProcessError as err:
                        print(f"{head} {'failed':>15}   ({err})")
                        continue
                    print(f"{head} {secs:>15.2f} {secs / plain[name]:>15.2f}")


# --------------------------------------------------------------------------- 2. aggregation


def on_device(ctx, device):
    """benchmarks/aggregators.py's RoundContext with its tensors on `device`."""
    from dataclasses import replace

    prev = None if ctx.previous_aggregate is None else ctx.previous_aggregate.to(device)
    return replace(ctx, global_weights=ctx.global_weights.to(device), previous_aggregate=prev)


def rule_call(name, updates, weights):
    entry = AGGREGATORS.get(name)
    if updates.device.type == "cpu":
        return bench.rule_call(entry, updates, weights)
    return bench.rule_call(entry, updates, weights, on_device(bench.context(updates), updates.device))


def defense_call(name, updates, weights):
    if updates.device.type == "cpu":
        return bench.defense_call(name, updates, weights)
    from fedsim.updates import UpdateBatch

    entry = DEFENSES.get(name)
    defense = entry.obj(entry.spec_model()(name=name))
    batch = UpdateBatch(updates, weights, tuple(range(updates.shape[0])))

    def once():
        ctx = on_device(bench.context(updates, 5), updates.device)
        kept, _ = defense.before(batch, ctx)
        defense.after(kept.updates.mean(dim=0), ctx)

    return once


def aggregation(args, gpu: bool) -> None:
    d = 1_000_000 if args.quick and not gpu else RESNET18_D
    sizes_n = tuple(args.n) if args.n else (10, 50) if args.quick else (10, 50, 100)
    names = [n for n in RULE_NAMES if n in AGGREGATORS.names()] + [n for n in DEFENSE_NAMES if n in DEFENSES.names()]
    missing = [n for n in RULE_NAMES + DEFENSE_NAMES if n not in names]
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if gpu else [])
    where = "CPU and GPU" if gpu else "CPU only (no GPU present)"
    print(f"\n== 2. server-side aggregation, d = {d:,}"
          f"{' (ResNet-18 size)' if d == RESNET18_D else ' (--quick on CPU; ResNet-18 is 11,173,962)'}, random updates, {where} ==")
    if missing:
        print(f"not registered, skipped: {', '.join(missing)}")
    print("ms per aggregation, median of up to "
          f"{args.repeats} runs (fewer once {args.budget:g} s are spent on one case); flame is a defense (before + after)")
    header = f"{'rule':<14}" + "".join(f"{f'{dev.type} n={n}':>14}" for n in sizes_n for dev in devices)
    if gpu:
        header += "".join(f"{f'cpu/gpu n={n}':>14}" for n in sizes_n)
    print(header)
    gen = torch.Generator().manual_seed(0)
    cells = {name: {} for name in names}
    for n in sizes_n:
        if bench.PEAK_COPIES * n * d * 4 > args.memory_gb * 1e9:
            print(f"n={n} skipped: {bench.PEAK_COPIES * n * d * 4 / 1e9:.1f} GB of host memory, over --memory-gb {args.memory_gb:g}")
            for name in names:
                for dev in devices:
                    cells[name][(dev.type, n)] = None
            continue
        cpu_updates = torch.randn(n, d, generator=gen)
        weights_cpu = torch.randint(10, 500, (n,), generator=gen).float()
        for dev in devices:
            updates, weights = cpu_updates.to(dev), weights_cpu.to(dev)
            for name in names:
                call = defense_call(name, updates, weights) if name in DEFENSE_NAMES else rule_call(name, updates, weights)
                fn = synced(call, dev)
                try:
                    if dev.type == "cuda":
                        fn()  # warm-up: kernels, allocator
                    cells[name][(dev.type, n)] = bench.median_seconds(fn, args.repeats, budget_s=args.budget)
                except Exception as err:  # a rule not yet device-aware (docs/gpu.md): report, go on
                    cells[name][(dev.type, n)] = f"error: {type(err).__name__}"
            del updates, weights
        del cpu_updates

    def fmt(v):
        return "skipped" if v is None else v[:13] if isinstance(v, str) else f"{v * 1e3:.1f}"

    for name in names:
        row = f"{name:<14}" + "".join(f"{fmt(cells[name].get((dev.type, n))):>14}" for n in sizes_n for dev in devices)
        if gpu:
            for n in sizes_n:
                c, g = cells[name].get(("cpu", n)), cells[name].get(("cuda", n))
                row += f"{(f'{c / g:.1f}x' if isinstance(c, float) and isinstance(g, float) else '-'):>14}"
        print(row)


def bench_data_dir() -> Path | None:
    env = os.environ.get("FEDSIM_DATA_DIR")
    if env and Path(env).is_dir():
        return Path(env)
    shared = REPO.parent / "shared" / "data"
    return shared if shared.is_dir() else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small n and d on CPU, fewer rounds and steps")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--budget", type=float, default=5.0, help="seconds spent at most on repeats of one case")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--skip-rounds", action="store_true", help="only the aggregation timings")
    parser.add_argument("--skip-aggregation", action="store_true", help="only the per-round timings")
    parser.add_argument("--models", nargs="*", default=["vgg9"], help="per-round models (vgg9, resnet18)")
    parser.add_argument("--vectorize", nargs="*", default=["auto"], choices=["auto", "on", "off"],
                        help="fedsim's federation.vectorize values to run (each a run per share)")
    parser.add_argument("--shares", nargs="*", type=float, default=list(SHARES), help="client_gpus values")
    parser.add_argument("--n", type=int, nargs="*", help="numbers of updates to aggregate (default 10 50 100; --quick 10 50)")
    parser.add_argument("--memory-gb", type=float, default=bench.MEMORY_LIMIT_BYTES / 1e9,
                        help="skip an n whose updates (three copies) would need more host memory than this")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    gpu = torch.cuda.is_available()
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads, {os.cpu_count()} CPUs, load average {load}")
    if gpu:
        print(f"GPU: {torch.cuda.get_device_name(0)} ({torch.cuda.device_count()} visible)")
    else:
        print(f"No GPU present (torch.cuda.is_available() is False; this torch build: {torch.__version__}, "
              f"CUDA {torch.version.cuda or 'none'}): CPU side only")
    if not args.skip_rounds:
        per_round(args, gpu)
    if not args.skip_aggregation:
        aggregation(args, gpu)
    return 0


if __name__ == "__main__":
    sys.exit(main())
