"""Where `edge_set: tail` lands on each dataset: the ladder rung `transform: auto` keeps, and how rare it is.

Run: `FEDSIM_DATA_DIR=../shared/data .venv/bin/python benchmarks/tail_sets.py` (digits always;
MNIST and Fashion-MNIST when the data folder has them). For every dataset and source -> target
pair it builds the default tail set (seed 0, default target: at least 90% of the edge inputs with
at most 5% of the training images less likely, density fitted on every training image) and prints
a markdown table: the rung kept, the share of edge inputs in the tail, the training percentile
that 90% of them reach, the median percentile, the rung's displacement (mean |T(x) - x| / |x|),
and a density-free cross-check: the median distance from an edge test input to its nearest
training image over that of natural held-out source images, for the set kept and for the
pre-target default (rotation by 30-90°). A second table gives every rung tried as
`share in tail / percentile reached by 90%`. `--fit-size 10000` is what the tests use.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np
import torch

from fedsim.data.edge import TailEdge, apply_step, build_tail, named_step
from fedsim.registry import DATASETS

PAIRS = {  # source -> target pairs per dataset
    "digits": [(7, 1), (3, 8), (1, 7), (0, 6)],
    "mnist": [(7, 1), (3, 8), (1, 7), (0, 6)],
    "fashion_mnist": [(7, 1), (3, 8), (1, 7), (0, 6)],  # sneaker->trouser, dress->bag, trouser->sneaker, T-shirt->shirt
}


def nearest_distance_ratio(data, edge_test: np.ndarray, source: int, n: int = 500) -> float:
    """Median nearest-training-image distance: edge test inputs over natural held-out source images."""
    rows = np.random.default_rng(7).permutation(len(data.x_train))[:10_000]
    ref = torch.from_numpy(data.x_train[rows].reshape(len(rows), -1))

    def nearest(x):
        return torch.cdist(torch.from_numpy(x[:n].reshape(len(x[:n]), -1)), ref).min(dim=1).values.median().item()

    return nearest(edge_test) / nearest(data.x_test[data.y_test == source])


def old_default_test(data, source: int) -> np.ndarray:
    """The test edge inputs of the pre-target default, `transform: rotate` by 30-90° (seed 0)."""
    step, rng = named_step(TailEdge(transform="rotate")), np.random.default_rng([0, 0xED6E])
    lo, hi = data.x_train.min(), data.x_train.max()
    apply_step(data.x_train[data.y_train == source], step, rng, lo, hi)  # the train set draws its angles first
    return apply_step(data.x_test[data.y_test == source], step, rng, lo, hi)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default=os.environ.get("FEDSIM_DATA_DIR"), help="folder with mnist.npz etc.")
    parser.add_argument("--fit-size", type=int, default=None, help="density_fit_size (default: all training images)")
    parser.add_argument("--datasets", nargs="*", default=list(PAIRS))
    args = parser.parse_args()
    torch.set_num_threads(2)
    rows, ladders = [], []
    for name in args.datasets:
        entry = DATASETS.get(name)
        if name != "digits" and not (args.data_dir and Path(args.data_dir, f"{name}.npz").is_file()):
            print(f"skipping {name}: no {name}.npz in --data-dir / FEDSIM_DATA_DIR")
            continue
        data = entry.obj(Path(args.data_dir) if args.data_dir else None, entry.params())
        for source, target in PAIRS[name]:
            start = time.perf_counter()
            spec = TailEdge(source_class=source, target_class=target, density_fit_size=args.fit_size)
            edge = build_tail(data, spec, seed=0)
            seconds = time.perf_counter() - start
            d, chosen = edge.density, edge.density["chosen"]
            rung = d["ladder"][-1]
            rows.append(f"| {name} | {source}→{target} | {chosen['rung']}: {chosen['step']} | {d['share_in_tail']:.1%} | "
                        f"{d['percentile_at_min_share']:.2f} | {d['median_percentile']:.2f} | {rung['displacement']:.2f} | "
                        f"{nearest_distance_ratio(data, edge.x_test, source):.2f} | "
                        f"{nearest_distance_ratio(data, old_default_test(data, source), source):.2f} | {seconds:.1f} |")
            ladders.append(f"| {name} | {source}→{target} | " + " · ".join(
                f"{t['rung']}. {t['step']}: {t['share_in_tail']:.0%} / {t['percentile_at_min_share']:.1f}" for t in d["ladder"]) + " |")
    print("| dataset | pair | rung kept | share in tail | percentile 90% reach | median percentile | displacement "
          "| nearest-image distance ratio | same, rotate 30-90° | seconds |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    print("\n".join(rows))
    print("\n| dataset | pair | rungs tried: share in tail / percentile 90% reach |")
    print("|---|---|---|")
    print("\n".join(ladders))


if __name__ == "__main__":
    main()
