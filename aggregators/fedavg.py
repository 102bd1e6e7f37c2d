"""FedAvg: the example-count-weighted mean of the updates (McMahan et al. 2017)."""

from __future__ import annotations

import torch

from fedsim.aggregators.base import AggregationError, check_inputs
from fedsim.registry import AGGREGATORS, Params


class FedAvgParams(Params):
    pass


def secure_mean(spec) -> None:
    """The weighted mean is exactly what a secure (weighted) sum computes: never a problem."""
    return None


@AGGREGATORS.register("fedavg", FedAvgParams, secure_sum=secure_mean, weighted_mean=True)
def fedavg(updates: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Weighted mean of the updates by example count (McMahan et al. 2017)."""
    check_inputs(updates, weights)
    total = weights.sum()
    if not torch.isfinite(total) or total <= 0:
        raise AggregationError(f"fedavg needs positive total weight, got {float(total)}")
    return (weights / total).to(updates.dtype) @ updates
