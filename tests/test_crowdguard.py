"""CrowdGuard: the relation features, the exit tests, the pruning and the server's vote clustering by
hand on constructed cases; a backdoored model among honest digits models is voted out; a real run."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits
from torch import nn

from conftest import quick_scenario, round_context, run_local, update_batch
from fedsim.defenses.crowdguard import (
    BENIGN, POISONED, CrowdGuard, CrowdGuardParams, has_poisoned, hidden_outputs, prune, relation_features,
    server_decision,
)
from fedsim.models.layout import ModelLayout
from fedsim.registry import DEFENSES

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_relation_features_by_hand():
    # 2 samples (labels 7, 7), 3 models, 1 layer; own model 0
    dist = torch.tensor([[[2.0], [4.0], [1.0]],
                         [[1.0], [3.0], [0.0]]], dtype=torch.float64)
    feats = relation_features(dist, np.array([7, 7]), own=0)
    # R = D / D_own: sample 0 -> [1, 2, 0.5], sample 1 -> [1, 3, 0]; mean [1, 2.5, 0.25]; minus 1 -> [0, 1.5, -0.75]
    assert np.allclose(feats[:, 0], [0.0, 1.5 ** 2, -(0.75 ** 2)])
    # a zero own distance gives relation 0 (the tutorial's rule), labels become separate blocks
    dist2 = torch.tensor([[[0.0], [5.0]], [[1.0], [2.0]]], dtype=torch.float64)
    feats2 = relation_features(dist2, np.array([1, 2]), own=0)
    assert feats2.shape == (2, 2) and np.allclose(feats2[1], [-1.0, 1.0])


def test_exit_criterion_fires_on_an_outlier_only():
    calm = np.linspace(-1, 1, 9)
    assert not has_poisoned(calm, 0.01, 5.5, 3.0)
    outlier = np.append(np.zeros(9) + np.linspace(-0.01, 0.01, 9), 50.0)
    assert has_poisoned(outlier, 0.01, 5.5, 3.0)


def test_pruning_removes_the_far_models_and_never_more_than_half():
    rng = np.random.default_rng(0)
    feats = rng.normal(0, 0.01, (9, 4))
    feats[[5, 7]] += 3.0  # two models behave unlike the rest
    assert prune(feats, own=0, p_value=0.01, whis=5.5, sigma=3.0) == {5, 7}
    # a split down the middle would prune more than ⌊(n-1)/2⌋: nothing is pruned beyond the limit
    half = np.vstack([np.zeros((4, 2)), np.full((4, 2), 5.0)]) + rng.normal(0, 0.01, (8, 2))
    assert len(prune(half, own=0, p_value=0.01, whis=5.5, sigma=3.0)) <= 3


def test_server_follows_the_majority_vote_vector():
    b, p = BENIGN, POISONED
    votes = np.array([
        [b, b, b, p, b],
        [b, b, b, p, b],
        [b, b, b, p, p],  # one validator also suspects model 4
        [b, b, b, b, b],  # the attacker votes everyone benign
        [b, b, b, p, b],
    ])
    assert server_decision(votes, 0.5).tolist() == [b, b, b, p, b]


def test_hidden_outputs_are_the_conv_and_linear_outputs():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Flatten(), nn.Linear(2 * 6 * 6, 4), nn.ReLU(), nn.Linear(4, 3))
    x = torch.rand(5, 1, 8, 8)
    outs = hidden_outputs(model, x)
    assert [o.shape for o in outs] == [(5, 72), (5, 4), (5, 3)]
    assert torch.allclose(outs[2].float(), model(x), atol=1e-6)


def digits():
    d = load_digits()
    return d.data.reshape(-1, 1, 8, 8).astype(np.float32) / 16.0, d.target


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


def train(model, x, y, epochs, poison_target=None, seed=0):
    x, y = torch.from_numpy(x), torch.from_numpy(y)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        perm = torch.randperm(len(y), generator=g)
        for s in range(0, len(y), 32):
            xb, yb = x[perm[s:s + 32]].clone(), y[perm[s:s + 32]].clone()
            if poison_target is not None:
                k = len(yb) // 2
                xb[:k, :, 6:8, 6:8] = 1.0
                yb[:k] = poison_target
            opt.zero_grad()
            nn.functional.cross_entropy(model(xb), yb).backward()
            opt.step()
    return model


class Tools:
    def __init__(self, parts):
        self.layout = ModelLayout.of(net())
        self.rt = types.SimpleNamespace(client_data=lambda pid: parts[pid])

    def model_of(self, vec):
        model = net()
        self.layout.load_into(model, vec)
        return model


def test_a_backdoored_model_is_voted_out_and_honest_ones_kept():
    x, y = digits()
    parts = {pid: (x[200 + 150 * pid:350 + 150 * pid], y[200 + 150 * pid:350 + 150 * pid]) for pid in range(7)}
    tools = Tools(parts)
    g = train(net(), x[:200], y[:200], 5)
    gw = tools.layout.flatten_model(g)
    rows = []
    for pid in range(7):
        m = tools.model_of(gw.clone())
        train(m, *parts[pid], 2, poison_target=0 if pid == 6 else None, seed=pid)
        rows.append(tools.layout.flatten_model(m) - gw)
    rows[6] *= 3  # boosted, as a replacement attacker does
    batch = update_batch(torch.stack(rows), ids=list(range(7)))
    out, log = CrowdGuard(CrowdGuardParams()).before(batch, round_context(global_weights=gw, layout=tools.layout, tools=tools))
    assert log["removed"] == [6]
    assert list(out.client_ids) == [0, 1, 2, 3, 4, 5]
    assert all(log["votes"][v][v] == BENIGN for v in range(7))  # nobody votes against itself


def test_without_tools_or_with_too_few_updates_the_batch_passes():
    batch = update_batch(n=4, d=6)
    assert "note" in CrowdGuard(CrowdGuardParams()).before(batch, round_context(6))[1]
    assert DEFENSES.get("crowdguard").params().round_problem(2)[0] == ""
    assert DEFENSES.get("crowdguard").params().round_problem(3) is None


def test_registered_with_the_official_defaults():
    p = DEFENSES.get("crowdguard").params()
    assert (p.p_value, p.whis, p.sigma, p.dbscan_eps, p.max_samples) == (0.01, 5.5, 3.0, 0.5, None)
    with pytest.raises(Exception, match="p_value"):
        DEFENSES.get("crowdguard").params(p_value=2)


def test_digits_run_records_votes(tmp_path):
    scenario = quick_scenario(
        "aggregator=fedavg", "defenses=[{name: crowdguard, max_samples: 60}]",
        "attack={name: sign_flip, num_attackers: 1, schedule: {name: every_round, attackers_per_round: 1}}",
        federation={"num_clients": 6, "clients_per_round": 5, "rounds": 1, "local_epochs": 1},
    )
    r = run_local(scenario, tmp_path).rounds[0]
    info = r["defenses"]["crowdguard"]
    assert r["skipped"] is None
    assert {int(v) for v in info["votes"]} == set(r["sampled"])
    assert r["detection"]["flagged"] == sorted(info["removed"])
