"""Time per aggregation of DETOX over Multi-Krum against plain Multi-Krum, as n grows.

Run: `.venv/bin/python benchmarks/detox.py [--quick]`. Rows come in groups of r = 3 identical rows
(honest members sharing data and seed), so every group has a majority and the inner Multi-Krum sees
n / 3 winners. Prints median wall-clock times of a few repeats with torch on 2 threads, the ratio,
and each rule's growth from the smallest to the largest n (4x n: about 4x if linear, 16x if
quadratic). Asserts nothing about time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent

import torch  # noqa: E402

from fedsim.aggregators.detox import consecutive_groups, detox, majority_vote  # noqa: E402
from fedsim.aggregators.krum import multikrum  # noqa: E402

GROUP_SIZE = 3


def median_seconds(fns: list, repeats: int) -> list[float]:
    """Median time of each function, run in turn within every repeat so all see the same host load.

    One untimed run of each comes first: the first registry lookup imports every component package.
    """
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, spent in zip(fns, times):
            start = time.perf_counter()
            fn()
            spent.append(time.perf_counter() - start)
    return [statistics.median(spent) for spent in times]


def grouped_updates(n: int, d: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, d] rows in consecutive groups of identical rows (the last group absorbs leftovers)."""
    groups = consecutive_groups(n, GROUP_SIZE)
    unique = torch.randn(len(groups), d, generator=gen)
    group_of_row = torch.tensor([g for g, members in enumerate(groups) for _ in members])
    return unique[group_of_row].contiguous(), torch.full((n,), 100.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="n in {50, 200} only, one run each")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dim", type=int, default=100_000)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    sizes = [50, 200] if args.quick else [50, 100, 200]
    repeats = 1 if args.quick else args.repeats
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"median of {repeats} interleaved runs, "
        f"d = {args.dim:.0e}, r = {GROUP_SIZE}, Multi-Krum f = 1, m = n - f; "
        f"{os.cpu_count()} CPUs, load average {load}"
    )
    print(f"{'n':>5} {'multikrum ms':>13} {'detox ms':>10} {'(vote ms)':>10} {'multikrum/detox':>16}")
    gen = torch.Generator().manual_seed(0)
    times: dict[int, tuple[float, float]] = {}
    for n in sizes:
        updates, weights = grouped_updates(n, args.dim, gen)
        groups = consecutive_groups(n, GROUP_SIZE)
        plain, hier, vote = median_seconds(
            [
                lambda: multikrum(updates, weights, num_malicious=1),
                lambda: detox(updates, weights, inner={"name": "multikrum"}),
                lambda: majority_vote(updates, groups),
            ],
            repeats,
        )
        times[n] = (plain, hier)
        cells = f"{plain * 1e3:>13.1f} {hier * 1e3:>10.1f} {vote * 1e3:>10.1f} {plain / hier:>16.2f}"
        print(f"{n:>5} {cells}")
        del updates
    lo, hi = sizes[0], sizes[-1]
    scale = hi / lo
    print(f"\ngrowth from n={lo} to n={hi} ({scale:.0f}x n; linear {scale:.0f}x, quadratic {scale ** 2:.0f}x):")
    print(f"  multikrum {times[hi][0] / times[lo][0]:.1f}x, detox {times[hi][1] / times[lo][1]:.1f}x")


if __name__ == "__main__":
    main()
