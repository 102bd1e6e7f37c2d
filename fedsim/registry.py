"""One small registry per component kind.

Components register themselves with a decorator that names them and gives the pydantic model of
their parameters. The scenario schema, `fedsim list` and the README's component table are built
from these registries, so a component cannot be usable in one place and missing from another.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, create_model


def component_kwargs(spec) -> dict[str, Any]:
    """A component spec's parameters as keyword arguments (its `name` dropped): how a rule, a
    nested rule or a defense is called with what the YAML gave it."""
    return {k: getattr(spec, k) for k in type(spec).model_fields if k != "name"}


class Params(BaseModel):
    """Base class of every component's parameter model: unknown keys and non-finite numbers are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    def round_problem(self, n: int) -> tuple[str, str, Any] | None:
        """For an aggregator: why a round of `n` updates could not be aggregated with these
        parameters, as (parameter, reason, value), or None. Checked against
        `federation.clients_per_round` at validation, so no scenario validates whose every round
        would be skipped. Rules with preconditions on n override it with the check they run."""
        return None


@dataclass(frozen=True)
class Entry:
    """A registered component: its YAML name, the object, its parameter model and a one-line summary."""

    kind: str
    name: str
    obj: Any
    params: type[Params]
    capabilities: dict = field(default_factory=dict)  # what callers must know, declared at registration

    def capability(self, key: str, default: Any = None) -> Any:
        """A declared capability; a "module:attribute" text is imported on first use (so a
        protocol's server and client parts are loaded only where they run)."""
        value = self.capabilities.get(key, default)
        if isinstance(value, str) and ":" in value:
            module, _, attr = value.partition(":")
            return getattr(importlib.import_module(module), attr)
        return value

    @property
    def summary(self) -> str:
        doc = (getattr(self.obj, "__doc__", None) or "").strip()
        return doc.splitlines()[0] if doc else ""

    def spec_model(self) -> type[BaseModel]:
        """The YAML model for this component: `name: <literal>` plus its own parameters."""
        return create_model(
            f"{self.kind}:{self.name}",
            __base__=self.params,
            name=(Literal[self.name], ...),  # type: ignore[valid-type]
        )


class Registry:
    """Name -> component, for one kind (aggregator, defense, attack, ...)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, Entry] = {}

    def register(self, name: str, params: type[Params] = Params, **capabilities: Any) -> Callable[[Any], Any]:
        """Decorator: register `obj` as `name` with its parameter model and its capabilities, e.g. an
        aggregator's `needs_groups=True`, `with_info=fn` (also reports what it chose),
        `with_context=True` (is given the round's context), `top_level_only=True` (never nested in
        DETOX or a wrapper) or `protocol=...` (a multi-exchange protocol with its own strategy, like
        FedMA); a defense's `fixed_layers=fn(spec) -> bool` (cannot follow a low-rank switch) or
        `certify="module:function"` (certifies the global model at evaluation, like CRFL)."""

        def deco(obj: Any) -> Any:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            if not (isinstance(params, type) and issubclass(params, Params)):
                raise TypeError(f"{self.kind} {name!r}: params must subclass fedsim.registry.Params")
            self._entries[name] = Entry(self.kind, name, obj, params, dict(capabilities))
            return obj

        return deco

    def get(self, name: str) -> Entry:
        load_components()
        try:
            return self._entries[name]
        except KeyError:
            raise KeyError(
                f"unknown {self.kind} {name!r}; allowed: {', '.join(sorted(self._entries))}"
            ) from None

    def names(self) -> list[str]:
        load_components()
        return sorted(self._entries)

    def entries(self) -> list[Entry]:
        load_components()
        return [self._entries[n] for n in sorted(self._entries)]

    def __contains__(self, name: str) -> bool:
        load_components()
        return name in self._entries


AGGREGATORS = Registry("aggregator")
DEFENSES = Registry("defense")
ATTACKS = Registry("attack")
COMPRESSORS = Registry("compressor")
DATASETS = Registry("dataset")
MODELS = Registry("model")
PARTITIONERS = Registry("partitioner")

ALL = {
    r.kind: r
    for r in (AGGREGATORS, DEFENSES, ATTACKS, COMPRESSORS, DATASETS, MODELS, PARTITIONERS)
}

# Modules whose import registers components. Kept in one list so that registering is explicit.
COMPONENT_MODULES = (
    "fedsim.aggregators",
    "fedsim.defenses",
    "fedsim.attacks",
    "fedsim.fedma",
    "fedsim.compression",
    "fedsim.data",
    "fedsim.models",
)

_loaded = False


def load_components() -> None:
    """Import every component package once, so that all registries are filled."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    for mod in COMPONENT_MODULES:
        importlib.import_module(mod)
