"""MARS: the Lipschitz upper bound of a tiny conv+BN layer and a Linear layer by hand, the top-u count
against numpy's quantile rule, the Wasserstein matrix against scipy, a backdoor-like round whose
high-energy models are removed, and a real digits run the detection audit reads."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import wasserstein_distance

from conftest import quick_scenario, round_context, run_local
from fedsim.defenses.mars import MARS, MARSParams, concentrated, neuron_energy, top_count, wasserstein_matrix
from fedsim.models.layout import ModelLayout
from fedsim.registry import DEFENSES
from fedsim.updates import UpdateBatch

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_lipschitz_bound_by_hand():
    # conv of 2 output channels, 2 input channels, 1x2 kernels: channel 0 [[3, 0], [0, 4]] (σ = 4),
    # channel 1 [[1, 1], [1, 1]] (σ = 2); BN γ = (0.5, -2), running var (3, 0)
    w = torch.tensor([[[[3.0, 0.0]], [[0.0, 4.0]]], [[[1.0, 1.0]], [[1.0, 1.0]]]])[None]
    scale = torch.tensor([[0.5 / np.sqrt(3 + 1e-5), -2 / np.sqrt(1e-5)]])
    be = neuron_energy(w, scale)
    np.testing.assert_allclose(be.numpy(), [[4 * 0.5 / np.sqrt(3 + 1e-5), 2 * 2 / np.sqrt(1e-5)]], rtol=1e-12)
    # Linear rows (3, 4) and (1, 0): σ_max of a row is its L2 norm
    np.testing.assert_allclose(neuron_energy(torch.tensor([[[3.0, 4.0], [1.0, 0.0]]])).numpy(), [[5.0, 1.0]])


@pytest.mark.parametrize("m", [1, 2, 7, 16, 20, 21, 64, 100])
def test_top_count_is_numpys_quantile_rule(m):
    x = np.random.default_rng(m).permutation(m).astype(float)
    assert top_count(m, 0.05) == int((x >= np.quantile(x, 0.95)).sum())
    got = concentrated(torch.tensor(x)[None], 0.05)[0].numpy()
    np.testing.assert_array_equal(got, x[x >= np.quantile(x, 0.95)])  # the official order: channel order


def test_wasserstein_matrix_matches_scipy():
    cbe = torch.rand(4, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    d = wasserstein_matrix(cbe).numpy()
    for i in range(4):
        for j in range(4):
            assert d[i, j] == pytest.approx(wasserstein_distance(cbe[i].numpy(), cbe[j].numpy()), abs=1e-12)


def mlp_round(n_bad: int = 3, seed: int = 0):
    """10 updates of a 6-20-4 MLP; the last n_bad blow up one hidden neuron's weight row (a trigger neuron)."""
    layout = ModelLayout(names=("0.weight", "0.bias", "2.weight", "2.bias"), shapes=((20, 6), (20,), (4, 20), (4,)))
    g = torch.Generator().manual_seed(seed)
    gw = 0.3 * torch.randn(layout.dim, generator=g)
    updates = 0.01 * torch.randn(10, layout.dim, generator=g)
    w = layout.slice("0.weight")
    for r in range(10 - n_bad, 10):
        block = updates[r, w].reshape(20, 6)
        block[5] += 3.0
        updates[r, w] = block.reshape(-1)
    return UpdateBatch(updates, torch.ones(10), tuple(range(10))), round_context(global_weights=gw, layout=layout)


def test_high_energy_models_are_removed_and_honest_kept():
    batch, ctx = mlp_round()
    out, log = MARS(MARSParams()).before(batch, ctx)
    assert log["removed"] == [7, 8, 9] and out.client_ids == tuple(range(7))
    assert log["center_distance"] > 0.03
    # no attacker: the two centres are within ε, nothing removed
    clean, ctx = mlp_round(n_bad=0)
    _, log = MARS(MARSParams()).before(clean, ctx)
    assert log["removed"] == []


def test_registered_with_official_defaults():
    p = DEFENSES.get("mars").params()
    assert (p.u, p.epsilon) == (0.05, 0.03)
    with pytest.raises(ValueError, match="u"):
        DEFENSES.get("mars").params(u=1.5)


def test_digits_run_audit_reads_mars_removals(tmp_path):
    scenario = quick_scenario(
        "aggregator=fedavg", "defenses=[{name: mars}]",
        "attack={name: sign_flip, num_attackers: 1, schedule: {name: every_round, attackers_per_round: 1}}",
        federation={"num_clients": 6, "clients_per_round": 5, "rounds": 1, "local_epochs": 1},
    )
    (r,) = run_local(scenario, tmp_path).rounds
    info, det = r["defenses"]["mars"], r["detection"]
    assert det["flagged"] == sorted(info["removed"])
    assert {int(c) for c in info["cbe_l1"]} == set(r["sampled"]) - set(r["rejected"])
    assert det["tp"] + det["fp"] == len(info["removed"])
