"""Time per aggregation of the robust rules and defenses at LeNet size, next to one X @ X.T on the same data.

Every registered [n, d] rule (DETOX needs redundant groups: benchmarks/detox.py) and the defenses
that work on the updates alone: `before` + `after` on the same batch, FLDetector in its steady
state (its window filled first). FLTrust is timed with the server's update given (its training on
the root dataset, a client's local training, is not included). Also Krum's Gram product against a
per-pair loop.

Run: `.venv/bin/python benchmarks/aggregators.py [--quick]`. Prints median wall-clock times of a few
repeats with torch on 2 threads, and ratios measured in the same run. Asserts nothing about time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent

import torch  # noqa: E402

from fedsim.aggregators.base import call_rule, vector_rule_names  # noqa: E402
from fedsim.aggregators.krum import scores_from_distances  # noqa: E402
from fedsim.models.layout import ModelLayout  # noqa: E402
from fedsim.registry import AGGREGATORS, DEFENSES  # noqa: E402
from fedsim.server.tools import GivenServerUpdate  # noqa: E402
from fedsim.updates import RoundContext, UpdateBatch  # noqa: E402

# Rules that take any batch of updates (DETOX needs redundant groups: benchmarks/detox.py).
RULES = tuple(n for n in vector_rule_names() if not AGGREGATORS.get(n).traits.needs_groups)
# Defenses that need nothing but the updates (DeepSight and CRFL's certification run models).
DEFENSE_NAMES = ("norm_clipping", "weak_dp", "flame", "foolsgold", "rlr", "freqfed", "fldetector")


def context(updates: torch.Tensor, rnd: int = 1) -> RoundContext:
    d = updates.shape[1]
    layout = ModelLayout(names=("hidden", "out.weight", "out.bias"), shapes=((d - 110,), (10, 10), (10,)))
    return RoundContext(rnd, torch.zeros(d), layout, torch.Generator().manual_seed(rnd),
                        previous_aggregate=updates.mean(dim=0), tools=GivenServerUpdate(updates.mean(dim=0)))


def rule_call(entry, updates, weights, ctx=None):
    """The rule with its default parameters, called as the server calls it (`call_rule`)."""
    spec = entry.spec_model()(name=entry.name)
    ctx = ctx if ctx is not None else context(updates)
    return lambda: call_rule(spec, updates, weights, ctx)


def defense_call(name, updates, weights):
    entry = DEFENSES.get(name)
    spec = entry.spec_model()(name=name, **({"window": 3} if name == "fldetector" else {}))
    defense = entry.obj(spec)
    batch = UpdateBatch(updates, weights, tuple(range(updates.shape[0])))
    if name == "fldetector":  # steady state: the window of pairs is full
        for rnd in range(1, 5):
            noisy = updates + 0.01 * torch.randn_like(updates)
            kept, _ = defense.before(batch.with_updates(noisy), context(noisy, rnd))
            defense.after(kept.updates.mean(dim=0), context(noisy, rnd))

    def once():
        ctx = context(updates, 5)
        kept, _ = defense.before(batch, ctx)
        defense.after(kept.updates.mean(dim=0), ctx)

    return once
MEMORY_LIMIT_BYTES = 4e9
PEAK_COPIES = 3  # input + one same-size temporary (centred rows, |x - z|) + slack


def median_seconds(fn, repeats: int, budget_s: float = 2.0) -> float:
    """Median of up to `repeats` runs; stops repeating once `budget_s` is spent (slow cases)."""
    times = []
    while len(times) < repeats and sum(times) < budget_s:
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def naive_krum_scores(updates: torch.Tensor, num_malicious: int) -> torch.Tensor:
    """Krum scores with one distance computation per pair, the way a direct port would do it."""
    n = updates.shape[0]
    dist = torch.zeros(n, n)
    for i in range(n):
        for j in range(i + 1, n):
            dist[i, j] = dist[j, i] = (updates[i] - updates[j]).pow(2).sum()
    return scores_from_distances(dist, n - num_malicious - 2)


def fits_in_memory(n: int, d: int) -> bool:
    return PEAK_COPIES * n * d * 4 <= MEMORY_LIMIT_BYTES


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="n in {10, 50}, d = 1e5 only")
    parser.add_argument("--extra-d", type=int, nargs="*", default=[], help="further update sizes to time")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    sizes_n = [10, 50] if args.quick else [10, 50, 100, 200]
    lenet_d = 1_199_882  # the LeNet of Attack of the Tails
    sizes_d = [100_000] if args.quick else [lenet_d] + list(args.extra_d)
    naive_max_n = 50
    entries = [AGGREGATORS.get(name) for name in RULES]
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"median of up to {args.repeats} runs (fewer once 2 s are spent on one case), "
        f"{os.cpu_count()} CPUs, load average {load}"
    )

    gen = torch.Generator().manual_seed(0)
    naive_rows = []
    for d in sizes_d:
        print(f"\nd = {d:,}: ms per aggregation (default params)")
        print(f"{'rule / +defense':<20}" + "".join(f"{f'n={n}':>11}" for n in sizes_n))
        cells: dict[str, list[str]] = {e.name: [] for e in entries} | {f"+{n}": [] for n in DEFENSE_NAMES}
        cells["X @ X.T"] = []
        ratios: dict[str, list[str]] = {e.name: [] for e in entries} | {f"+{n}": [] for n in DEFENSE_NAMES}
        for n in sizes_n:
            if not fits_in_memory(n, d):
                for name in cells:
                    cells[name].append("skipped")
                for name in ratios:
                    ratios[name].append("-")
                continue
            updates = torch.randn(n, d, generator=gen)
            weights = torch.randint(10, 500, (n,), generator=gen).float()
            gram = median_seconds(lambda: updates @ updates.T, args.repeats)
            cells["X @ X.T"].append(f"{gram * 1e3:.1f}")
            for e in entries:
                secs = median_seconds(rule_call(e, updates, weights), args.repeats)
                cells[e.name].append(f"{secs * 1e3:.1f}")
                ratios[e.name].append(f"{secs / gram:.2f}")
            for name in DEFENSE_NAMES:
                secs = median_seconds(defense_call(name, updates, weights), args.repeats)
                cells[f"+{name}"].append(f"{secs * 1e3:.1f}")
                ratios[f"+{name}"].append(f"{secs / gram:.2f}")
            if n <= naive_max_n:  # the loop is slow and its run-to-run noise small: time it once
                krum = AGGREGATORS.get("krum").obj
                fast = median_seconds(lambda: krum(updates, weights), args.repeats)
                slow = median_seconds(lambda: naive_krum_scores(updates, 1), 1)
                naive_rows.append((n, d, fast, slow))
            del updates
        for name, row in cells.items():
            print(f"{name:<20}" + "".join(f"{c:>11}" for c in row))
        print(f"\nd = {d:,}: time per aggregation / time of one X @ X.T (same data, same run)")
        print(f"{'rule / +defense':<20}" + "".join(f"{f'n={n}':>11}" for n in sizes_n))
        for name, row in ratios.items():
            print(f"{name:<20}" + "".join(f"{c:>11}" for c in row))

    print("\nkrum: one Gram product vs a Python loop over pairs (same run)")
    print(f"{'n':>5} {'d':>8} {'gram ms':>10} {'loop ms':>10} {'loop/gram':>10}")
    for n, d, fast, slow in naive_rows:
        print(f"{n:>5} {d:>8.0e} {fast * 1e3:>10.1f} {slow * 1e3:>10.1f} {slow / fast:>10.1f}")


if __name__ == "__main__":
    main()
