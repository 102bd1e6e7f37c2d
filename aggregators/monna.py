"""MoNNA, mean of the nearest neighbours of a trusted update (Farhadkhani, Guerraoui, Gupta, Hoang,
Pinot, Stephan, "Robust Collaborative Learning with Linear Gradient Overhead", ICML 2023).

MoNNA was designed for peer-to-peer learning: an honest node averages the n - f updates nearest
to its own, which it trusts,

    MoNNA(x) = (1 / (n - f)) sum_{i in N(x_a)} x_i,    N(x_a) = the n - f rows nearest to x_a (itself included),

so here the trusted update is a row given by `anchor` (ByzFL's `idx`). On the server the rows
are sorted by client id, so `anchor: 0` trusts the sampled client with the smallest id: the rule
is positional by definition, and is meant for experiments where that client is known honest
(a server with an update of its own is FLTrust's setting). It needs n > 2f (ByzFL's check; the
paper's f < n / 2); with f = 0 it is the plain mean.

MoNNA is one row of nearest-neighbour mixing: NNM (`mixing.py`, Allouah et al., AISTATS 2023,
by the same group) replaces every row by the mean of its n - f nearest, and MoNNA returns the
anchor's mixed row, with the same conventions: the anchor is its own first neighbour, equal
distances go to the lower row index, and a row holding NaN or inf is infinitely far (it is
averaged only when more than f rows are non-finite). tests/test_aggregators_byzfl.py checks both
ByzFL's MoNNA and fedsim's NNM row. Only the anchor's n distances are computed (O(n d)), not the
[n, n] matrix NNM needs. Unweighted, as in the paper.
"""

from __future__ import annotations

import torch
from pydantic import Field

from fedsim.aggregators.base import AggregationError, check_inputs
from fedsim.aggregators.subsets import check_majority, majority_problem
from fedsim.registry import AGGREGATORS, Params


def monna_neighbours(updates: torch.Tensor, num_malicious: int, anchor: int) -> torch.Tensor:
    """[n - f] the anchor's nearest rows: itself first, then by distance, ties to the lower index."""
    n = updates.shape[0]
    check_majority("monna", n, num_malicious)
    if not 0 <= anchor < n:
        raise AggregationError(f"monna needs 0 <= anchor < n, got anchor={anchor}, n={n}")
    dist = torch.linalg.vector_norm((updates - updates[anchor]).double(), dim=1)
    dist = torch.where(dist.isnan(), torch.inf, dist)
    dist[anchor] = -1.0
    return torch.sort(dist, stable=True).indices[: n - num_malicious]


class MoNNAParams(Params):
    num_malicious: int = Field(1, ge=0, description="f: averages the n - f updates nearest the anchor; needs n > 2f")
    anchor: int = Field(0, ge=0, description="row of the trusted update (rows are sorted by client id; ByzFL's idx)")

    def round_problem(self, n: int):
        problem = majority_problem("monna", n, self.num_malicious)
        if problem is None and self.anchor >= n:
            return "anchor", f"monna needs anchor < n, got anchor={self.anchor}, n={n}", self.anchor
        return problem


def monna_with_info(updates: torch.Tensor, weights: torch.Tensor, num_malicious: int = 1,
                    anchor: int = 0) -> tuple[torch.Tensor, dict]:
    """MoNNA's output and the rows it averaged (for the round log)."""
    check_inputs(updates, weights)
    chosen = monna_neighbours(updates, num_malicious, anchor)
    return updates[chosen].mean(dim=0), {"selected": sorted(chosen.tolist())}


@AGGREGATORS.register("monna", MoNNAParams, with_info=monna_with_info)
def monna(updates: torch.Tensor, weights: torch.Tensor, num_malicious: int = 1, anchor: int = 0) -> torch.Tensor:
    """Mean of the n - f updates nearest a trusted one (Farhadkhani et al. 2023; one row of NNM)."""
    return monna_with_info(updates, weights, num_malicious, anchor)[0]
