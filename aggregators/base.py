"""Shared pieces of the aggregation rules."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

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


def run_inner(spec, rows: torch.Tensor, weights: torch.Tensor, ctx) -> tuple[torch.Tensor, dict | None]:
    """A nested rule's aggregate of `rows` and its report (by row of `rows`) if it gives one. A rule
    declared `with_context` gets `ctx`, as the server's pipeline would give it (wrappers and DETOX)."""
    from fedsim.registry import AGGREGATORS, component_kwargs

    entry = AGGREGATORS.get(spec.name)
    kwargs = component_kwargs(spec)
    if entry.capability("with_context", False):
        kwargs["ctx"] = ctx
    with_info = entry.capability("with_info")
    if with_info is None:
        return entry.obj(rows, weights, **kwargs), None
    return with_info(rows, weights, **kwargs)


@functools.lru_cache(maxsize=None)
def inner_spec_model(name: str):
    """The YAML model of one nested rule, built once per name (pydantic model creation is slow)."""
    from fedsim.registry import AGGREGATORS

    return AGGREGATORS.get(name).spec_model()


def parse_nested_rule(value: Any, default: str, allowed: list[str], why_not: Callable[[str], str]):
    """A nested rule spec (DETOX's or a wrapper's `inner`) validated against the registry: `name`
    plus that rule's parameters. A bare name is shorthand for `{name: ...}`, a mapping without
    `name` means `default`; a name outside `allowed` is refused with `why_not(name)`."""
    from pydantic import BaseModel

    if isinstance(value, BaseModel):
        value = value.model_dump()
    if isinstance(value, str):
        value = {"name": value}
    if not isinstance(value, Mapping):
        raise ValueError(f"inner must be a rule name or a mapping with `name`, got {value!r}")
    name = value.get("name", default)
    if name not in allowed:
        raise ValueError(f"{why_not(name)}; allowed: {', '.join(allowed)}")
    return inner_spec_model(name).model_validate({**value, "name": name})
