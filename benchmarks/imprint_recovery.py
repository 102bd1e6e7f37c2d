"""Robbing the Fed's imprint block: how many inputs come back exactly from a sum (docs/leakage.md).

Three clients of 8 digits each take one full-batch SGD step (fedsim's own client loop) from the
same imprint model; the attack reads the SUM of the three updates, what a secure-aggregation
server holds. For k bins and the block's gain γ, over 10 draws of the 24 digits: how many inputs
fell alone in their bin (by hand, from the measurement's normal quantiles), how many of those came
back exactly (largest pixel error < 1e-4) and how many bins the attack found hit. Uses the test
module's helpers, so the benchmark measures the construction the tests check.

    .venv/bin/python benchmarks/imprint_recovery.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from test_leakage_imprint import bins_by_hand, client_updates, digits, imprint_spec, nearest, observe  # noqa: E402

from fedsim.leakage.imprint import ImprintAttack, ImprintAttackParams  # noqa: E402


def one_sum(data, bins: int, seed: int, gain: float) -> tuple[int, int, int]:
    spec = imprint_spec(data, bins=bins, gain=gain)
    model, layout, w0, updates, truth = client_updates(spec, data, 3, 8, seed=seed)
    rec = ImprintAttack(ImprintAttackParams()).reconstruct(observe(model, layout, w0, torch.stack(updates).sum(0),
                                                                   clients=(0, 1, 2)))
    which = bins_by_hand(spec, truth)
    alone = torch.bincount(which, minlength=bins)[which] == 1
    exact = nearest(truth, rec.inputs) < 1e-4 if len(rec.inputs) else torch.zeros(len(truth), dtype=torch.bool)
    return int(alone.sum()), int((alone & exact).sum()), int(rec.info["nonempty_bins"])


def main() -> None:
    torch.set_num_threads(1)
    data = digits()
    print("| k | inputs alone in their bin (of 24, mean) | lone inputs exact, γ = 1e-5 (default) | "
          "lone inputs exact, γ = 1e-3 (official) | bins hit (mean) |")
    print("|---|---|---|---|---|")
    for bins in (32, 64, 128, 256):
        rows = {gain: np.array([one_sum(data, bins, seed, gain) for seed in range(10)]) for gain in (1e-5, 1e-3)}
        a, b = rows[1e-5], rows[1e-3]
        print(f"| {bins} | {a[:, 0].mean():.1f} | {a[:, 1].sum()}/{a[:, 0].sum()} | {b[:, 1].sum()}/{b[:, 0].sum()} | "
              f"{a[:, 2].mean():.1f} |", flush=True)


if __name__ == "__main__":
    main()
