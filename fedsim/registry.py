"""One small registry per component kind.

Components register themselves with a decorator that names them and gives the pydantic model of
their parameters. The scenario schema, `fedsim list` and the README's component table are built
from these registries, so a component cannot be usable in one place and missing from another.
What callers must know of a component is declared with it as typed traits of its kind
(`AggregatorTraits`, `ProtocolTraits`, ...), never asked of it by name elsewhere.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, fields
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
        """Why a round of `n` updates could not be handled with these parameters, as (parameter,
        reason, value), or None; parameter "" when the problem is `n` itself.

        For an aggregator: the `n` updates could not be aggregated. For a defense: `n` is the number
        of updates a round's defense sees (each step's batch in `RoundPipeline.run`), on which its
        `before`/`after` would fail or be degenerate (a filter that can never remove anything, every
        coordinate reversed, ...). Validation checks it against the updates a round yields (the
        aggregator's against `federation.clients_per_round`), so that no scenario validates whose
        every round would be skipped or left undefended. Components with preconditions on n
        override it with the check they run."""
        return None


def nested_mapping(value: Any, field: str, what: str, default: str) -> dict:
    """A nested component spec as a mapping with `name` (a rule's `inner`, the imprint model's
    `body`): a validated spec is dumped, a bare name is shorthand for `{name: ...}`, a mapping
    without `name` means `default`; anything else is refused naming `field` and `what` it takes."""
    if isinstance(value, BaseModel):
        value = value.model_dump()
    if isinstance(value, str):
        value = {"name": value}
    if not isinstance(value, dict):
        raise ValueError(f"{field} must be a {what} name or a mapping with `name`, got {value!r}")
    return {**value, "name": value.get("name", default)}


def _never(spec) -> bool:
    return False


def load(ref: Any) -> Any:
    """A declared object, or a "module:attribute" text imported on first use (so a protocol's
    server and client parts are loaded only where they run, and never by the scenario's schema)."""
    if isinstance(ref, str) and ":" in ref:
        module, _, attr = ref.partition(":")
        return getattr(importlib.import_module(module), attr)
    return ref


# --- what each kind declares at registration: typed fields, checked when a component registers ---
@dataclass(frozen=True)
class AggregatorTraits:
    with_info: Callable | None = None  # the rule's twin that also reports what it chose: (aggregate, info by row)
    with_context: bool = False  # is given the round's context (`ctx=`): its generator, the global model, ...
    needs_groups: bool = False  # is given the round's groups (`groups=`: rows by group, DETOX)
    top_level_only: bool = False  # never nested inside DETOX or a wrapper (FLTrust: needs the server's own update)
    weighted_mean: bool = False  # its aggregate is the example-weighted mean of the rows (what DP-FedAvg's ε assumes)
    # under secure aggregation: None when the rule needs every client's update; else a function of the
    # rule's spec giving why this configuration cannot run on secure sums, (field, why, value), or None
    secure_sum: Callable[[Any], tuple | None] | None = None


@dataclass(frozen=True)
class DefenseTraits:
    with_federation: bool = False  # is given the scenario's federation section (DP-FedAvg's sampling rate)
    scenario_check: Callable | None = None  # (scenario, index) -> problems, refused at validation
    fixed_layers: Callable[[Any], bool] = _never  # spec -> whether it cannot follow a low-rank switch
    certify: Any = None  # "module:function" certifying the global model at evaluation (CRFL)
    secure_alternative: str | None = None  # under secure aggregation: what replaces it on the clients
    reads_updates: bool = True  # its server part reads the individual updates (False: it runs under secure aggregation)
    # "module:function" an honest client trains with in place of plain `train` (FLIP, Lockdown):
    # (spec, fedsim.client.steps.HonestTraining) -> (update, stats); honest clients then train one by one
    client_training: Any = None
    # "module:function" giving the model the server deploys and its rejection rule, applied before
    # the central evaluation: (spec, model, runtime, round, the defense's deployed_state() after that round)
    #   -> (model, accept(logits) -> bool [n] | None)
    inference: Any = None


@dataclass(frozen=True)
class AttackTraits:
    with_rule: bool = False  # craft(..., rule=): tunes itself by running the round's rule
    with_client_ids: bool = False  # craft(..., honest_ids=): follows clients across rounds
    stateful: bool = False  # state_dict / load_state_dict, checkpointed with the server


@dataclass(frozen=True)
class PrivacyAttackTraits:
    """A privacy attack (leakage/): what it reads and what it needs of the scenario."""

    kind: str = "inversion"  # "inversion": reconstructs inputs from an update; "membership": scores targets against a model
    needs_model: str | None = None  # the model the scenario must name (the imprint attack's malicious `imprint` model)


@dataclass(frozen=True)
class CompressorTraits:
    dense: bool = False  # uploads the update as it is: what secure masking and FedMA's layer uploads need


@dataclass(frozen=True)
class DatasetTraits:
    embedded: bool = False  # ships with a library: needs no data directory


@dataclass(frozen=True)
class ModelTraits:
    resize: Callable | None = None  # (input_shape, num_classes, params, widths) -> the net with other hidden widths
    replanted: Callable | None = None  # params -> names of parameters a (malicious) server writes back to their
    #   initial values after every server step, so every broadcast carries them (Robbing the Fed's imprint block)


@dataclass(frozen=True)
class PartitionerTraits:
    needs_groups: bool = False  # partitions by the dataset's own groups (writers, users)


@dataclass(frozen=True)
class SinkTraits:
    requires: tuple[str, ...] = ()  # the tracking library's modules, checked before the first round


@dataclass(frozen=True)
class ProtocolTraits:
    """A round protocol: how one round's messages go out and its replies come back."""

    exchange: Any = None  # "module:Class": the server's side (fedsim/server/exchange.py: the calling convention)
    client_step: Any = None  # "module:function": the client's side of one message
    chosen_by: str | None = None  # the scenario section whose `name` names this protocol (None: the default)
    scenario_check: Callable | None = None  # scenario -> problems (field, reason, value), refused at validation
    individual_updates: bool = True  # the server sees each client's update (False: only secure sums)
    update_pipeline: bool = True  # its rounds end in an [n, d] batch for defenses and a rule (FedMA's: matching)
    cohort_training: bool = False  # its client step trains through local_update: a cohort may train together (fedsim/client/cohort.py)
    opens_rounds: bool = False  # its exchange opens each round itself (`open_round(rnd)`: asynchronous server steps)


@dataclass(frozen=True)
class Entry:
    """A registered component: its YAML name, the object, its parameter model and its declared traits."""

    kind: str
    name: str
    obj: Any
    params: type[Params]
    traits: Any  # the kind's traits dataclass

    def load(self, trait: str) -> Any:
        """A trait that names an object, imported on first use."""
        return load(getattr(self.traits, trait))

    @property
    def where(self) -> str:
        """The module that defines the component (for `fedsim list --where`)."""
        return getattr(self.obj, "__module__", "") or ""

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

    def __init__(self, kind: str, traits: type = type(None)) -> None:
        self.kind = kind
        self.traits = traits
        self._entries: dict[str, Entry] = {}

    def register(self, name: str, params: type[Params] = Params, **traits: Any) -> Callable[[Any], Any]:
        """Decorator: register `obj` as `name` with its parameter model and its traits, the typed
        fields of this kind's traits class (e.g. an aggregator's `needs_groups=True`); an unknown
        trait is an error at import."""

        def deco(obj: Any) -> Any:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            if not (isinstance(params, type) and issubclass(params, Params)):
                raise TypeError(f"{self.kind} {name!r}: params must subclass fedsim.registry.Params")
            try:
                declared = self.traits(**traits)
            except TypeError:
                allowed = [f.name for f in fields(self.traits)] if self.traits is not type(None) else []
                raise TypeError(f"{self.kind} {name!r}: unknown traits {sorted(traits)}; a {self.kind} declares "
                                f"{', '.join(allowed) or 'none'}") from None
            self._entries[name] = Entry(self.kind, name, obj, params, declared)
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

    def entry_for(self, instance: Any) -> Entry:
        """The entry of a component built from this registry (an attack object, say)."""
        load_components()
        for entry in self._entries.values():
            if entry.obj is type(instance):
                return entry
        raise KeyError(f"{type(instance).__name__} is not a registered {self.kind}")

    def names(self) -> list[str]:
        load_components()
        return sorted(self._entries)

    def entries(self) -> list[Entry]:
        load_components()
        return [self._entries[n] for n in sorted(self._entries)]

    def __contains__(self, name: str) -> bool:
        load_components()
        return isinstance(name, str) and name in self._entries


AGGREGATORS = Registry("aggregator", AggregatorTraits)
DEFENSES = Registry("defense", DefenseTraits)
ATTACKS = Registry("attack", AttackTraits)
COMPRESSORS = Registry("compressor", CompressorTraits)
DATASETS = Registry("dataset", DatasetTraits)
MODELS = Registry("model", ModelTraits)
PARTITIONERS = Registry("partitioner", PartitionerTraits)
PROTOCOLS = Registry("protocol", ProtocolTraits)
TRACKING_SINKS = Registry("tracking sink", SinkTraits)
PRIVACY_ATTACKS = Registry("privacy attack", PrivacyAttackTraits)

ALL = {
    r.kind: r
    for r in (AGGREGATORS, DEFENSES, ATTACKS, COMPRESSORS, DATASETS, MODELS, PARTITIONERS, PROTOCOLS, TRACKING_SINKS,
              PRIVACY_ATTACKS)
}

# Modules whose import registers components. Kept in one list so that registering is explicit.
COMPONENT_MODULES = (
    "fedsim.aggregators",
    "fedsim.defenses",
    "fedsim.attacks",
    "fedsim.leakage",
    "fedsim.fedma",
    "fedsim.compression",
    "fedsim.data",
    "fedsim.models",
    "fedsim.secagg.config",
    "fedsim.clock.config",
    "fedsim.server",
    "fedsim.tracking.sinks",
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


def chooses(scenario, entry: Entry) -> bool:
    """Whether the scenario names this protocol: its `chosen_by` section (a dotted path into the
    scenario, `systems.round`) exists and its `name` is the protocol's."""
    if entry.traits.chosen_by is None:
        return False
    section = scenario
    for part in entry.traits.chosen_by.split("."):
        section = getattr(section, part, None)
    return getattr(section, "name", None) == entry.name


def protocol_for(scenario) -> Entry:
    """The round protocol a scenario runs: the one whose `chosen_by` section names it
    (`secure_aggregation: {name: lightsecagg}`, `aggregator: {name: fedma}`, `systems: {round: deadline}`),
    else the default."""
    chosen = [e for e in PROTOCOLS.entries() if chooses(scenario, e)]
    if len(chosen) > 1:
        raise ValueError(f"the scenario names two round protocols: {', '.join(e.name for e in chosen)}")
    if chosen:
        return chosen[0]
    return next(e for e in PROTOCOLS.entries() if e.traits.chosen_by is None)
