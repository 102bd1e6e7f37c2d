"""FLShield: the bijective representatives' weights by hand, LIPC of one validator by a direct loop,
a constructed round (clients validating on their own partitions) whose poisoned update has the
worst class loss impact and is removed while the clipped rest goes on, the server-data variant,
and a real digits run."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from conftest import quick_scenario, round_context, run_local
from fedsim.defenses.flshield import FLShield, FLShieldParams, ensemble_weights, lipc_tensor, rejected_representatives
from fedsim.models.layout import ModelLayout
from fedsim.registry import DEFENSES
from fedsim.updates import UpdateBatch

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_ensemble_weights_by_hand():
    u = torch.tensor([[1.0, 0.0], [2.0, 0.0], [1.0, 1.0], [-1.0, 0.0]])
    w = ensemble_weights(u, 0.25)
    # row 0: cos (·, 1, 1/√2, -1), clip min(1, 1/||u_j||) = (·, 1/2, 1/√2, 1): raw (0, 1/2, 1/2, 0)
    np.testing.assert_allclose(w[0].numpy(), [0.75, 0.125, 0.125, 0.0], atol=1e-12)
    # row 3 (pointing away from all): no peer weight, the update itself
    np.testing.assert_allclose(w[3].numpy(), [0, 0, 0, 1.0], atol=1e-12)
    np.testing.assert_allclose(w.sum(dim=1).numpy(), 1.0)


def test_rejects_the_lower_half():
    assert rejected_representatives(torch.tensor([0.3, -1.0, 0.2, 0.5, 0.1])) == [1, 4]


class Tools:
    """ServerTools' stand-in: a 2-3 linear model, the runtime's data and partitions."""

    def __init__(self, n_clients=6, seed=0):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(600, 2, generator=g)
        y = torch.where(x[:, 0] > 0.6, 2, torch.where(x[:, 0] < -0.6, 0, 1))
        parts = np.array_split(np.arange(600), n_clients)
        self.rt = SimpleNamespace(data=SimpleNamespace(x_train=x.numpy(), y_train=y.numpy()), partitions=parts)
        self.layout = ModelLayout.of(nn.Linear(2, 3))
        self.input_shape, self.num_classes = (2,), 3

    def model_of(self, vec):
        m = nn.Linear(2, 3)
        self.layout.load_into(m, vec.float())
        return m

    def server_data(self, size, source):
        return self.rt.data.x_train[:size], self.rt.data.y_train[:size]

    def trained(self, w0, cid, steps=20, lr=0.5):
        idx = self.rt.partitions[cid]
        x, y = torch.from_numpy(self.rt.data.x_train[idx]), torch.from_numpy(self.rt.data.y_train[idx])
        m = self.model_of(w0)
        opt = torch.optim.SGD(m.parameters(), lr=lr)
        for _ in range(steps):
            opt.zero_grad()
            nn.functional.cross_entropy(m(x), y).backward()
            opt.step()
        return self.layout.flatten_model(m) - w0


def test_lipc_of_one_validator_by_a_direct_loop():
    tools = Tools()
    w0 = torch.zeros(tools.layout.dim)
    rep = tools.trained(w0, 0)[None]
    x, y = tools.rt.data.x_train[:50], tools.rt.data.y_train[:50]
    got = lipc_tensor(tools.model_of, w0, rep, [(x, y)], 3)[0, 0]
    for c in range(3):
        rows = np.flatnonzero(y == c)[:30]
        before = sum(nn.functional.cross_entropy(tools.model_of(w0)(torch.from_numpy(x[i:i + 1])), torch.tensor([c])).item() for i in rows)
        after = sum(nn.functional.cross_entropy(tools.model_of(w0 + rep[0])(torch.from_numpy(x[i:i + 1])), torch.tensor([c])).item() for i in rows)
        assert got[c] == pytest.approx((before - after) / len(rows), rel=1e-5)


def poisoned_round(tools):
    w0 = 0.1 * torch.randn(tools.layout.dim, generator=torch.Generator().manual_seed(3))
    rows = torch.stack([tools.trained(w0, c) for c in range(6)])
    rows[5] = -3.0 * rows[:5].mean(dim=0)  # poisoned: against the honest direction, scaled up
    batch = UpdateBatch(rows, torch.ones(6), tuple(range(6)))
    return batch, round_context(global_weights=w0, layout=tools.layout, tools=tools)


@pytest.mark.parametrize("validation", ["clients", "server"])
def test_poisoned_update_is_removed_and_the_rest_clipped(validation):
    tools = Tools()
    batch, ctx = poisoned_round(tools)
    out, log = FLShield(FLShieldParams(validation=validation, server_size=300)).before(batch, ctx)
    assert 5 in log["removed"] and len(log["removed"]) == 3  # ⌊6 / 2⌋ representatives rejected
    assert min(log["scores"], key=log["scores"].get) == 5
    norms = batch.updates.norm(dim=1).numpy()
    bound = np.median(norms)
    np.testing.assert_allclose(out.updates.norm(dim=1).numpy(), np.minimum(norms[list(out.client_ids)], bound), rtol=1e-5)


def test_non_bijective_clusters_below_ten_updates_are_singletons():
    tools = Tools()
    batch, ctx = poisoned_round(tools)
    _, log = FLShield(FLShieldParams(bijective=False)).before(batch, ctx)
    assert log["clusters"] == [[c] for c in range(6)] and 5 in log["removed"]


def test_registered_with_official_defaults():
    p = DEFENSES.get("flshield").params()
    assert p.bijective and p.contrib_adjustment == 0.25 and p.score == "min" and p.validation == "clients"
    with pytest.raises(ValueError, match="validation"):
        DEFENSES.get("flshield").params(validation="nobody")


def test_digits_run_audit_reads_flshield_removals(tmp_path):
    scenario = quick_scenario(
        "aggregator=fedavg", "defenses=[{name: flshield}]",
        "attack={name: sign_flip, num_attackers: 1, schedule: {name: every_round, attackers_per_round: 1}}",
        federation={"num_clients": 6, "clients_per_round": 5, "rounds": 1, "local_epochs": 1},
    )
    (r,) = run_local(scenario, tmp_path).rounds
    info, det = r["defenses"]["flshield"], r["detection"]
    assert det["flagged"] == sorted(info["removed"]) and len(info["removed"]) == 2  # ⌊5 / 2⌋
