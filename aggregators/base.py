"""Shared pieces of the aggregation rules."""

from __future__ import annotations

import torch


class AggregationError(ValueError):
    """The rule's preconditions do not hold for this round's updates (the round is skipped)."""


def check_inputs(updates: torch.Tensor, weights: torch.Tensor) -> None:
    if updates.ndim != 2:
        raise AggregationError(f"updates must be [n, d], got shape {tuple(updates.shape)}")
    if weights.shape != (updates.shape[0],):
        raise AggregationError(f"weights must be [n={updates.shape[0]}], got {tuple(weights.shape)}")
    if updates.shape[0] == 0:
        raise AggregationError("no updates to aggregate")


def vector_rule_names() -> list[str]:
    """Registered aggregators that are `[n, d] -> [d]` rules (FedMA's layer-wise protocol is not)."""
    from fedsim.registry import AGGREGATORS

    return [n for n in AGGREGATORS.names() if AGGREGATORS.get(n).capability("protocol") is None]
