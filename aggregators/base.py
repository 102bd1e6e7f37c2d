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
    """Registered aggregators: every one is an `[n, d] -> [d]` rule (protocols such as FedMA are
    registered as protocols, not here)."""
    from fedsim.registry import AGGREGATORS

    return AGGREGATORS.names()


def call_rule(spec, updates: torch.Tensor, weights: torch.Tensor, ctx=None,
              groups: list[list[int]] | None = None) -> tuple[torch.Tensor, dict | None]:
    """The one way a rule is called: with its YAML parameters, plus the round's context when it
    declared `with_context` and the groups (by row) when it declared `needs_groups`. Returns its
    aggregate and, for a rule declared `with_info`, its report by row (else None). The server's
    pipeline, DETOX's and the wrappers' inner rules, benchmarks and tests all come through here."""
    from fedsim.registry import AGGREGATORS, component_kwargs

    entry = AGGREGATORS.get(spec.name)
    kwargs = component_kwargs(spec)
    if entry.traits.with_context:
        kwargs["ctx"] = ctx
    if entry.traits.needs_groups:
        kwargs["groups"] = groups if groups is not None else [[i] for i in range(updates.shape[0])]
    if entry.traits.with_info is None:
        return entry.obj(updates, weights, **kwargs), None
    return entry.traits.with_info(updates, weights, **kwargs)


@functools.lru_cache(maxsize=None)
def inner_spec_model(name: str):
    """The YAML model of one nested rule, built once per name (pydantic model creation is slow)."""
    from fedsim.registry import AGGREGATORS

    return AGGREGATORS.get(name).spec_model()


def parse_nested_rule(value: Any, default: str, allowed: list[str], why_not: Callable[[str], str]):
    """A nested rule spec (DETOX's or a wrapper's `inner`) validated against the registry: `name`
    plus that rule's parameters. A bare name is shorthand for `{name: ...}`, a mapping without
    `name` means `default`; a name outside `allowed` is refused with `why_not(name)`."""
    from fedsim.registry import nested_mapping

    value = nested_mapping(dict(value) if isinstance(value, Mapping) else value, "inner", "rule", default)
    name = value["name"]
    if not isinstance(name, str):
        raise ValueError(f"inner.name must be a rule name, got {type(name).__name__} {name!r}; allowed: {', '.join(allowed)}")
    if name not in allowed:
        raise ValueError(f"{why_not(name)}; allowed: {', '.join(allowed)}")
    return inner_spec_model(name).model_validate({**value, "name": name})
