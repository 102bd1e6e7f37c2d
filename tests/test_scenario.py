"""The scenario schema: defaults, overrides, and an error with its field path for every kind of mistake."""

from __future__ import annotations

import pytest

from fedsim.cli import main
from fedsim.scenario import ScenarioError, apply_overrides, dump_scenario, load_scenario, validate_scenario


def problems(raw) -> dict[str, str]:
    with pytest.raises(ScenarioError) as info:
        validate_scenario(raw)
    return {path: msg for path, msg, _ in info.value.problems}


def test_defaults_resolve_every_section():
    s = validate_scenario({})
    assert s.data.dataset.name == "digits" and s.model.name == "mlp" and s.aggregator.name == "fedavg"
    assert s.data.partition.name == "dirichlet" and s.data.partition.alpha == 0.5
    assert s.attack is None and s.defenses == [] and s.compression.name == "none"


def test_string_shorthand_equals_mapping():
    assert validate_scenario({"model": "lenet"}).model == validate_scenario({"model": {"name": "lenet"}}).model


def test_unknown_key_is_named():
    assert problems({"federation": {"rouns": 3}}) == {"federation.rouns": "unknown key"}
    assert "model.mlp.depth" in problems({"model": {"name": "mlp", "depth": 3}})
    assert "colour" in problems({"colour": "red"})


def test_unknown_component_lists_allowed_names():
    msg = problems({"model": "resnet"})["model"]
    assert "unknown name" in msg and "'lenet'" in msg and "'mlp'" in msg


def test_wrong_type_and_constraint():
    got = problems({"seed": "x", "federation": {"rounds": 0}, "model": {"name": "mlp", "hidden": ["a"]}})
    assert set(got) == {"seed", "federation.rounds", "model.mlp.hidden.0"}
    assert "greater than or equal to 1" in got["federation.rounds"]


def test_literal_lists_allowed_values():
    msg = problems({"attack": {"name": "edge_case", "mode": "bogus"}})["attack.edge_case.mode"]
    assert "'blackbox'" in msg and "'pgd'" in msg and "'pgd_replacement'" in msg


def test_cross_field_checks():
    assert "exceeds" in problems({"federation": {"num_clients": 5, "clients_per_round": 6}})["<top>"]
    assert "not client ids" in problems({"attack": {"name": "edge_case", "attacker_ids": [25]}})["<top>"]
    assert "angle_range" in problems({"attack": {"name": "edge_case", "edge_set": {"name": "tail", "angle_range": [90, 30]}}})[
        "attack.edge_case.edge_set.tail"
    ]


def test_all_errors_reported_at_once():
    got = problems({"seed": "x", "federation": {"rouns": 1}, "aggregator": "nope"})
    assert len(got) == 3


def test_overrides_parse_yaml_values():
    raw = apply_overrides({"aggregator": "fedavg"}, ["federation.rounds=5", "model.hidden=[8, 4]", "data.dir=null"])
    s = validate_scenario(raw)
    assert s.federation.rounds == 5 and s.model.hidden == [8, 4] and s.data.dir is None


def test_resolved_dump_round_trips(tmp_path):
    s = load_scenario("scenarios/quickstart.yaml")
    path = tmp_path / "resolved.yaml"
    path.write_text(dump_scenario(s))
    assert load_scenario(path) == s


def test_bad_yaml_and_missing_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("federation: {rounds: [\n")
    with pytest.raises(ScenarioError, match="not valid YAML"):
        load_scenario(bad)
    with pytest.raises(ScenarioError, match="no such file"):
        load_scenario(tmp_path / "missing.yaml")


def test_cli_validate_lists_errors_without_traceback(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("seed: x\nfederation: {rouns: 3}\naggregator: {name: krumm}\n")
    assert main(["validate", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "3 problem(s)" in err and "federation.rouns" in err and "krumm" in err and "Traceback" not in err


def test_cli_validate_prints_resolved(capsys):
    assert main(["validate", "scenarios/quickstart.yaml", "--set", "federation.rounds=4"]) == 0
    assert "rounds: 4" in capsys.readouterr().out
