"""Coordinate-wise median and trimmed mean (Yin et al. 2018).

Both ignore the example counts, as Flower's FedMedian and FedTrimmedAvg do: a weighted median would
let a client that reports a large dataset move every coordinate.
"""

from __future__ import annotations

import torch
from pydantic import Field, model_validator

from fedsim.aggregators.base import AggregationError, check_inputs
from fedsim.aggregators.columns import reduce_column_blocks
from fedsim.registry import AGGREGATORS, Params

DEFAULT_TRIM_FRACTION = 0.2  # Flower's FedTrimmedAvg default


def median_columns(block: torch.Tensor) -> torch.Tensor:
    """np.median semantics: the mean of the two middle values when n is even.

    torch.median alone returns the lower middle value, which would not match Flower's FedMedian.
    """
    n = block.shape[0]
    lower = block.median(dim=0).values
    if n % 2 == 1:
        return lower
    upper = block.kthvalue(n // 2 + 1, dim=0).values
    return 0.5 * lower + 0.5 * upper


class MedianParams(Params):
    pass


@AGGREGATORS.register("median", MedianParams)
def median(updates: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Coordinate-wise median of the updates (Yin et al. 2018; Flower FedMedian)."""
    check_inputs(updates, weights)
    return reduce_column_blocks(median_columns, updates)


def trim_count(n: int, beta: float | None = None, num_trim: int | None = None) -> int:
    """How many values to drop from each end of every coordinate.

    A fraction is rounded down as `int(beta * n)`, exactly as Flower's `trim_mean` and
    scipy.stats.trim_mean do; `num_trim` gives the count directly (NDSS'21 uses num_trim = f).
    """
    if beta is not None and num_trim is not None:
        raise AggregationError("trimmed_mean takes beta or num_trim, not both")
    if num_trim is None:
        beta = DEFAULT_TRIM_FRACTION if beta is None else beta
        if not 0.0 <= beta < 0.5:
            raise AggregationError(f"trimmed_mean needs 0 <= beta < 0.5, got {beta}")
        num_trim = int(beta * n)
    if num_trim < 0 or n - 2 * num_trim < 1:
        raise AggregationError(
            f"trimmed_mean would remove every value: n={n}, trimming {num_trim} from each end"
        )
    return num_trim


def trimmed_mean_columns(block: torch.Tensor, num_trim: int) -> torch.Tensor:
    n = block.shape[0]
    if num_trim == 0:
        return block.mean(dim=0)
    return block.sort(dim=0).values[num_trim : n - num_trim].mean(dim=0)


class TrimmedMeanParams(Params):
    beta: float | None = Field(
        None,
        ge=0.0,
        lt=0.5,
        description=f"fraction cut from each end, rounded down as int(beta*n); "
        f"{DEFAULT_TRIM_FRACTION} when num_trim is not given",
    )
    num_trim: int | None = Field(
        None, ge=0, description="count cut from each end instead of a fraction (NDSS'21: f)"
    )

    @model_validator(mode="after")
    def _one_of_beta_or_num_trim(self) -> "TrimmedMeanParams":
        if self.beta is not None and self.num_trim is not None:
            raise ValueError("give beta or num_trim, not both")
        return self

    def round_problem(self, n: int):
        try:
            trim_count(n, self.beta, self.num_trim)
        except AggregationError as err:
            return ("num_trim" if self.num_trim is not None else "beta"), str(err), self.num_trim or self.beta
        return None


@AGGREGATORS.register("trimmed_mean", TrimmedMeanParams)
def trimmed_mean(
    updates: torch.Tensor,
    weights: torch.Tensor,
    beta: float | None = None,
    num_trim: int | None = None,
) -> torch.Tensor:
    """Coordinate-wise mean after dropping the largest and smallest values (Yin et al. 2018)."""
    check_inputs(updates, weights)
    k = trim_count(updates.shape[0], beta, num_trim)
    return reduce_column_blocks(lambda block: trimmed_mean_columns(block, k), updates)
