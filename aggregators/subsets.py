"""Shared pieces of the rules that average a well-chosen subset of n - f updates (MDA, SMEA) and of
the rules that assume fewer than half the updates are Byzantine.

MDA and SMEA score every subset of n - f rows, C(n, f) of them. The subsets are enumerated with
`itertools.combinations` over row indices, in its lexicographic order, and scored in chunks of
index tensors with torch; the first subset of the lowest score wins (so ties go to the
lexicographically first subset, as a strict `<` scan in the same order does). Beyond
`max_subsets` subsets a round is refused rather than left running for hours.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator

import torch

from fedsim.aggregators.base import AggregationError

CHUNK_ELEMENTS = 1 << 22  # index-gathered [chunk, k, k] float64 blocks stay near 32 MB


def check_majority(rule: str, n: int, num_malicious: int) -> None:
    """The papers' assumption f < n / 2 (ByzFL refuses 2f >= n the same way)."""
    if 2 * num_malicious >= n:
        raise AggregationError(f"{rule} needs n > 2f updates, got n={n}, f={num_malicious}")


def majority_problem(rule: str, n: int, num_malicious: int):
    """`round_problem` form of `check_majority`."""
    try:
        check_majority(rule, n, num_malicious)
    except AggregationError as err:
        return "num_malicious", str(err), num_malicious
    return None


def check_subset_count(rule: str, n: int, num_malicious: int, max_subsets: int) -> int:
    """C(n, n - f), refused above `max_subsets` with the limit named."""
    count = math.comb(n, n - num_malicious)
    if count > max_subsets:
        raise AggregationError(
            f"{rule} would score C(n={n}, n-f={n - num_malicious}) = {count:,} subsets, over its limit "
            f"max_subsets={max_subsets:,}: lower num_malicious or clients_per_round, or raise max_subsets")
    return count


def subset_problem(rule: str, n: int, num_malicious: int, max_subsets: int):
    """`round_problem` of a subset rule: the majority assumption, then the subset limit."""
    problem = majority_problem(rule, n, num_malicious)
    if problem is not None:
        return problem
    try:
        check_subset_count(rule, n, num_malicious, max_subsets)
    except AggregationError as err:
        return "max_subsets", str(err), max_subsets
    return None


def subset_chunks(n: int, k: int) -> Iterator[torch.Tensor]:
    """[c, k] int64 index tensors of all k-subsets of range(n), lexicographic, in chunks."""
    rows = max(1, CHUNK_ELEMENTS // max(k * k, 1))
    combos = itertools.combinations(range(n), k)
    while True:
        chunk = list(itertools.islice(combos, rows))
        if not chunk:
            return
        yield torch.tensor(chunk, dtype=torch.long)


def best_subset(n: int, k: int, score: Callable[[torch.Tensor], torch.Tensor | tuple[torch.Tensor, torch.Tensor]]
                ) -> tuple[torch.Tensor, float]:
    """The k-subset of lowest `score` ([c, k] indices -> [c] float64 scores, or a pair of them:
    the second breaks ties in the first) and its score; among subsets equal in every key, the
    first in lexicographic order. NaN scores count as +inf."""
    best, best_key = None, (math.inf, math.inf)
    for chunk in subset_chunks(n, k):
        keys = score(chunk)
        primary, secondary = keys if isinstance(keys, tuple) else (keys, torch.zeros_like(keys))
        primary = torch.where(primary.isnan(), math.inf, primary)
        secondary = torch.where(secondary.isnan(), math.inf, secondary)
        low = primary == primary.min()
        i = int(torch.argmin(torch.where(low, secondary, math.inf))) if bool(low.any()) else 0
        key = (float(primary[i]), float(secondary[i]))
        if best is None or key < best_key:
            best, best_key = chunk[i], key
    return best, best_key[0]


def gram64(updates: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, n] float64 Gram matrix of the rows shifted by the smallest-norm finite row (shift-free
    quantities such as distances and centred covariances do not change; the shared component that
    would cancel badly goes away), with non-finite rows zeroed, and [n] which rows are finite."""
    x = updates.double()
    finite = torch.isfinite(x).all(dim=1)
    x = torch.where(finite[:, None], x, torch.zeros_like(x))
    if bool(finite.any()):
        norms = torch.where(finite, torch.linalg.vector_norm(x, dim=1), math.inf)
        x = x - x[int(torch.argmin(norms))]
        x = torch.where(finite[:, None], x, torch.zeros_like(x))
    return x @ x.T, finite
