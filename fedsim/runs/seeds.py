"""Runs that differ only in their seed, read together: a sweep with `seed: [1, 2, 3]` gives each
cell of its grid as mean ± standard deviation, with a 95% interval from three seeds on, so the
variance of a result is read off the report instead of guessed."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

SEED_KEY = "seed"


@dataclass(frozen=True)
class Spread:
    """Mean, sample standard deviation and Student-t 95% interval of one metric over seeds."""

    n: int
    mean: float
    std: float | None  # None with one seed
    low: float | None  # the 95% interval, from 3 seeds on (None below)
    high: float | None

    @classmethod
    def of(cls, values: list[float]) -> "Spread | None":
        if not values:
            return None
        n = len(values)
        mean = sum(values) / n
        if n == 1:
            return cls(1, mean, None, None, None)
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
        if n < 3:
            return cls(n, mean, std, None, None)
        from scipy.special import stdtrit  # Student t's quantile; scipy.stats would add ~2 s of imports to a report

        half = float(stdtrit(n - 1, 0.975)) * std / math.sqrt(n)
        return cls(n, mean, std, mean - half, mean + half)

    def percent(self) -> str:
        """'93.1 ± 0.4 [92.2, 94.0]' in percent (the interval only from three seeds on)."""
        text = f"{100 * self.mean:.1f}"
        if self.std is not None:
            text += f" ± {100 * self.std:.1f}"
        if self.low is not None:
            text += f" [{100 * self.low:.1f}, {100 * self.high:.1f}]"
        return text


def without_seed(swept: dict) -> dict:
    return {k: v for k, v in swept.items() if k != SEED_KEY}


def seed_groups(runs: list[Path], swept: dict[Path, dict]) -> dict[str, list[Path]] | None:
    """Runs grouped by their swept values other than the seed (None when no run swept the seed).
    Keys are the groups' other swept values as JSON, in the runs' order."""
    if not any(SEED_KEY in swept[run] for run in runs):
        return None
    groups: dict[str, list[Path]] = {}
    for run in runs:
        groups.setdefault(json.dumps(without_seed(swept[run]), sort_keys=True, default=str), []).append(run)
    return groups
