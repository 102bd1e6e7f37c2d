"""FLIP (defenses/flip.py): trigger inversion finds a planted backdoor's target and trigger, the
hardening stamps correctly labelled inputs, the triggers persist in the client's memory, the
server's confidence rejection counts as the official test does, and a tiny digits run."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from conftest import TAIL_ATTACK, quick_scenario, run_local
from fedsim.client.steps import HonestTraining, local_update
from fedsim.defenses.flip import (
    FLIPParams, confidence_accept, flip_inference, flip_train, inversion_set, invert_triggers, mask_shape, stamp,
)
from fedsim.models.layout import ModelLayout
from fedsim.runtime import Runtime
from fedsim.training import TrainConfig, train

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TARGET = 3


def planted_model(x: np.ndarray, y: np.ndarray, strength: float = 40.0) -> torch.nn.Module:
    """A logistic regression on digits, then a backdoor planted by hand: the corner pixel (always 0
    in digits) adds `strength` to class TARGET's logit."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    opt = torch.optim.Adam(net.parameters(), lr=0.05)
    for _ in range(150):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(xt), yt).backward()
        opt.step()
    with torch.no_grad():
        net[1].weight[TARGET, 0] += strength
    return net


@pytest.fixture(scope="module")
def digits():
    data = Runtime(quick_scenario()).data
    return np.asarray(data.x_train, np.float32), np.asarray(data.y_train, np.int64)


def test_inverted_trigger_points_to_the_planted_target(digits):
    x, y = digits
    assert (x[:, 0, 0, 0] == 0).all()
    net = planted_model(x, y)
    clean = (net(torch.from_numpy(x)).argmax(1).numpy() == y).mean()
    assert clean > 0.9
    pick = inversion_set(y, 3)
    assert len(pick) == 30 and sorted(np.bincount(y[pick]).tolist()) == [3] * 10
    out = invert_triggers(net, torch.from_numpy(x[pick]), torch.from_numpy(y[pick]), 10, FLIPParams(), 300,
                          torch.Generator().manual_seed(1))
    l1 = out["l1"]
    assert bool(out["found"][TARGET])
    assert int(torch.argmin(l1)) == TARGET  # the smallest trigger is the backdoor's
    others = torch.cat([l1[:TARGET], l1[TARGET + 1:]])
    assert float(l1[TARGET]) < 0.5 * float(others.min())
    mask = out["mask"][TARGET].flatten()
    assert int(mask.argmax()) == 0 and float(mask[0]) > 0.5 * float(mask.sum())  # it sits on the corner pixel
    # stamped with it, the other classes' inputs go to the target
    m, p = out["mask"][TARGET], out["pattern"][TARGET]
    rest = torch.from_numpy(x[y != TARGET])
    assert (net(stamp(rest, m, p, 0.0, 1.0)).argmax(1) == TARGET).float().mean() > 0.9
    assert tuple(out["mask"].shape) == (10, *mask_shape((1, 8, 8))) == (10, 1, 8, 8)


def test_stamp_keeps_the_data_range():
    x = torch.full((2, 1, 2, 2), 0.5)
    m = torch.tensor([[[1.0, 0.0], [0.5, 0.0]]])
    p = torch.ones(1, 2, 2)
    out = stamp(x, m, p, -1.0, 3.0)  # pattern 1 means the range's top, 3
    assert out[0, 0].tolist() == [[3.0, 0.5], [1.75, 0.5]]
    assert stamp(x, m, torch.full((1, 2, 2), 2.0), 0.0, 1.0).max() == 1.0  # clipped to the range


def test_confidence_rejection_by_hand():
    logits = torch.tensor([[2.0, 0.0], [0.1, 0.0], [0.0, 0.0]])
    probs = [1 / (1 + math.exp(-2.0)), 1 / (1 + math.exp(-0.1)), 0.5]  # 0.881, 0.525, 0.5
    assert confidence_accept(0.5)(logits).tolist() == [p >= 0.5 for p in probs] == [True, True, True]
    assert confidence_accept(0.6)(logits).tolist() == [True, False, False]
    model = torch.nn.Linear(2, 2)
    assert flip_inference(FLIPParams(confidence_threshold=0.0), model, None, 1) == (model, None)
    same, accept = flip_inference(FLIPParams(confidence_threshold=0.6), model, None, 1)
    assert same is model and accept(logits).tolist() == [True, False, False]


def test_client_round_inverts_hardens_and_remembers():
    scenario = quick_scenario(defenses=[{"name": "flip", "warmup_steps": 40, "steps": 10}])
    rt = Runtime(scenario)
    start = rt.initial_weights()
    memory: dict = {}
    first = local_update(rt, 0, start, 1, {}, memory)
    x, y = rt.client_data(0)
    per_class = len(inversion_set(y, 1))
    plain_samples = len(y) * scenario.federation.local_epochs
    assert first.stats["samples"] == plain_samples + 40 * 10 * per_class  # warm-up inversion counted as work
    assert set(memory) == {"flip.mask", "flip.pattern", "flip.found"}
    assert memory["flip.mask"].shape == (10, 1, 8, 8) and memory["flip.pattern"].shape == (10, 1, 8, 8)
    again = local_update(rt, 0, start, 2, {}, memory)
    assert again.stats["samples"] == plain_samples + 10 * 10 * per_class  # later rounds: `steps`, from memory
    repeat = local_update(rt, 0, start, 1, {}, {})  # the same round twice is the same update (seeded)
    assert torch.equal(repeat.delta, first.delta)


def test_hardening_unlearns_a_planted_backdoor(digits):
    """Plain training never touches the planted weight (the corner pixel is 0 in every clean input);
    FLIP's client finds the trigger and trains the weight down, so fewer stamped inputs reach the target."""
    x, y = digits
    rt = Runtime(quick_scenario())
    cfg = TrainConfig(epochs=3, batch_size=32, lr=0.1)

    def backdoor(net):
        rest = torch.from_numpy(x[y != TARGET].copy())
        rest[:, 0, 0, 0] = 1.0
        return float((net(rest).argmax(1) == TARGET).float().mean())

    runs = {}
    for name in ("plain", "flip"):
        net = planted_model(x, y, 10.0)
        layout = ModelLayout.of(net)
        start = layout.flatten_model(net)
        before = backdoor(net)
        assert before > 0.5
        if name == "plain":
            train(net, x, y, cfg, seed=5)
            stats = {}
        else:
            job = HonestTraining(rt, 0, 1, net, start, layout, cfg, 5, x, y, {})
            delta, stats = flip_train(FLIPParams(samples_per_class=3, warmup_steps=300), job)
            assert torch.equal(delta, layout.flatten_model(net) - start)
        with torch.no_grad():
            runs[name] = (backdoor(net), stats, (net(torch.from_numpy(x)).argmax(1).numpy() == y).mean(),
                          float(net[1].weight[TARGET, 0] - start[TARGET * 64]))
    assert runs["plain"][3] == 0.0 and abs(runs["plain"][0] - before) < 0.05  # clean training leaves the planted weight
    assert runs["flip"][1]["triggers_used"] >= 1
    assert runs["flip"][3] < -0.5  # FLIP trains it down
    assert runs["flip"][0] < runs["plain"][0] - 0.15 and runs["flip"][2] > 0.9  # fewer hits, the main task kept


def test_bad_parameters_name_the_field():
    with pytest.raises(ValueError, match="confidence_threshold"):
        FLIPParams(confidence_threshold=1.0)
    with pytest.raises(ValueError, match="portion"):
        FLIPParams(portion=0)


def test_digits_run_and_listed(tmp_path, capsys):
    from fedsim.cli import main

    attack = TAIL_ATTACK
    scenario = quick_scenario(attack=attack, defenses=[{"name": "flip", "warmup_steps": 20, "steps": 10,
                                                        "confidence_threshold": 0.2}])
    run = run_local(scenario, tmp_path)
    rounds = run.rounds
    assert [r["round"] for r in rounds] == [1, 2]
    for r in rounds:
        assert r["skipped"] is None and sorted(r["aggregated"]) == sorted(r["sampled"])  # honest replies arrived
        assert 0.0 <= r["main_accuracy"] <= 1.0 and r["defenses"]["flip"] == {}
        # what the deployed model refused to answer is recorded; a refused input is never correct
        assert set(r["inputs_rejected"]) == {"main", "backdoor"} and 0.0 <= r["inputs_rejected"]["main"] <= 1.0
        assert r["main_accuracy"] <= 1.0 - r["inputs_rejected"]["main"] + 1e-12
        assert r["backdoor_success"] <= 1.0 - r["inputs_rejected"]["backdoor"] + 1e-12
    from fedsim.runs.report import markdown_table

    table = markdown_table([run.path])
    assert "final inputs rejected %" in table and f"{100 * rounds[-1]['inputs_rejected']['main']:.1f}" in table
    main(["list", "defenses"])
    assert "flip" in capsys.readouterr().out


def test_runs_under_secure_aggregation_as_without_it(tmp_path):
    """FLIP's server part reads no individual update (its work is the clients' and the deployed
    model's), so secure aggregation admits it and changes only SecAgg+'s quantisation; Lockdown's
    server part reads every mask and is refused."""
    flip = [{"name": "flip", "warmup_steps": 20, "steps": 10, "confidence_threshold": 0.15}]  # rejects 14% then 81%
    runs = [run_local(quick_scenario(attack=TAIL_ATTACK, defenses=flip, **extra), tmp_path / name).rounds
            for name, extra in (("plain", {}), ("secure", {"secure_aggregation": {"name": "secaggplus"}}))]
    plain, secure = runs
    assert all("secure_aggregation" in r for r in secure) and not any("secure_aggregation" in r for r in plain)
    for a, b in zip(plain, secure):
        assert a["main_accuracy"] == pytest.approx(b["main_accuracy"], abs=0.02)
        assert 0 < a["inputs_rejected"]["main"] == pytest.approx(b["inputs_rejected"]["main"], abs=0.02)
    with pytest.raises(Exception, match="defense lockdown runs on the server over the individual updates"):
        quick_scenario(attack=None, defenses=[{"name": "lockdown"}], secure_aggregation={"name": "secaggplus"})
