"""DnC, Divide-and-Conquer (Shejwalkar & Houmansadr, "Manipulating the Byzantine", NDSS 2021, Algorithm 2).

Each of `niters` iterations looks at a random sorted subset r of b coordinates (b = min(b, d)):

    mu = (1/n) sum_i g_i[r],   v = top right singular vector of [g_i[r] - mu]_i,
    s_i = ((g_i[r] - mu) . v)^2                       (outlier score),

and keeps the n - c*f updates with the lowest scores. The kept set is the intersection over the
iterations and the aggregate is the plain mean of the kept updates. Parameters and defaults:
f = `num_malicious`, c = `filter_frac` = 1.0 and b = `subsample_dim` = 10,000 (the paper's) and
`niters` = 1. There is no official DnC code in the authors' release
(vrt1shjwlkr/NDSS21-Model-Poisoning has Krum, Multi-Krum, Bulyan, trimmed mean and median only),
so this follows the paper's algorithm; the ports disagree on niters and b (SignGuard's code:
niters = 1, b = 1,000, c = (n - 1) / n; FLPoison: niters = 5, b = 20 % of d, c = 1). With
niters = 1 the intersection is one iteration's kept set: n - ceil(c*f) updates (fewer only when
more rows than that are non-finite).

Conventions where the paper says nothing:

- c*f may be fractional: ceil(c*f) updates are removed per iteration (the ports' int(n - c*f)
  kept), so n must exceed ceil(c*f) (checked at validation). With niters > 1 the intersection
  can be empty, which skips the round.
- Ties in score go to the lower row index (stable sort), so results do not depend on sort
  internals. The singular vector's sign does not matter (scores are squared).
- Rows holding NaN or inf are scored +inf and never kept (they cannot be averaged); the mean and
  the SVD of each iteration use the finite rows only.
- Example counts are ignored, as in the paper's mean: a claimed large dataset must not buy
  influence. The coordinates come from the round's seeded generator (`ctx.generator`), or from a
  generator seeded with 0 when called without a context.
- The SVD is the exact thin SVD in float64 of the [n, b] matrix (O(n^2 b)); a randomized
  low-rank SVD would draw from torch's global stream instead of the round's generator.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from pydantic import Field

from fedsim.aggregators.base import AggregationError, check_inputs
from fedsim.registry import AGGREGATORS, Params

PAPER_SUBSAMPLE_DIM = 10_000


def removal_count(num_malicious: int, filter_frac: float) -> int:
    """ceil(c*f), the updates each iteration removes (rounded to 1e-9 first, so 1.1 * 10 is 11)."""
    return math.ceil(round(filter_frac * num_malicious, 9))


def check_dnc_size(n: int, num_malicious: int, filter_frac: float) -> None:
    removed = removal_count(num_malicious, filter_frac)
    if n - removed < 1:
        raise AggregationError(
            f"dnc needs n > ceil(c*f) updates, got n={n}, f={num_malicious}, c={filter_frac} "
            f"(removes {removed} per iteration)"
        )


def sample_coordinates(d: int, subsample_dim: int, niters: int, generator: torch.Generator) -> list[torch.Tensor]:
    """One sorted random subset of min(b, d) distinct coordinates per iteration (all d when b >= d)."""
    if subsample_dim >= d:
        return [torch.arange(d)] * niters
    return [torch.sort(torch.randperm(d, generator=generator)[:subsample_dim]).values for _ in range(niters)]


def outlier_scores(updates: torch.Tensor, coordinates: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
    """[n] float64 scores ((g_i[r] - mu) . v)^2 over the finite rows; +inf for the others."""
    sub = updates.index_select(1, coordinates.to(updates.device))[finite].double()
    centred = sub - sub.mean(dim=0)
    top = torch.linalg.svd(centred, full_matrices=False).Vh[0]  # top right singular vector
    scores = torch.full((updates.shape[0],), float("inf"), dtype=torch.float64, device=updates.device)
    scores[finite] = (centred @ top) ** 2
    return scores


def dnc_select(
    updates: torch.Tensor, num_malicious: int, filter_frac: float, coordinates: Sequence[torch.Tensor]
) -> torch.Tensor:
    """Sorted row indices DnC keeps: per coordinate subset the n - ceil(c*f) lowest scores, intersected."""
    n = updates.shape[0]
    check_dnc_size(n, num_malicious, filter_frac)
    finite = torch.isfinite(updates).all(dim=1)
    if not finite.any():
        raise AggregationError("dnc: every update holds NaN or inf")
    keep_count = n - removal_count(num_malicious, filter_frac)
    kept = finite.clone()
    for coords in coordinates:
        order = torch.sort(outlier_scores(updates, coords, finite), stable=True).indices
        this = torch.zeros(n, dtype=torch.bool, device=updates.device)
        this[order[:keep_count]] = True
        kept &= this
    if not kept.any():
        raise AggregationError(
            f"dnc: no update was kept by all {len(coordinates)} iterations (f={num_malicious}, c={filter_frac})"
        )
    return torch.nonzero(kept).flatten()


class DnCParams(Params):
    num_malicious: int = Field(1, ge=0, description="f, assumed malicious clients; needs n > ceil(c*f)")
    filter_frac: float = Field(
        1.0, ge=0.0, description="c, filtering fraction: each iteration removes the ceil(c*f) highest scores (paper: 1.0)"
    )
    niters: int = Field(1, ge=1, description="iterations, each on fresh coordinates; the kept sets are intersected")
    subsample_dim: int = Field(
        PAPER_SUBSAMPLE_DIM, ge=1, description="b, coordinates sampled per iteration, all when d <= b (paper: 10,000)"
    )

    def round_problem(self, n: int):
        try:
            check_dnc_size(n, self.num_malicious, self.filter_frac)
        except AggregationError as err:
            return "num_malicious", str(err), self.num_malicious
        return None


def dnc_with_info(
    updates: torch.Tensor,
    weights: torch.Tensor,
    num_malicious: int = 1,
    filter_frac: float = 1.0,
    niters: int = 1,
    subsample_dim: int = PAPER_SUBSAMPLE_DIM,
    ctx=None,
) -> tuple[torch.Tensor, dict]:
    """DnC's output and the rows it averaged (for the round log and the detection audit)."""
    check_inputs(updates, weights)
    generator = ctx.generator if ctx is not None else torch.Generator().manual_seed(0)
    coordinates = sample_coordinates(updates.shape[1], subsample_dim, niters, generator)
    kept = dnc_select(updates, num_malicious, filter_frac, coordinates)
    return updates[kept].mean(dim=0), {"selected": kept.tolist()}


@AGGREGATORS.register("dnc", DnCParams, with_context=True, with_info=dnc_with_info)
def dnc(updates: torch.Tensor, weights: torch.Tensor, **params) -> torch.Tensor:
    """Mean of the updates that survive DnC's SVD outlier filter on random coordinates (Shejwalkar & Houmansadr 2021)."""
    return dnc_with_info(updates, weights, **params)[0]
