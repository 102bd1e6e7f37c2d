"""Krum and Multi-Krum (Blanchard et al. 2017).

Krum scores each update by the sum of squared distances to its n - f - 2 nearest other updates and
keeps the lowest score; it needs n >= 2f + 3. Multi-Krum averages the m lowest-scoring updates,
weighted by example count. The codes disagree on m, so it is a parameter:

- m = n - f: Attack-of-the-Tails (OOD_FL) code, the default here;
- m = n - 2f - 2: NDSS'21 (Shejwalkar & Houmansadr) code, which selects with Krum iteratively and
  removes each winner while more than 2f + 2 remain;
- m = n - f - 2: DETOX code (one pass over the scores);
- Flower's MultiKrum takes m as `num_nodes_to_select` (default 1, i.e. Krum) and also averages the
  selection weighted by example count.

Ties in score go to the lowest index (stable sort), so results do not depend on sort internals.
"""

from __future__ import annotations

import torch
from pydantic import Field

from fedsim.aggregators.base import AggregationError, check_inputs
from fedsim.aggregators.distances import pairwise_sq_distances
from fedsim.registry import AGGREGATORS, Params


def scores_from_distances(sq_dist: torch.Tensor, num_neighbours: int) -> torch.Tensor:
    """Sum of each row's `num_neighbours` smallest squared distances to the other rows."""
    others = sq_dist.clone()
    others.fill_diagonal_(float("inf"))
    return others.topk(num_neighbours, dim=1, largest=False).values.sum(dim=1)


def check_krum_size(rule: str, n: int, num_malicious: int) -> None:
    if n < 2 * num_malicious + 3:
        raise AggregationError(
            f"{rule} needs n >= 2f + 3 updates, got n={n}, f={num_malicious}"
        )


def krum_scores(updates: torch.Tensor, num_malicious: int) -> torch.Tensor:
    """[n] Krum scores: the sum of squared distances to the n - f - 2 nearest other updates."""
    check_krum_size("krum", updates.shape[0], num_malicious)
    n = updates.shape[0]
    return scores_from_distances(pairwise_sq_distances(updates), n - num_malicious - 2)


def lowest_scores(scores: torch.Tensor, count: int) -> torch.Tensor:
    """Indices of the `count` lowest scores, in increasing score order, ties to the lower index."""
    return torch.sort(scores, stable=True).indices[:count]


def multikrum_select(
    updates: torch.Tensor, num_malicious: int, num_selected: int | None = None
) -> torch.Tensor:
    """Indices (lowest score first) of the updates Multi-Krum averages; m defaults to n - f."""
    n = updates.shape[0]
    check_krum_size("multikrum", n, num_malicious)
    m = n - num_malicious if num_selected is None else num_selected
    if not 1 <= m <= n:
        raise AggregationError(
            f"multikrum needs 1 <= num_selected <= n, "
            f"got num_selected={m}, n={n}, f={num_malicious}"
        )
    return lowest_scores(krum_scores(updates, num_malicious), m)


class KrumParams(Params):
    num_malicious: int = Field(1, ge=0, description="f, assumed malicious clients; needs n >= 2f+3")

    def round_problem(self, n: int):
        try:
            check_krum_size("krum", n, self.num_malicious)
        except AggregationError as err:
            return "num_malicious", str(err), self.num_malicious
        return None


def krum_with_info(updates: torch.Tensor, weights: torch.Tensor, num_malicious: int = 1) -> tuple[torch.Tensor, dict]:
    """Krum's output and which row it picked (for the round log)."""
    check_inputs(updates, weights)
    best = int(torch.argmin(krum_scores(updates, num_malicious)))
    return updates[best].clone(), {"selected": [best]}


class MultiKrumParams(Params):
    num_malicious: int = Field(1, ge=0, description="f, assumed malicious clients; needs n >= 2f+3")
    num_selected: int | None = Field(
        None, ge=1, description="m, lowest-score updates averaged; n - f when not given"
    )

    def round_problem(self, n: int):
        try:
            check_krum_size("multikrum", n, self.num_malicious)
        except AggregationError as err:
            return "num_malicious", str(err), self.num_malicious
        if self.num_selected is not None and self.num_selected > n:
            return "num_selected", f"multikrum needs num_selected <= n updates, got num_selected={self.num_selected}, n={n}", \
                self.num_selected
        return None


def multikrum_with_info(
    updates: torch.Tensor, weights: torch.Tensor, num_malicious: int = 1, num_selected: int | None = None
) -> tuple[torch.Tensor, dict]:
    """Multi-Krum's output and the rows it averaged (for the round log)."""
    check_inputs(updates, weights)
    chosen = multikrum_select(updates, num_malicious, num_selected)
    chosen_weights = weights[chosen]
    total = chosen_weights.sum()
    if not torch.isfinite(total) or total <= 0:
        raise AggregationError(f"multikrum needs positive total weight, got {float(total)}")
    return (chosen_weights / total).to(updates.dtype) @ updates[chosen], {"selected": sorted(chosen.tolist())}


@AGGREGATORS.register("krum", KrumParams, with_info=krum_with_info)  # the round log names the pick
def krum(updates: torch.Tensor, weights: torch.Tensor, num_malicious: int = 1) -> torch.Tensor:
    """The single update with the lowest Krum score (Blanchard et al. 2017)."""
    return krum_with_info(updates, weights, num_malicious)[0]


@AGGREGATORS.register("multikrum", MultiKrumParams, with_info=multikrum_with_info)
def multikrum(
    updates: torch.Tensor,
    weights: torch.Tensor,
    num_malicious: int = 1,
    num_selected: int | None = None,
) -> torch.Tensor:
    """Example-count-weighted mean of the m lowest Krum scores (m = n - f by default)."""
    return multikrum_with_info(updates, weights, num_malicious, num_selected)[0]
