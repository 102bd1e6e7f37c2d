"""FedGame: Neural Cleanse on a tiny net with a planted backdoor recovers its target; genuine scores
by hand; a backdoored local model gets the lowest weight in a round; a real digits run."""

from __future__ import annotations

import types

import pytest
import torch
from pydantic import ValidationError
from sklearn.datasets import load_digits
from torch import nn

from conftest import quick_scenario, round_context, run_local, update_batch
from fedsim.defenses.fedgame import FedGame, FedGameParams, backdoor_success, reverse_engineer, stamp
from fedsim.models.layout import ModelLayout
from fedsim.registry import DEFENSES

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def digits():
    d = load_digits()
    return torch.tensor(d.data / 16.0, dtype=torch.float32).reshape(-1, 1, 8, 8), torch.tensor(d.target)


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


def trigger(x):
    x = x.clone()
    x[:, :, 6:8, 6:8] = 1.0
    return x


def train(model, x, y, epochs, poison_target=None, seed=1):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        perm = torch.randperm(len(y), generator=g)
        for s in range(0, len(y), 32):
            i = perm[s:s + 32]
            xb, yb = x[i], y[i]
            if poison_target is not None:  # half of each batch stamped and relabelled
                k = len(i) // 2
                xb = torch.cat([xb[k:], trigger(xb[:k])])
                yb = torch.cat([yb[k:], torch.full((k,), poison_target)])
            opt.zero_grad()
            nn.functional.cross_entropy(model(xb), yb).backward()
            opt.step()
    return model


def test_stamp_by_hand():
    x = torch.tensor([[[[1.0, 2.0], [3.0, 4.0]]]])  # [1, 1, 2, 2]
    mask = torch.tensor([[[0.0, 1.0], [0.5, 0.0]]])  # [K=1, 2, 2]
    pattern = torch.full((1, 1, 2, 2), 10.0)
    out = stamp(x, mask, pattern)
    assert out.shape == (1, 1, 1, 2, 2)
    assert out[0, 0, 0].tolist() == [[1.0, 10.0], [6.5, 4.0]]


def test_reverse_engineering_recovers_the_planted_target():
    x, y = digits()
    bad = train(net(), x[:1200], y[:1200], epochs=8, poison_target=3)
    masks, patterns, norms = reverse_engineer(bad, x[1400:1600], 10, torch.Generator().manual_seed(0),
                                              epochs=60, lr=0.005, lam=0.01, patience=30, batch_size=64)
    assert int(norms.argmin()) == 3
    assert backdoor_success(bad, x[1400:1600], masks[3], patterns[3], 3) > 0.9
    assert masks.min() >= 0 and masks.max() <= 1
    assert all(p.requires_grad is False for p in bad.parameters())  # the model is probed, not trained


def test_backdoor_success_by_hand():
    # a model that predicts class 1 exactly when pixel (0, 0) exceeds 0.5: a full mask on that pixel
    # with pattern 1 sends every input there; without the mask, only those already above 0.5
    class Probe(nn.Module):
        def forward(self, x):
            hit = (x[:, 0, 0, 0] > 0.5).float()
            return torch.stack([1 - hit, hit], dim=1)

    x = torch.tensor([0.1, 0.9, 0.2, 0.3]).reshape(4, 1, 1, 1).expand(4, 1, 2, 2).clone()
    on = torch.zeros(2, 2)
    on[0, 0] = 1.0
    assert backdoor_success(Probe(), x, on, torch.ones(1, 2, 2), 1) == 1.0
    assert backdoor_success(Probe(), x, torch.zeros(2, 2), torch.ones(1, 2, 2), 1) == 0.25


class Tools:
    """ServerTools' stand-in: a net's model_of, the server's data, the class count."""

    def __init__(self, x, y):
        self.layout = ModelLayout.of(net())
        self.num_classes, self.input_shape = 10, (1, 8, 8)
        self._x, self._y = x.numpy(), y.numpy()
        self.rt = types.SimpleNamespace(data=types.SimpleNamespace(y_train=self._y, y_test=self._y))

    def model_of(self, vec):
        model = net()
        self.layout.load_into(model, vec)
        return model

    def server_data(self, size, source):
        return self._x[:size], self._y[:size]


def test_a_backdoored_client_gets_the_lowest_weight():
    x, y = digits()
    tools = Tools(x[1400:1600], y[1400:1600])
    g = train(net(), x[:600], y[:600], epochs=3)
    gw = tools.layout.flatten_model(g)
    locals_ = [train(net_from(tools, gw), x[600 + 150 * i:750 + 150 * i], y[600 + 150 * i:750 + 150 * i], 3, seed=i)
               for i in range(3)]
    locals_.append(train(net_from(tools, gw), x[1050:1350], y[1050:1350], 8, poison_target=3, seed=9))
    updates = torch.stack([tools.layout.flatten_model(m) - gw for m in locals_])
    updates[3] *= 4  # model replacement (boosted by n): the undefended aggregate carries the backdoor
    params = FedGameParams(root_size=200, nc_epochs=60)
    batch = update_batch(updates, ids=[10, 11, 12, 13], weights=[150, 150, 150, 300])
    out, log = FedGame(params).before(batch, round_context(global_weights=gw, layout=tools.layout, tools=tools))
    assert log["target"] == 3
    scores = log["genuine_scores"]
    assert scores[13] < 0.2 < min(scores[c] for c in (10, 11, 12))
    # the rule gets the genuine scores as weights (example counts replaced), rows with score 0 left out
    kept = [c for c in (10, 11, 12, 13) if scores[c] > 0]
    assert list(out.client_ids) == kept and log["removed"] == [c for c in (10, 11, 12, 13) if scores[c] <= 0]
    assert torch.allclose(out.weights.double(), torch.tensor([scores[c] for c in kept], dtype=torch.float64))


def net_from(tools, vec):
    return tools.model_of(vec.clone())


def test_without_tools_the_batch_passes_with_a_note():
    batch = update_batch(n=4, d=6)
    out, log = FedGame(FedGameParams()).before(batch, round_context(6))
    assert out is batch and "note" in log


def test_registered_with_the_official_defaults_and_bad_values_name_the_field():
    entry = DEFENSES.get("fedgame")
    p = entry.params()
    assert (p.root_size, p.nc_epochs, p.nc_lr, p.nc_lambda, p.nc_patience, p.nc_batch_size) == (None, 100, 0.005, 0.01, 30, 64)
    with pytest.raises(ValidationError, match="nc_lr"):
        entry.params(nc_lr=0)


def test_a_rule_other_than_the_weighted_mean_is_refused():
    with pytest.raises(Exception, match="fedgame"):
        quick_scenario("aggregator=median", "defenses=[{name: fedgame, root_size: 50, nc_epochs: 2}]")


def test_digits_run_records_genuine_scores(tmp_path):
    scenario = quick_scenario(
        "aggregator=fedavg", "defenses=[{name: fedgame, root_size: 60, nc_epochs: 3}]",
        federation={"num_clients": 4, "clients_per_round": 3, "rounds": 1, "local_epochs": 1},
    )
    rounds = run_local(scenario, tmp_path).rounds
    info = rounds[0]["defenses"]["fedgame"]
    assert rounds[0]["skipped"] is None
    assert 0 <= info["target"] < 10 and len(info["mask_norms"]) == 10
    assert {int(c) for c in info["genuine_scores"]} == set(rounds[0]["sampled"])
    assert rounds[0]["detection"]["flagged"] == sorted(info["removed"])
