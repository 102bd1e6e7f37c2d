"""The server's round pipeline (fedsim/server/pipeline.py) on plain tensors, and the rounds.jsonl
schema (fedsim/server/record.py): hand computations and properties, no Flower, no clients."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from fedsim.models.layout import ModelLayout
from fedsim.registry import ATTACKS
from fedsim.scenario import load_scenario
from fedsim.server.pipeline import RoundPipeline, update_norms
from fedsim.server.record import UNSET, RoundRecord
from fedsim.updates import RoundContext, UpdateBatch

ROOT = Path(__file__).resolve().parents[1]


def scenario(*overrides: str):
    return load_scenario(str(ROOT / "scenarios/quickstart.yaml"), ["attack=null", *overrides])


def ctx(d: int, rnd: int = 1) -> RoundContext:
    return RoundContext(rnd, torch.zeros(d), ModelLayout(names=("w",), shapes=((d,),)), torch.Generator().manual_seed(0))


def batch(rows, ids, weights) -> UpdateBatch:
    return UpdateBatch(torch.tensor(rows, dtype=torch.float32), torch.tensor(weights, dtype=torch.float32), tuple(ids))


def test_fedavg_is_the_example_weighted_mean_by_hand():
    pipe = RoundPipeline(scenario("aggregator=fedavg", "defenses=[]"))
    out = pipe.run(batch([[1.0, 0.0], [0.0, 3.0]], (4, 9), (1.0, 3.0)), set(), ctx(2))
    assert out.skipped is None and out.aggregated == [4, 9] and out.aggregator is None
    assert torch.allclose(out.aggregate, torch.tensor([0.25, 2.25]))  # (1*[1,0] + 3*[0,3]) / 4


def test_norm_clipping_then_fedavg_by_hand():
    pipe = RoundPipeline(scenario("aggregator=fedavg", "defenses=[{name: norm_clipping, delta: 1.0}]"))
    out = pipe.run(batch([[3.0, 4.0], [0.3, 0.4]], (0, 1), (1.0, 1.0)), set(), ctx(2))
    # [3, 4] (norm 5) is scaled to [0.6, 0.8]; [0.3, 0.4] (norm 0.5) stays
    assert torch.allclose(out.aggregate, torch.tensor([0.45, 0.6]))
    assert "norm_clipping" in out.defenses


def test_krum_reports_its_choice_by_client_id():
    pipe = RoundPipeline(scenario("aggregator={name: krum, num_malicious: 1}", "defenses=[]"))
    rows = [[0.0, 0.0], [0.1, 0.0], [0.0, 0.1], [0.1, 0.1], [50.0, 50.0]]
    out = pipe.run(batch(rows, (10, 11, 12, 13, 14), [1.0] * 5), set(), ctx(2))
    assert out.aggregator["selected"][0] in (10, 11, 12, 13) and 14 not in out.aggregator["selected"]
    assert torch.allclose(out.aggregate, torch.tensor(rows[out.aggregator["selected"][0] - 10]))


def test_a_rule_that_cannot_aggregate_skips_the_round_with_its_reason():
    pipe = RoundPipeline(scenario("aggregator={name: krum, num_malicious: 2}", "defenses=[]"))
    out = pipe.run(batch([[0.0], [1.0], [2.0]], (0, 1, 2), [1.0] * 3), set(), ctx(1))
    assert out.aggregate is None and "n >= 2f + 3" in out.skipped


def test_server_attack_replaces_only_the_strikers_rows():
    attack = ATTACKS.get("sign_flip").obj(ATTACKS.get("sign_flip").spec_model()(name="sign_flip", scale=2.0))
    pipe = RoundPipeline(scenario("aggregator=fedavg", "defenses=[]"), attack)
    honest = [[1.0, 2.0], [3.0, 4.0]]
    b = batch([*honest, [9.0, 9.0]], (0, 1, 2), [1.0] * 3)
    attacked = pipe.server_attack(b, {2}, ctx(2))
    assert torch.equal(attacked.updates[:2], b.updates[:2])
    assert torch.allclose(attacked.updates[2], torch.tensor([-4.0, -6.0]))  # -2 · mean(honest)
    out = pipe.run(b, {2}, ctx(2))
    assert torch.allclose(out.aggregate, torch.tensor([0.0, 0.0]))  # ([1,2] + [3,4] + [-4,-6]) / 3
    assert torch.equal(pipe.server_attack(b, set(), ctx(2)).updates, b.updates)  # no strikers this round


def test_update_norms_split_attackers_from_honest():
    b = batch([[3.0, 4.0], [0.0, 1.0], [0.0, 2.0], [6.0, 8.0]], (0, 1, 2, 3), [1.0] * 4)
    attackers, honest_median = update_norms(b, {0, 3})
    assert attackers == {0: 5.0, 3: 10.0} and honest_median == 1.5


def test_pipeline_imports_no_flower():
    text = (ROOT / "fedsim/server/pipeline.py").read_text() + (ROOT / "fedsim/server/record.py").read_text()
    assert not re.search(r"^\s*(from|import)\s+flwr", text, re.M)


# --- RoundRecord: the schema of rounds.jsonl ---------------------------------------------------------------


def test_round_record_leaves_out_unset_fields_and_keeps_nulls():
    rec = RoundRecord(3, [1, 2], [2])
    rec.skipped = None
    line = rec.to_json()
    assert line == {"round": 3, "sampled": [1, 2], "attackers": [2], "bytes_down": 0, "bytes_up": 0, "skipped": None}
    assert rec.global_norm is UNSET


def test_round_record_refuses_fields_outside_the_schema():
    rec = RoundRecord(1)
    rec.update({"main_accuracy": 0.5})
    with pytest.raises(KeyError, match="no field 'accuracy'"):
        rec.update({"accuracy": 0.5})


@pytest.mark.parametrize("golden", sorted((ROOT / "tests/golden").glob("*.json")), ids=lambda p: p.stem)
def test_every_recorded_line_fits_the_schema(golden):
    """The golden runs' lines (quickstart, robust, codec, low-rank, DETOX, FedMA, resume) use only schema fields."""
    for line in json.loads(golden.read_text()):
        rec = RoundRecord(line["round"])
        rec.update({k: v for k, v in line.items() if k != "round"})
        assert rec.to_json() == line


def test_a_server_attack_reports_its_choice_and_the_crafted_norms():
    """The round line gets what ALIE chose (z) and the norms of the updates it crafted, not of
    the attackers' own trained updates."""
    from fedsim.attacks.byzantine import ALIE, ALIEParams

    scenario = load_scenario("scenarios/quickstart.yaml", ["attack={name: alie, z: 1.5, num_attackers: 2}"])
    pipeline = RoundPipeline(scenario, ALIE(ALIEParams(z=1.5, num_attackers=2)))
    g = torch.Generator().manual_seed(0)
    updates = torch.randn(6, 20, generator=g)
    batch = UpdateBatch(updates, torch.ones(6), (0, 1, 2, 3, 4, 5))
    ctx = RoundContext(1, torch.zeros(20), None, torch.Generator().manual_seed(1))
    out = pipeline.run(batch, {1, 4}, ctx)
    honest = updates[[0, 2, 3, 5]].double()
    crafted = honest.mean(0) + 1.5 * honest.std(0)
    assert out.attack["z"] == 1.5
    assert set(out.attack["norms"]) == {1, 4}
    assert out.attack["norms"][1] == pytest.approx(float(crafted.norm()), rel=1e-5)
    quiet = pipeline.run(batch, set(), ctx)
    assert quiet.attack is None
