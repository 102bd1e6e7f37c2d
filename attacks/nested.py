"""An attack nested in another as its data source: `attack.poison` of neurotoxin and chameleon.

The outer attack trains in its own way on the poisoned data and measures success on the backdoor
test set of a client-side attack nested as `poison` (`{name: trigger, size: 2}`, `{name:
edge_case, ...}`, or a bare name). The nested spec is validated against the registry like any
attack, and only what the outer attack really uses is accepted:

* an attack with a fixed poisoned set: client-side, without its own `local_train` (not one that
  optimises its trigger while training), and not the outer attack itself;
* data poisoning only (`ClientAttack.poisons_data_only`): no training hook, no update transform,
  so `scale: 1` and, for edge_case, `mode: blackbox`; the outer attack shapes the update itself;
* none of the outer attack's own settings (`OUTER_FIELDS`: who attacks, when, the epochs and lr):
  such a field is accepted only at the nested attack's default (a resolved scenario written out
  by an older fedsim carries them so), and refused, naming `attack.poison.<field>`, otherwise.

The nested spec is written out without `OUTER_FIELDS`, so a dumped scenario loads back equal.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, PlainSerializer, SerializationInfo

from fedsim.attacks.base import ClientAttack
from fedsim.registry import ATTACKS

# settings a nested attack leaves to the outer one: who attacks, when, and how it trains
OUTER_FIELDS = ("num_attackers", "attacker_ids", "schedule", "local_epochs", "lr")


@functools.lru_cache(maxsize=None)
def spec_model(name: str) -> type[BaseModel]:
    """The YAML model of one registered attack, built once per name (pydantic model creation is slow)."""
    return ATTACKS.get(name).spec_model()


def supplies_data(name: str) -> bool:
    """A registered client-side attack with a fixed poisoned set (it trains with the default loop)."""
    obj = ATTACKS.get(name).obj
    return obj.side == "client" and obj.local_train is ClientAttack.local_train


def spec_name(value: BaseModel) -> str | None:
    """The attack a spec model (its `name`) or a bare parameter model (its registry entry) is of."""
    return getattr(value, "name", None) or next((e.name for e in ATTACKS.entries() if e.params is type(value)), None)


@dataclass(frozen=True)
class NestedPoison:
    """The `poison` field of the attack registered as `outer`; `instead` says, for the refusal of an
    update transform, what the outer attack offers in its place (e.g. "attack.pgd_eps for a norm bound")."""

    outer: str
    instead: str
    default: str = "trigger"

    def names(self) -> list[str]:
        """The attacks allowed as this outer attack's poison."""
        return [n for n in ATTACKS.names() if n != self.outer and supplies_data(n)]

    def parse(self, value: Any) -> BaseModel:
        """`attack.poison` as a validated spec: a mapping with `name` (none: the default) and that
        attack's parameters, a bare name, or a spec / bare parameter model."""
        if isinstance(value, BaseModel):
            value = {**value.model_dump(exclude_unset=True), "name": spec_name(value)}
        if isinstance(value, str):
            value = {"name": value}
        if not isinstance(value, Mapping):
            raise ValueError(f"attack.poison must be an attack name or a mapping with `name`, got {value!r}")
        name = value.get("name", self.default)
        self.check_name(name)
        model = spec_model(name)
        absent = [f for f in OUTER_FIELDS if f in value and f not in model.model_fields]
        if absent:  # not even a setting of the nested attack: nothing to compare with a default
            raise ValueError(self.outer_message(absent))
        spec = model.model_validate({**value, "name": name})
        self.check_outer_fields(spec)
        self.check_data_only(spec)
        return spec

    def check_name(self, name: Any) -> None:
        allowed = ", ".join(self.names())
        if name == self.outer:
            raise ValueError(f"attack.poison cannot be {self.outer} itself: nest the attack whose poisoned data "
                             f"{self.outer} trains on; allowed: {allowed}")
        if not isinstance(name, str) or name not in ATTACKS:
            raise ValueError(f"unknown attack.poison {name!r}; allowed: {allowed}")
        if ATTACKS.get(name).obj.side != "client":
            raise ValueError(f"attack.poison={name}: {name} is a server-side attack (it crafts updates on the server "
                             f"and has no poisoned data to train on); allowed: {allowed}")
        if not supplies_data(name):
            raise ValueError(f"attack.poison={name} trains with its own objective (its own local training), not on a "
                             f"fixed poisoned set {self.outer} could reuse; allowed: {allowed}")

    def check_outer_fields(self, spec: BaseModel) -> None:
        """Refuse the outer attack's own settings given on the poison, unless at the poison's default."""
        fields = type(spec).model_fields
        given = [f for f in OUTER_FIELDS
                 if f in fields and getattr(spec, f) != fields[f].get_default(call_default_factory=True)]
        if given:
            raise ValueError(self.outer_message(given))

    def outer_message(self, given: list[str]) -> str:
        one = len(given) == 1
        return (f"{', '.join('attack.poison.' + f for f in given)} {'is' if one else 'are'} {self.outer}'s own "
                f"setting{'' if one else 's'} (who attacks, when, and how it trains): set "
                f"{', '.join('attack.' + f for f in given)} instead")

    def check_data_only(self, spec: BaseModel) -> None:
        """Refuse a poison with a training hook or an update transform: the outer attack replaces both."""
        if ATTACKS.get(spec.name).obj(spec).poisons_data_only():
            return
        fields = type(spec).model_fields
        hints = [f"{f}={getattr(spec, f)!r}" for f, plain in (("scale", 1.0), ("mode", "blackbox"))
                 if f in fields and getattr(spec, f) != plain]
        what = f" ({', '.join(hints)})" if hints else ""
        raise ValueError(
            f"attack.poison={spec.name}{what} has its own training hook or update transform, which {self.outer} "
            f"replaces with its own training: give the poison scale: 1 (edge_case: mode: blackbox) and use "
            f"{self.instead}")

    def dump(self, spec: BaseModel, info: SerializationInfo) -> dict:
        """The spec as written out: without OUTER_FIELDS (always at their defaults), so it loads back equal."""
        return spec.model_dump(mode=info.mode, exclude=set(OUTER_FIELDS), by_alias=info.by_alias,
                               exclude_unset=info.exclude_unset, exclude_defaults=info.exclude_defaults,
                               exclude_none=info.exclude_none)

    def default_spec(self) -> BaseModel:
        return self.parse(self.default)

    def annotation(self) -> Any:
        """The type of the outer attack's `poison` field: parsed by `parse`, written out by `dump`."""
        return Annotated[BaseModel, BeforeValidator(self.parse), PlainSerializer(self.dump, return_type=dict)]
