"""RFA: the weighted geometric median by smoothed Weiszfeld (Pillutla, Kakade, Harchaoui 2022).

Minimises sum_i alpha_i ||z - w_i|| with alpha the normalised example counts. Starting from the
weighted mean, each step reweights the updates by alpha_i / max(nu, ||z - w_i||) and averages;
nu keeps a step finite when z lands on an update. It stops after `max_iter` steps or once the
objective changes by less than ftol * objective. Defaults (4, 1e-5, 1e-6) are those of the RFA
code as ported in OOD_FL and DBA; OOD_FL's experiments pass 500 / 1e-5 / 1e-7, DBA and CRFL use
max_iter = 10.
"""

from __future__ import annotations

import torch
from pydantic import Field

from fedsim.aggregators.base import AggregationError, check_inputs
from fedsim.registry import AGGREGATORS, Params


def geometric_median_objective(
    updates: torch.Tensor, alphas: torch.Tensor, z: torch.Tensor
) -> float:
    """sum_i alpha_i ||z - w_i||."""
    return float(alphas @ torch.linalg.vector_norm(updates - z, dim=1).to(alphas.dtype))


def weiszfeld(
    updates: torch.Tensor, alphas: torch.Tensor, max_iter: int, nu: float, ftol: float
) -> tuple[torch.Tensor, int]:
    """Smoothed Weiszfeld from the weighted mean; returns (z, steps taken)."""
    z = alphas.to(updates.dtype) @ updates
    objective = geometric_median_objective(updates, alphas, z)
    steps = 0
    for steps in range(1, max_iter + 1):
        dist = torch.linalg.vector_norm(updates - z, dim=1).to(alphas.dtype)
        coeffs = alphas / dist.clamp_min(nu)
        z = (coeffs / coeffs.sum()).to(updates.dtype) @ updates
        previous, objective = objective, geometric_median_objective(updates, alphas, z)
        if abs(previous - objective) < ftol * objective:
            break
    return z, steps


class RFAParams(Params):
    max_iter: int = Field(4, ge=1, description="Weiszfeld steps at most")
    nu: float = Field(1e-5, gt=0.0, description="smoothing: distances below nu count as nu")
    ftol: float = Field(1e-6, ge=0.0, description="stop once |objective change| < ftol * objective")


@AGGREGATORS.register("rfa", RFAParams)
def rfa(
    updates: torch.Tensor,
    weights: torch.Tensor,
    max_iter: int = 4,
    nu: float = 1e-5,
    ftol: float = 1e-6,
) -> torch.Tensor:
    """Weighted geometric median of the updates by smoothed Weiszfeld (RFA, Pillutla et al.)."""
    check_inputs(updates, weights)
    total = weights.double().sum()
    if not torch.isfinite(total) or total <= 0:
        raise AggregationError(f"rfa needs positive total weight, got {float(total)}")
    z, _ = weiszfeld(updates, weights.double() / total, max_iter, nu, ftol)
    return z
