"""Property-based fuzzing of scenario files (#16): whatever a file holds, `fedsim validate` and
`fedsim sweep` either accept it or refuse it with problems naming fields, never with another
exception and never slowly; and a scenario that validates can run a round. A small example budget
runs by default, a large one in the slow step."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedsim.scenario import ScenarioError, load_scenario, read_yaml, validate_scenario
from fedsim.runs.sweep import expand

REPO = Path(__file__).resolve().parents[1]
SHIPPED = sorted(p for p in (REPO / "scenarios").rglob("*.yaml"))
KEYS = ["seed", "name", "federation.num_clients", "federation.clients_per_round", "federation.rounds", "federation.lr",
        "federation.min_replies", "federation.client_cpus", "federation.momentum", "aggregator", "aggregator.num_malicious",
        "aggregator.num_selected", "aggregator.num_trim", "aggregator.beta", "aggregator.group_size", "attack",
        "attack.num_attackers", "attack.attacker_ids", "attack.schedule", "attack.edge_set", "defenses", "compression",
        "compression.fraction", "lowrank", "model", "model.hidden", "data.partition", "data.dataset", "evaluation.every",
        "sweep", "sweep.seed", "base", "colour", "systems", "systems.round", "systems.round.factor",
        "systems.round.deadline", "systems.availability.dropout", "systems.availability.diurnal", "systems.devices",
        "systems.networks", "systems.adacomm", "systems.server_seconds", "systems.targets"]
scalars = st.one_of(st.none(), st.booleans(), st.integers(-(10**30), 10**30), st.floats(allow_nan=True, allow_infinity=True),
                    st.text(max_size=30), st.sampled_from(["krum", "median", "fedavg", "detox", "edge_case", "topk", "fedma",
                                                           "cuttlefish", "lenet", "mlp", "dirichlet", "every_round",
                                                           "over_selection", "deadline", "wait_for_all", "measured"]))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.one_of(st.text(max_size=10), st.integers()), inner, max_size=4)),
                      max_leaves=12)


def set_path(raw: dict, dotted: str, value) -> None:
    node = raw
    *head, last = dotted.split(".")
    for part in head:
        if not isinstance(node.get(part), dict):
            node[part] = {} if not isinstance(node.get(part), str) else {"name": node[part]}
        node = node[part]
    node[last] = value


@st.composite
def scenario_texts(draw) -> bytes:
    """A shipped scenario with a few keys set to arbitrary YAML values, or arbitrary bytes."""
    if draw(st.integers(0, 9)) == 0:
        return draw(st.binary(max_size=300))
    raw = read_yaml(draw(st.sampled_from(SHIPPED)))
    raw.pop("base", None)
    for _ in range(draw(st.integers(1, 4))):
        set_path(raw, draw(st.sampled_from(KEYS)), draw(values))
    return yaml.safe_dump(raw).encode()


def check_file(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "fuzzed.yaml"
    path.write_bytes(content)
    t0 = time.monotonic()
    try:
        raw = read_yaml(path)
        if isinstance(raw, dict) and "sweep" in raw:
            expand(path)
        else:
            load_scenario(path)
    except ScenarioError as err:
        assert err.problems and all(isinstance(p, str) and msg for p, msg, _ in err.problems)
        assert len(str(err)) < 20_000
    assert time.monotonic() - t0 < 5


SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@settings(max_examples=60, **SETTINGS)
@given(content=scenario_texts())
def test_any_scenario_file_is_accepted_or_refused_with_reasons(tmp_path, content):
    check_file(tmp_path, content)


@pytest.mark.slow
@settings(max_examples=3000, **SETTINGS)
@given(content=scenario_texts())
def test_any_scenario_file_many(tmp_path, content):
    check_file(tmp_path, content)


RULES = st.one_of(
    st.builds(lambda f: {"name": "krum", "num_malicious": f}, st.integers(0, 4)),
    st.builds(lambda f, m: {"name": "multikrum", "num_malicious": f, "num_selected": m}, st.integers(0, 4), st.integers(1, 12)),
    st.builds(lambda f: {"name": "bulyan", "num_malicious": f}, st.integers(0, 3)),
    st.builds(lambda t: {"name": "trimmed_mean", "num_trim": t}, st.integers(0, 6)),
    st.builds(lambda r, f: {"name": "detox", "group_size": r, "inner": {"name": "multikrum", "num_malicious": f}},
              st.sampled_from([1, 3, 5]), st.integers(0, 2)),
    st.just("median"), st.just("rfa"), st.just("fedavg"),
)


def run_one_round(rule, per_round: int, min_replies: int):
    from fedsim.client.app import make_client_app
    from fedsim.server.app import run_server
    from fedsim.flower.local_grid import LocalGrid

    raw = {"federation": {"num_clients": 12, "clients_per_round": per_round, "rounds": 1, "local_epochs": 1,
                          "min_replies": min_replies}, "aggregator": rule, "model": {"name": "mlp", "hidden": [8]},
           "output": {"checkpoints": False}}
    try:
        scenario = validate_scenario(raw)
    except ScenarioError:
        return None
    import tempfile

    from fedsim.runs.folder import RunFolder
    from fedsim.runs.results import read_rounds

    with tempfile.TemporaryDirectory() as tmp:
        run_dir = RunFolder.create(scenario, tmp).path
        run_server(LocalGrid(make_client_app(scenario), 12), scenario, run_dir)
        return read_rounds(run_dir)


@settings(max_examples=12, **SETTINGS)
@given(rule=RULES, per_round=st.integers(1, 12), min_replies=st.integers(1, 12))
def test_a_scenario_that_validates_runs_a_round(rule, per_round, min_replies):
    rounds = run_one_round(rule, per_round, min_replies)
    if rounds is not None:
        assert len(rounds) == 1 and not rounds[0]["skipped"], rounds[0]["skipped"]
