"""BackdoorIndicator: the indicator set's labels, the per-label indicator accuracy by hand, planting
into the aggregate, a model that keeps the indicator flagged and one that lost it kept, a real run."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from torch import nn

from conftest import quick_scenario, round_context, run_local, update_batch
from fedsim.defenses.backdoor_indicator import (
    BackdoorIndicator, BackdoorIndicatorParams, indicator_accuracy, indicator_set, per_label_accuracy, plant,
)
from fedsim.models.layout import ModelLayout
from fedsim.registry import DEFENSES

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_indicator_set_is_seeded_and_its_labels_balanced():
    x, labels = indicator_set(5, 23, (1, 4, 4), 10)
    x2, labels2 = indicator_set(5, 23, (1, 4, 4), 10)
    assert torch.equal(x, x2) and torch.equal(labels, labels2)
    assert x.shape == (23, 1, 4, 4) and float(x.min()) >= 0 and float(x.max()) < 1
    assert sorted(torch.bincount(labels, minlength=10).tolist()) == [2] * 7 + [3] * 3


def test_indicator_set_from_a_dataset_draws_distinct_seeded_images():
    pool = np.arange(50 * 4, dtype=np.float32).reshape(50, 1, 2, 2)  # image i holds 4i..4i+3
    x, labels = indicator_set(5, 23, (1, 2, 2), 10, pool)
    x2, labels2 = indicator_set(5, 23, (1, 2, 2), 10, pool)
    assert torch.equal(x, x2) and torch.equal(labels, labels2) and x.shape == (23, 1, 2, 2)
    rows = (x[:, 0, 0, 0] / 4).long()
    assert len(set(rows.tolist())) == 23 and torch.equal(x, torch.from_numpy(pool[rows.numpy()]))
    assert sorted(torch.bincount(labels, minlength=10).tolist()) == [2] * 7 + [3] * 3
    with pytest.raises(ValueError, match="ood_source.*input shape"):
        indicator_set(5, 23, (1, 4, 4), 10, pool)
    with pytest.raises(ValueError, match="ood_size=60"):
        indicator_set(5, 60, (1, 2, 2), 10, pool)
    with pytest.raises(Exception, match="ood_source.*fashion_mnist"):
        BackdoorIndicatorParams(ood_source="imagenet")


class Probe(nn.Module):
    """Predicts the class stored in the input's first value (rounded), whatever the model weights."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1))

    def forward(self, x):
        return nn.functional.one_hot(x.flatten(1)[:, 0].round().long(), 3).float() + 0 * self.w


def test_per_label_accuracy_by_hand():
    labels = torch.tensor([0, 0, 1, 1, 1, 2])
    preds = torch.tensor([0, 1, 1, 1, 0, 0])  # label 0: 1/2, label 1: 2/3, label 2: 0/1
    x = preds.float().reshape(6, 1)
    acc = per_label_accuracy(Probe(), x, labels, 3)
    assert torch.allclose(acc, torch.tensor([0.5, 2 / 3, 0.0], dtype=torch.float64))
    assert indicator_accuracy(Probe(), x, labels, 3) == (pytest.approx(2 / 3), 1)
    # a label with no sample is NaN and never the maximum
    acc4 = per_label_accuracy(Probe(), x, labels, 4)
    assert torch.isnan(acc4[3])


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(16, 128), nn.ReLU(), nn.Linear(128, 4))


class Tools:
    def __init__(self):
        self.layout = ModelLayout.of(mlp())
        self.input_shape, self.num_classes = (1, 4, 4), 4
        self.rt = types.SimpleNamespace(scenario=types.SimpleNamespace(seed=3))

    def model_of(self, vec):
        model = mlp()
        self.layout.load_into(model, vec)
        return model


PLANT = dict(ood_size=24, lr=0.1, epochs=150, mu=0.0, milestones=[1000], batch_size=8)


def test_planting_makes_the_next_global_model_carry_the_indicator_and_detection_flags_who_keeps_it():
    tools = Tools()
    params = BackdoorIndicatorParams(**PLANT)
    defense = BackdoorIndicator(params)
    x, labels = defense._indicator(tools)
    # the starting global model: one that answers every indicator sample with the next label (an
    # untrained net sends all noise to one class, which scores 100% on that label: IA is a max over labels)
    start = mlp()
    plant(start, x, (labels + 1) % 4, params, seed=0)
    g = tools.layout.flatten_model(start)
    assert indicator_accuracy(tools.model_of(g), x, labels, 4)[0] < params.threshold  # nothing planted yet
    ctx = round_context(global_weights=g, layout=tools.layout, tools=tools)
    aggregate = 0.01 * torch.randn(tools.layout.dim, generator=torch.Generator().manual_seed(1))
    planted_delta, log = defense.after(aggregate, ctx)
    planted = g + planted_delta
    assert log["planted_indicator_accuracy"] >= params.threshold
    assert indicator_accuracy(tools.model_of(planted), x, labels, 4)[0] >= params.threshold
    # next round: relative to the planted broadcast, a model that kept it (Δ = 0) is flagged, one that
    # went back to the un-planted model is kept
    batch = update_batch(torch.stack([torch.zeros_like(g), g - planted]), ids=[4, 9])
    out, det = defense.before(batch, round_context(global_weights=planted, layout=tools.layout, tools=tools))
    assert det["removed"] == [4] and list(out.client_ids) == [9]
    assert det["indicator_accuracy"][4] >= params.threshold > det["indicator_accuracy"][9]


def test_without_a_planted_indicator_nothing_is_detected():
    tools = Tools()
    params = BackdoorIndicatorParams(**PLANT)
    start = mlp()
    x, labels = BackdoorIndicator(params)._indicator(tools)
    plant(start, x, (labels + 1) % 4, params, seed=0)
    g = tools.layout.flatten_model(start)
    batch = update_batch(torch.zeros(3, tools.layout.dim))
    out, log = BackdoorIndicator(params).before(
        batch, round_context(global_weights=g, layout=tools.layout, tools=tools))
    assert out is batch and "note" in log and "removed" not in log


def test_registered_with_the_official_defaults_and_a_server_optimizer_is_refused():
    p = DEFENSES.get("backdoor_indicator").params()
    assert (p.ood_size, p.batch_size, p.epochs, p.lr, p.momentum, p.weight_decay, p.mu, p.gamma, p.threshold) == (
        800, 64, 50, 0.0008, 0.9, 0.0005, 0.1, 0.8, 0.85)
    with pytest.raises(Exception, match="milestones"):
        DEFENSES.get("backdoor_indicator").params(milestones=[5, 3])
    with pytest.raises(Exception, match="backdoor_indicator"):
        quick_scenario("defenses=[{name: backdoor_indicator}]", "server.momentum=0.9")


@pytest.mark.parametrize("source", ["noise", "digits"])
def test_digits_run_plants_and_then_measures(tmp_path, source):
    scenario = quick_scenario(
        "aggregator=fedavg", f"defenses=[{{name: backdoor_indicator, ood_size: 40, epochs: 3, ood_source: {source}}}]",
        federation={"num_clients": 4, "clients_per_round": 3, "rounds": 2, "local_epochs": 1},
    )
    rounds = run_local(scenario, tmp_path).rounds
    assert [r["skipped"] for r in rounds] == [None, None]
    for r in rounds:
        info = r["defenses"]["backdoor_indicator"]
        assert "planted_indicator_accuracy" in info and info["planted_norm"] > 0
        if "removed" in info:  # measured on a round whose broadcast model carries the indicator
            assert {int(c) for c in info["indicator_accuracy"]} == set(r["sampled"])
            assert r["detection"]["flagged"] == sorted(info["removed"])
        else:
            assert "note" in info
