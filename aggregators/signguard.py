"""SignGuard (Xu, Huang, Song, Lan, "Byzantine-robust Federated Learning through Collaborative
Malicious Gradient Filtering", ICDCS 2022), as its official code runs it (JianXu95/SignGuard,
`aggregators/signguard.py`, class `signguard_multiclass`, named "SignGuard"; the -Sim and -Dist
variants with a fourth similarity feature are not reproduced).

Two filters, intersected, then clipping and a plain mean:

1. Norm filter: with M the median of the update norms, keep L * M < ||g_i|| < R * M
   (L = `lower` = 0.1, R = `upper` = 3.0, the paper's and the code's).
2. Sign clustering: on a random share of the coordinates (`coordinate_share` = 10 %), each
   update's fractions of positive, zero and negative entries are its three features; MeanShift
   clusters them and the largest cluster is kept.
3. The updates kept by both are clipped to norm at most M and averaged with equal weights
   (example counts are ignored, as in the paper and the code).

Details the paper's text leaves open or states differently, taken from the code:

- Coordinates: one contiguous block of k = int(share * d) coordinates at a random offset, not a
  scattered random subset. (The code draws the offset in [0, d - k), so never the last block and
  nothing when k = d; here every offset in [0, d - k] is equally likely, and k >= 1.)
- Features: each of the three fractions is divided by its maximum over the updates (+ 1e-8).
- Clustering: scikit-learn's MeanShift(bandwidth, bin_seeding=True, cluster_all=False), with
  bandwidth = estimate_bandwidth(features, quantile=0.5, n_samples=50): updates no cluster
  claims are dropped; the largest cluster wins, ties to the lowest MeanShift label (the most
  dense seed). estimate_bandwidth's subsample of 50 rows (n > 50 only) is seeded from the round's
  generator; the code leaves sklearn's default random_state=0.
- Bounds are strict (> L*M, < R*M); NaN entries are set to 0 first.
- The two medians are the code's: the filter's M is np.median (mean of the two middle norms for
  even n), the clipping bound is torch.median (the lower middle norm). Both are over all n
  updates, attackers included.

Conventions where neither says: estimate_bandwidth measures each point's distance to its
int(0.5 * n)-th nearest neighbour counting itself, so n must be >= 4 (int(q * n) >= 2; checked at
validation). When the bandwidth still comes out 0 (every feature row has int(q * n) - 1 exact
duplicates, e.g. with very few coordinates) MeanShift cannot run; its zero-bandwidth limit is used: each distinct
feature row is a cluster, the most frequent wins (ties: the largest row, as MeanShift's
ordering). An empty intersection skips the round. Norms are computed in float64 so that huge
finite rows do not overflow to inf. Without a context, a generator seeded with 0 is used.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
from pydantic import Field, model_validator

from fedsim.aggregators.base import AggregationError, check_inputs
from fedsim.registry import AGGREGATORS, Params

BANDWIDTH_SAMPLES = 50  # the code's estimate_bandwidth(n_samples=50)
FEATURE_EPS = 1e-8  # the code's max-normalisation guard


def numpy_median(values: torch.Tensor) -> torch.Tensor:
    """np.median semantics: the mean of the two middle values when n is even."""
    ordered = torch.sort(values).values
    n = ordered.shape[0]
    return ordered[n // 2] if n % 2 else 0.5 * (ordered[n // 2 - 1] + ordered[n // 2])


def sign_block(d: int, coordinate_share: float, generator: torch.Generator) -> tuple[int, int]:
    """(start, k): a contiguous block of k = max(1, int(share * d)) coordinates at a uniform offset."""
    k = min(d, max(1, int(coordinate_share * d)))
    start = int(torch.randint(0, d - k + 1, (1,), generator=generator))
    return start, k


def sign_features(updates: torch.Tensor, start: int, k: int) -> np.ndarray:
    """[n, 3] fractions of positive, zero and negative entries in the block, each over its max."""
    block = updates[:, start : start + k]
    fractions = torch.stack([(block > 0).sum(1), (block == 0).sum(1), (block < 0).sum(1)], dim=1).double() / k
    return (fractions / (fractions.max(dim=0).values + FEATURE_EPS)).cpu().numpy()  # MeanShift (scikit-learn) runs on the host


def largest_cluster(features: np.ndarray, bandwidth_quantile: float, seed: int) -> np.ndarray:
    """[n] bool: the members of MeanShift's largest cluster (orphans belong to none)."""
    from sklearn.cluster import MeanShift, estimate_bandwidth  # imported here: scikit-learn costs ~1 s at start-up

    bandwidth = float(estimate_bandwidth(features, quantile=bandwidth_quantile, n_samples=BANDWIDTH_SAMPLES,
                                         random_state=seed))
    if bandwidth > 0.0:
        with warnings.catch_warnings():  # "Binning data failed ... using data points as seeds": expected
            warnings.filterwarnings("ignore", message="Binning data failed")
            labels = MeanShift(bandwidth=bandwidth, bin_seeding=True, cluster_all=False).fit(features).labels_
        counts = np.bincount(labels[labels >= 0])
        if counts.size == 0:
            raise AggregationError("signguard: MeanShift put no update in any cluster")
        return labels == int(np.argmax(counts))
    # zero-bandwidth limit: identical rows form the clusters
    _, inverse, counts = np.unique(features, axis=0, return_inverse=True, return_counts=True)
    best = int(np.flatnonzero(counts == counts.max())[-1])  # np.unique sorts rows: last = largest
    return inverse.reshape(-1) == best


def check_signguard_size(n: int, bandwidth_quantile: float) -> None:
    if int(bandwidth_quantile * min(n, BANDWIDTH_SAMPLES)) < 2:
        raise AggregationError(
            f"signguard needs int(bandwidth_quantile * n) >= 2 so that the MeanShift bandwidth is not each "
            f"update's distance to itself, got n={n}, bandwidth_quantile={bandwidth_quantile}"
        )


def signguard_select(
    updates: torch.Tensor, lower: float, upper: float, start: int, k: int, bandwidth_quantile: float, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted kept rows, [n] float64 norms) for a given sign block and estimate_bandwidth seed."""
    check_signguard_size(updates.shape[0], bandwidth_quantile)
    grads = torch.where(updates.isnan(), 0.0, updates) if updates.isnan().any() else updates
    norms = torch.linalg.vector_norm(grads, dim=1, dtype=torch.float64)
    median = numpy_median(norms)
    by_norm = (norms > lower * median) & (norms < upper * median)
    by_sign = torch.from_numpy(largest_cluster(sign_features(grads, start, k), bandwidth_quantile, seed)).to(updates.device)
    kept = torch.nonzero(by_norm & by_sign).flatten()
    if kept.numel() == 0:
        raise AggregationError(
            f"signguard: no update passed both filters ({int(by_norm.sum())} by norm, {int(by_sign.sum())} by sign)"
        )
    return kept, norms


class SignGuardParams(Params):
    lower: float = Field(0.1, ge=0.0, description="L: keep norms above L * median norm (paper and code: 0.1)")
    upper: float = Field(3.0, gt=0.0, description="R: keep norms below R * median norm (paper and code: 3.0)")
    coordinate_share: float = Field(
        0.1, gt=0.0, le=1.0, description="share of coordinates (one random block) for the sign features (code: 0.1)"
    )
    bandwidth_quantile: float = Field(
        0.5, gt=0.0, le=1.0, description="estimate_bandwidth quantile of the MeanShift bandwidth (code: 0.5); needs int(q*n) >= 2"
    )

    @model_validator(mode="after")
    def _bounds_ordered(self):
        if self.lower >= self.upper:
            raise ValueError(f"signguard needs lower < upper, got lower={self.lower}, upper={self.upper}")
        return self

    def round_problem(self, n: int):
        try:
            check_signguard_size(n, self.bandwidth_quantile)
        except AggregationError as err:
            return "bandwidth_quantile", str(err), self.bandwidth_quantile
        return None


def signguard_with_info(
    updates: torch.Tensor,
    weights: torch.Tensor,
    lower: float = 0.1,
    upper: float = 3.0,
    coordinate_share: float = 0.1,
    bandwidth_quantile: float = 0.5,
    ctx=None,
) -> tuple[torch.Tensor, dict]:
    """SignGuard's output and the rows it averaged (for the round log and the detection audit)."""
    check_inputs(updates, weights)
    generator = ctx.generator if ctx is not None else torch.Generator().manual_seed(0)
    start, k = sign_block(updates.shape[1], coordinate_share, generator)
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generator))
    kept, norms = signguard_select(updates, lower, upper, start, k, bandwidth_quantile, seed)
    bound = torch.median(norms)  # the code's clipping bound: the lower middle norm of all n
    chosen = torch.where(updates[kept].isnan(), 0.0, updates[kept]).double()
    scale = torch.where(norms[kept] > bound, bound / norms[kept], torch.ones_like(norms[kept]))
    return (chosen * scale[:, None]).mean(dim=0).to(updates.dtype), {"selected": kept.tolist()}


@AGGREGATORS.register("signguard", SignGuardParams, with_context=True, with_info=signguard_with_info)
def signguard(updates: torch.Tensor, weights: torch.Tensor, **params) -> torch.Tensor:
    """Mean of median-norm-clipped updates kept by a norm filter and sign-feature MeanShift (Xu et al. 2022)."""
    return signguard_with_info(updates, weights, **params)[0]
