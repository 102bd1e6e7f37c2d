"""The component registries: a name registered twice or with parameters that are not a Params
model is refused, and every registered name is a valid scenario section at its defaults."""

from __future__ import annotations

import pytest

from fedsim.registry import ALL, Params, Registry
from fedsim.scenario import validate_scenario


def test_registry_rejects_duplicates_and_bad_params():
    reg = Registry("thing")
    reg.register("a")(object)
    with pytest.raises(ValueError):
        reg.register("a")(object)
    with pytest.raises(TypeError):
        reg.register("b", params=dict)(object)


@pytest.mark.parametrize("kind", sorted(ALL))
def test_every_registered_component_validates_in_a_scenario(kind):
    """Nothing can be registered and unusable: each name, with default parameters, is a valid scenario section."""
    section = {
        "aggregator": "aggregator", "defense": "defenses", "attack": "attack", "compressor": "compression",
        "model": "model", "dataset": None, "partitioner": None, "tracking sink": "tracking", "protocol": None,
        "privacy attack": "privacy_attacks",
    }[kind]
    for entry in ALL[kind].entries():
        assert issubclass(entry.params, Params)
        entry.params()  # defaults are valid
        if section in ("defenses", "tracking", "privacy_attacks"):
            raw = {section: [entry.name]}
            if kind == "privacy attack" and entry.traits.needs_model:  # the imprint attack reads its own model's layer
                raw["model"] = entry.traits.needs_model
        elif kind == "protocol":  # named by the section it declares (the default protocol by none)
            raw = {}
            if entry.traits.chosen_by:  # a dotted path names a section inside a section (systems.round)
                *outer, last = entry.traits.chosen_by.split(".")
                inner = raw
                for part in outer:
                    inner = inner.setdefault(part, {})
                inner[last] = entry.name
        elif section is not None:
            raw = {section: entry.name}
        elif kind == "dataset":
            raw = {"data": {"dataset": entry.name}}
        else:
            raw = {"data": {"partition": entry.name}}
        if kind == "aggregator":  # DETOX's defaults (groups of 3, Multi-Krum f=1 inside) need 15 clients a round
            raw["federation"] = {"clients_per_round": 15}
        validate_scenario(raw)
