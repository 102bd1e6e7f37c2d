"""ALIE by colluding clients (attacks/alie_colluding.py): μ + z·σ of the attackers' own benign updates.

Oracles: each pool member's honest update as the ClientApp computes it for an honest client (the
same function, seed and data), and the paper's z_max; the attack validates and runs under secure
aggregation, where the server-side `alie` is refused.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

from conftest import quick_scenario, run_local
from fedsim.attacks.byzantine import alie_z_max
from fedsim.client.steps import local_update
from fedsim.runtime import Runtime
from fedsim.scenario import ScenarioError, load_scenario

ROOT = Path(__file__).resolve().parents[1]
POOL = [1, 4, 6]


def scenario(attack: dict | None, **federation):
    fed = {"num_clients": 8, "clients_per_round": 8, "lr": 0.1, "local_epochs": 1, **federation}
    return quick_scenario(seed=3, federation=fed, attack=attack)  # QUICK's digits and 16-unit MLP


def honest_updates(pids, rnd: int, global_vec: torch.Tensor) -> torch.Tensor:
    rt = Runtime(scenario(None))
    return torch.stack([local_update(rt, p, global_vec, rnd, {"server-round": rnd}).delta for p in pids]).double()


@pytest.mark.parametrize("z", [None, 0.7])
def test_every_colluder_sends_mu_plus_z_sigma_of_the_pools_honest_updates(z):
    rt = Runtime(scenario({"name": "alie_colluding", "attacker_ids": POOL, "z": z}))
    g = rt.initial_weights()
    rnd = 2
    benign = honest_updates(POOL, rnd, g)
    factor = alie_z_max(8, 3) if z is None else z
    want = benign.mean(0) + factor * benign.std(0, correction=1)
    sent = []
    for pid in (1, 6):
        out = local_update(rt, pid, g, rnd, {"server-round": rnd})
        assert torch.allclose(out.delta.double(), want, atol=1e-6, rtol=1e-5)
        assert out.num_examples == len(rt.client_data(pid)[0])  # reports its own example count
        sent.append(out)
    assert torch.equal(sent[0].delta, sent[1].delta)  # colluders agree bit for bit
    assert not torch.allclose(sent[0].delta.double(), benign.mean(0), atol=1e-4)  # it is not the benign mean


def test_population_std_when_asked():
    rt = Runtime(scenario({"name": "alie_colluding", "attacker_ids": POOL, "z": 1.0, "unbiased": False}))
    g = rt.initial_weights()
    benign = honest_updates(POOL, 1, g)
    out = local_update(rt, 4, g, 1, {"server-round": 1}).delta.double()
    assert torch.allclose(out, benign.mean(0) + benign.std(0, correction=0), atol=1e-6, rtol=1e-5)


def test_one_attacker_cannot_estimate_a_std():
    with pytest.raises(ScenarioError, match="needs at least 2 attackers, got 1"):
        scenario({"name": "alie_colluding", "num_attackers": 1})


def test_it_runs_under_secure_aggregation_where_the_server_side_alie_is_refused():
    base = ["federation.num_clients=6", "federation.clients_per_round=6", "federation.rounds=1",
            "federation.local_epochs=1", "secure_aggregation={name: secaggplus}"]
    with pytest.raises(ScenarioError, match="simulated on the server"):
        load_scenario(ROOT / "scenarios/quickstart.yaml", [*base, "attack={name: alie, num_attackers: 2}"])
    sc = load_scenario(ROOT / "scenarios/quickstart.yaml",
                       [*base, "attack={name: alie_colluding, attacker_ids: [0, 2], schedule: {name: fixed_pool}}"])
    line = [r for r in run_local(sc, tempfile.mkdtemp()).rounds if r["round"] == 1][0]
    assert not line.get("skipped"), line.get("skipped")
    assert sorted(line["attackers"]) == [0, 2]
    assert line["secure_aggregation"]
