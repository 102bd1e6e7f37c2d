"""MDA, minimum-diameter averaging (El Mhamdi, Guerraoui, Guirguis, Hoang, Rouault, "Genuinely
Distributed Byzantine Machine Learning", PODC 2020, the reference ByzFL
gives; used again in El Mhamdi, Guerraoui, Rouault, "Distributed Momentum for Byzantine-resilient
Learning", ICLR 2021). It is the averaging form of Rousseeuw's minimum volume ellipsoid (MVE)
estimator ("Multivariate estimation with high breakdown point", 1985).

Among all subsets S of n - f updates, take the one of smallest diameter and average it:

    S* = argmin_{|S| = n - f} max_{i, j in S} ||x_i - x_j||_2,      MDA(x) = (1 / (n - f)) sum_{i in S*} x_i

It needs n > 2f (the papers' assumption; ByzFL, the authors' group's library, refuses 2f >= n
too). With f = 0 it is the plain mean. The argmin enumerates C(n, f) subsets (`subsets.py`):
the squared distances come from one float64 Gram product, and each chunk of subsets is scored by
gathering its [k, k] blocks, so the cost is O(n^2 d + C(n, f) (n - f)^2); a round with more than
`max_subsets` subsets is refused (1,000,000 by default: n = 30, f = 6 is 593,775).

Conventions where the paper says nothing, and ByzFL (0.0.11, `byzfl.MDA`):

- Ties in diameter are common, not a corner case: with f = 1, dropping either end of the
  farthest pair often leaves the same diameter (the next farthest pair), with different means.
  The paper takes any minimiser; ByzFL takes the first in `itertools.combinations` order (a
  strict `<` scan), so its output depends on the order of the rows (client ids, here). fedsim
  breaks a tie by the smaller sum of squared distances within the subset (its spread), which
  does not depend on the order and is generically unique; only subsets equal in both go to the
  lexicographically first. tests/test_aggregators_byzfl.py checks equal outputs where the
  minimum diameter is attained once, and elsewhere that both outputs are means of minimum-
  diameter subsets. The diameter is compared squared (the same order).
- Unweighted, as in the paper and ByzFL: example counts do not buy a place in the subset.
- A row holding NaN or inf is infinitely far from every row, so any subset holding it has an
  infinite diameter; with more than f such rows every subset does and the first is averaged.
"""

from __future__ import annotations

import torch
from pydantic import Field

from fedsim.aggregators.base import check_inputs
from fedsim.aggregators.subsets import best_subset, check_majority, check_subset_count, gram64, subset_problem
from fedsim.registry import AGGREGATORS, Params

DEFAULT_MAX_SUBSETS = 1_000_000


def squared_distances64(updates: torch.Tensor) -> torch.Tensor:
    """[n, n] float64 squared distances; +inf to and from a row holding NaN or inf."""
    gram, finite = gram64(updates)
    sq = gram.diagonal()
    dist = (sq[:, None] + sq[None, :] - 2.0 * gram).clamp_min(0.0)
    dist = 0.5 * (dist + dist.T)
    bad = ~(finite[:, None] & finite[None, :])
    dist = torch.where(bad, torch.inf, dist)
    dist.fill_diagonal_(0.0)
    return dist


def mda_select(updates: torch.Tensor, num_malicious: int, max_subsets: int = DEFAULT_MAX_SUBSETS) -> torch.Tensor:
    """[n - f] rows of the minimum-diameter subset (increasing index)."""
    n = updates.shape[0]
    check_majority("mda", n, num_malicious)
    check_subset_count("mda", n, num_malicious, max_subsets)
    dist = squared_distances64(updates)

    def diameter_then_spread(chunk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        block = dist[chunk[:, :, None], chunk[:, None, :]].flatten(1)
        return block.amax(dim=1), block.sum(dim=1)

    return best_subset(n, n - num_malicious, diameter_then_spread)[0]


class MDAParams(Params):
    num_malicious: int = Field(1, ge=0, description="f: averages the n - f updates of smallest diameter; needs n > 2f")
    max_subsets: int = Field(DEFAULT_MAX_SUBSETS, ge=1, description="refuse a round with more than C(n, f) subsets to score")

    def round_problem(self, n: int):
        return subset_problem("mda", n, self.num_malicious, self.max_subsets)


def mda_with_info(updates: torch.Tensor, weights: torch.Tensor, num_malicious: int = 1,
                  max_subsets: int = DEFAULT_MAX_SUBSETS) -> tuple[torch.Tensor, dict]:
    """MDA's output and the rows it averaged (for the round log)."""
    check_inputs(updates, weights)
    chosen = mda_select(updates, num_malicious, max_subsets)
    return updates[chosen].mean(dim=0), {"selected": chosen.tolist()}


@AGGREGATORS.register("mda", MDAParams, with_info=mda_with_info)
def mda(updates: torch.Tensor, weights: torch.Tensor, num_malicious: int = 1,
        max_subsets: int = DEFAULT_MAX_SUBSETS) -> torch.Tensor:
    """Minimum-diameter averaging: the mean of the n - f updates of smallest diameter (El Mhamdi et al. 2020)."""
    return mda_with_info(updates, weights, num_malicious, max_subsets)[0]
