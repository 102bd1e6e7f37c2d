"""Meamed, mean around median (Xie, Koyejo, Gupta, "Generalized Byzantine-tolerant SGD", arXiv
1802.10116, 2018).

Coordinate by coordinate, average the n - f values nearest to the coordinate's median:

    [Meamed(x)]_k = (1 / (n - f)) sum_{j=1}^{n-f} [x_{pi_k(j)}]_k,
    |[x_{pi_k(1)}]_k - med_k| <= ... <= |[x_{pi_k(n)}]_k - med_k|,   med_k = median([x_1]_k, ..., [x_n]_k)

It needs n > 2f (the paper's b < m / 2; ByzFL refuses 2f >= n too). With f = 0 it is the
plain mean. Like median and trimmed mean it ignores the example counts.

Conventions where the paper says nothing: the median of an even count is the mean of the two
middle values (`coordinate.median_columns`, numpy's convention; ByzFL's `np.median` and
`torch.quantile(q=0.5)` agree). Values at equal distance from the median go to the lower row
index (stable sort); ByzFL takes numpy's `argpartition` or torch's `topk` order, which is not
specified, so on such a tie at the (n - f)-th place the two may average different values
(tests/test_aggregators_byzfl.py checks exact agreement elsewhere, and ties between equal
values, which cannot change the mean). NaN counts as +inf when the median is taken and as
farthest from it, so NaN and inf enter a coordinate's mean only when more than f of its values
are NaN or inf (the output is then not finite). Columns are reduced in blocks (`columns.py`), so the sort's int64 indices stay small
whatever d is.
"""

from __future__ import annotations

import torch
from pydantic import Field

from fedsim.aggregators.base import check_inputs
from fedsim.aggregators.columns import reduce_column_blocks
from fedsim.aggregators.coordinate import median_columns
from fedsim.aggregators.subsets import check_majority, majority_problem
from fedsim.registry import AGGREGATORS, Params


def meamed_columns(block: torch.Tensor, num_malicious: int) -> torch.Tensor:
    """[b] mean of the n - f values of each column nearest to its median."""
    k = block.shape[0] - num_malicious
    ordered = torch.where(block.isnan(), torch.inf, block)  # NaN is an extreme value, not a median-spoiler
    gap = (ordered - median_columns(ordered)).abs()
    gap = torch.where(gap.isnan(), torch.inf, gap)  # inf - inf: a value at infinity when the median is too
    nearest = torch.sort(gap, dim=0, stable=True).indices[:k]
    return block.gather(0, nearest).mean(dim=0)


class MeamedParams(Params):
    num_malicious: int = Field(1, ge=0, description="f: averages the n - f values nearest each coordinate's median; needs n > 2f")

    def round_problem(self, n: int):
        return majority_problem("meamed", n, self.num_malicious)


@AGGREGATORS.register("meamed", MeamedParams)
def meamed(updates: torch.Tensor, weights: torch.Tensor, num_malicious: int = 1) -> torch.Tensor:
    """Mean around median: per coordinate, the mean of the n - f values nearest the median (Xie et al. 2018)."""
    check_inputs(updates, weights)
    check_majority("meamed", updates.shape[0], num_malicious)
    return reduce_column_blocks(lambda block: meamed_columns(block, num_malicious), updates)
