"""FLTrust (aggregators/fltrust.py) against a hand computation, a loop re-implementation of the
paper's formulas, the properties the paper states, and real rounds with the server's root dataset."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import QUICKSTART, quick_scenario, run_local
from fedsim.server.record import without_times
from fedsim.aggregators.base import AggregationError
from fedsim.aggregators.fltrust import fltrust
from fedsim.preflight import preflight
from fedsim.runs.results import read_rounds
from fedsim.runtime import runtime_for
from fedsim.scenario import ScenarioError
from fedsim.server.evaluation import CentralEvaluator


def test_by_hand():
    g0 = torch.tensor([1.0, 0.0])
    updates = torch.tensor([[2.0, 0.0], [0.0, 3.0], [-1.0, 0.0], [1.0, 1.0]])
    agg, trust = fltrust(updates, g0)
    # trust: cos = 1, 0, -1 -> 0, 1/sqrt2; normalised rows: [1,0], -, -, [1,1]/sqrt2
    s = float(1 / np.sqrt(2))
    assert torch.allclose(trust, torch.tensor([1.0, 0.0, 0.0, s]))
    want = (1.0 * torch.tensor([1.0, 0.0]) + s * torch.tensor([s, s])) / (1 + s)
    assert torch.allclose(agg, want)


def reference(updates: np.ndarray, g0: np.ndarray) -> np.ndarray:
    """The paper's Algorithm 2, line by line, one client at a time."""
    total, acc = 0.0, np.zeros_like(g0, dtype=np.float64)
    for g in updates.astype(np.float64):
        ts = max(0.0, float(g @ g0) / (np.linalg.norm(g) * np.linalg.norm(g0)))
        acc += ts * (np.linalg.norm(g0) / np.linalg.norm(g)) * g
        total += ts
    return acc / total


@pytest.mark.parametrize("seed", range(5))
def test_matches_the_papers_formulas_on_random_inputs(seed):
    rng = np.random.default_rng(seed)
    g0 = rng.normal(size=40)
    updates = rng.normal(size=(9, 40)) + 0.5 * g0
    agg, _ = fltrust(torch.tensor(updates, dtype=torch.float64), torch.tensor(g0))
    np.testing.assert_allclose(agg.numpy(), reference(updates, g0), rtol=1e-10)


def test_an_update_pointing_away_gets_weight_zero_and_scaling_buys_nothing():
    rng = np.random.default_rng(1)
    g0 = torch.tensor(rng.normal(size=30), dtype=torch.float32)
    honest = g0 + 0.3 * torch.tensor(rng.normal(size=(6, 30)), dtype=torch.float32)
    away = -50.0 * g0
    agg_with, trust = fltrust(torch.vstack([honest, away]), g0)
    agg_without, _ = fltrust(honest, g0)
    assert trust[-1] == 0 and torch.allclose(agg_with, agg_without)
    boosted = honest.clone()
    boosted[0] *= 1000.0
    assert torch.allclose(fltrust(boosted, g0)[0], agg_without, rtol=1e-4, atol=1e-6)


def test_every_update_pointing_away_skips_the_round():
    with pytest.raises(AggregationError, match="all trust scores are 0"):
        fltrust(torch.tensor([[-1.0, 0.0], [0.0, 1.0]]), torch.tensor([1.0, 0.0]))


def scenario(*extra):
    return quick_scenario(
        "federation.rounds=3", "federation.num_clients=8", "federation.clients_per_round=6",
        "attack.schedule.every=1", "attack.schedule.first=1", "aggregator={name: fltrust, root_size: 100}", *extra,
        base=QUICKSTART)


def test_real_rounds_record_trust_and_the_audit(tmp_path):
    sc = scenario()
    run = run_local(sc, tmp_path).path
    lines = [r for r in read_rounds(run) if r["round"] > 0]
    assert len(lines) == 3 and all(r["skipped"] is None for r in lines)
    for r in lines:
        trust = r["aggregator"]["per_row"]["trust"]
        assert sorted(int(c) for c in trust) == r["aggregated"]
        assert r["aggregator"]["server_update_norm"] > 0
        share = r["detection"].get("attacker_weight_share")
        weights = r["aggregator"]["per_row"]["weight"]
        assert share == pytest.approx(sum(w for c, w in weights.items() if int(c) in r["attackers"]))
    again = run_local(sc, tmp_path / "again").path
    assert without_times(read_rounds(run)) == without_times(read_rounds(again))  # the server's training is seeded


def test_the_servers_own_update_lowers_its_root_loss():
    sc = scenario()
    rt = runtime_for(sc)
    from fedsim.server.tools import ServerTools

    def model_of(vec):
        m = rt.build_model()
        rt.layout.load_into(m, vec)
        return m

    tools = ServerTools(rt, model_of)
    x, y = tools.server_data(100, "train")
    w0 = rt.initial_weights()
    delta = tools.train_update(w0, rt.layout, x, y, 1)

    def loss(vec):
        with torch.no_grad():
            return torch.nn.functional.cross_entropy(model_of(vec)(torch.from_numpy(x)), torch.from_numpy(y)).item()

    assert loss(w0 + delta) < loss(w0)
    assert torch.equal(delta, tools.train_update(w0, rt.layout, x, y, 1))


def test_a_test_split_root_is_left_out_of_the_evaluation():
    sc = scenario("aggregator={name: fltrust, root_size: 50, root_source: test}")
    rt = runtime_for(sc)
    assert len(CentralEvaluator(rt).y) == len(rt.data.y_test) - 50


def test_preflight_refuses_a_root_larger_than_its_split():
    sc = scenario("aggregator={name: fltrust, root_size: 100000, root_source: test}")
    with pytest.raises(ScenarioError, match="aggregator.root_size"):
        preflight(sc)
