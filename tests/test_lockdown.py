"""Lockdown (defenses/lockdown.py): the masked average and the quorum by hand, ERK densities, the
pruning schedule and pruning/recovery by hand, a client's subspace training (its update's support
is its mask, the mask persists in its memory and keeps its size), the server's masks across
rounds and checkpoints, the refusals, and a tiny digits run."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from conftest import TAIL_ATTACK, quick_scenario, round_context, run_local, update_batch
from fedsim.client.steps import local_update
from fedsim.defenses.lockdown import (
    SUPPORT_MARK, Lockdown, LockdownParams, consensus, drop_ratio, initial_mask, layer_densities,
    lockdown_inference, mask_average, prune, quorum_count, regrow, shared_initial_mask, unpack,
)
from fedsim.models.layout import ModelLayout
from fedsim.runtime import Runtime
from fedsim.scenario import ScenarioError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LOCKDOWN = {"name": "lockdown", "quorum": 0.5}


def test_masked_average_by_hand():
    rows = torch.tensor([[1.0, 0.0, 2.0, 0.0],
                         [3.0, 4.0, 0.0, 0.0],
                         [0.0, 2.0, 0.0, 0.0]])
    # coordinate 0: clients 0, 1 hold it -> (1 + 3) / 2; 1: clients 1, 2 -> 3; 2: client 0 only -> 2; 3: nobody -> 0
    np.testing.assert_allclose(mask_average(rows).numpy(), [2.0, 3.0, 2.0, 0.0], rtol=1e-6)


def test_quorum_by_hand():
    assert consensus(torch.tensor([0, 1, 2, 3, 4]), 3).tolist() == [False, False, False, True, True]
    assert quorum_count(LockdownParams(), 40) == 25  # the official θ = 25 of 40
    assert quorum_count(LockdownParams(quorum=0.5), 6) == 3 and quorum_count(LockdownParams(quorum=0.01), 6) == 1


def test_erk_densities():
    shapes = [(16, 64), (16,), (10, 16), (10,)]
    dens = layer_densities(shapes, 0.5, "ERK")
    sizes = [math.prod(s) for s in shapes]
    assert sum(d * n for d, n in zip(dens, sizes)) == pytest.approx(0.5 * sum(sizes))  # the total density
    assert dens[1] == dens[3] == 1.0  # biases would exceed 1: dense
    assert dens[2] / dens[0] == pytest.approx((26 / 160) / (80 / 1024))  # ∝ (Σ shape) / (Π shape)
    assert layer_densities(shapes, 0.3, "uniform") == [0.3] * 4
    layout = ModelLayout(tuple("abcd"), tuple(shapes))
    mask = initial_mask(layout, LockdownParams(), seed=7)
    assert [int(mask[layout.slice(n)].sum()) for n in "abcd"] == [int(d * n) for d, n in zip(dens, sizes)]
    assert torch.equal(mask, initial_mask(layout, LockdownParams(), seed=7))  # every client draws the same


def test_drop_ratio_schedule():
    assert drop_ratio(0, 10, 1.0) == pytest.approx(1.0)
    assert drop_ratio(1, 10, 1.0) == pytest.approx(0.5 * (1 + math.cos(math.pi / 5)))
    assert drop_ratio(5, 10, 1.0) == pytest.approx(0.0, abs=1e-12)
    assert drop_ratio(6, 10, 1.0) == 0.0 and drop_ratio(2, 10, 0.5) == pytest.approx(0.25 * (1 + math.cos(2 * math.pi / 5)))


def test_prune_and_regrow_by_hand():
    layout = ModelLayout(("w", "b"), ((6,), (2,)))
    mask = torch.tensor([1, 1, 1, 1, 0, 0, 1, 0], dtype=torch.bool)
    weights = torch.tensor([0.5, -0.1, 2.0, 0.3, 9.0, 9.0, 1.0, 0.0])
    kept, counts = prune(mask, weights, layout, 0.5)
    # w holds 4: drop ⌈2⌉ of smallest |w| (0.1 and 0.3); b holds 1: drop ⌈0.5⌉ = 1
    assert counts == [2, 1] and kept.tolist() == [1, 0, 1, 0, 0, 0, 0, 0]
    gradient = torch.tensor([0.0, 5.0, 0.0, -1.0, 3.0, 0.2, 0.1, -4.0])
    grown = regrow(kept, counts, gradient, layout)
    assert grown.tolist() == [1, 1, 1, 0, 1, 0, 0, 1]  # w: |5| and |3| among the free; b: |-4|
    random = regrow(kept, counts, None, layout, torch.Generator().manual_seed(0))
    assert int(random[:6].sum()) == 4 and int(random[6:].sum()) == 1 and bool(random[0]) and bool(random[2])


def test_client_trains_its_subspace_and_remembers_its_mask():
    scenario = quick_scenario("federation.rounds=4", defenses=[LOCKDOWN])
    rt = Runtime(scenario)
    layout = rt.layout
    start = rt.initial_weights()
    memory: dict = {}
    first_mask = shared_initial_mask(rt, LockdownParams(**{k: v for k, v in LOCKDOWN.items() if k != "name"}), layout)
    first = local_update(rt, 0, start, 1, {}, memory)
    assert torch.equal(first.delta != 0, first_mask)  # the upload's support is the mask exactly
    mask_after_1 = unpack(memory["lockdown.mask"], layout.dim)
    sizes = [int(first_mask[layout.slice(n)].sum()) for n in layout.names]
    assert [int(mask_after_1[layout.slice(n)].sum()) for n in layout.names] == sizes  # each layer keeps its size
    assert not torch.equal(mask_after_1, first_mask)  # round 1 ≤ T/2: pruned and recovered
    second = local_update(rt, 0, start, 2, {}, memory)
    assert torch.equal(second.delta != 0, mask_after_1)  # round 2 trains the remembered mask
    mask_after_2 = unpack(memory["lockdown.mask"], layout.dim)
    local_update(rt, 0, start, 3, {}, memory)  # round 3 > T/2: no pruning
    assert torch.equal(unpack(memory["lockdown.mask"], layout.dim), mask_after_2)
    other: dict = {}
    local_update(rt, 1, start, 1, {}, other)
    assert not torch.equal(unpack(other["lockdown.mask"], layout.dim), mask_after_1)  # each client its own subspace


def test_a_mask_coordinate_that_did_not_move_is_still_sent():
    """A step too small to move any weight: every update is exactly 0, yet the support is the mask."""
    rt = Runtime(quick_scenario("federation.lr=1e-30", "federation.rounds=4", defenses=[LOCKDOWN]))
    start = rt.initial_weights()
    mask = shared_initial_mask(rt, LockdownParams(quorum=0.5), rt.layout)
    delta = local_update(rt, 0, start, 3, {}, {}).delta  # round 3 > T/2: no L1 term either
    assert torch.equal(delta != 0, mask) and bool((delta[mask] == SUPPORT_MARK).all())
    assert mask_average(delta[None]).abs().max() <= SUPPORT_MARK  # a negligible step on the server


def test_server_average_quorum_masks_and_checkpoint():
    rt = Runtime(quick_scenario(defenses=[LOCKDOWN]))
    tools = SimpleNamespace(rt=rt)
    fed = rt.scenario.federation  # 6 clients, θ = 3
    model = rt.build_model()
    layout = ModelLayout.of(model).trainable_only()
    d = layout.dim
    initial = shared_initial_mask(rt, LockdownParams(quorum=0.5), layout)
    defense = Lockdown(LockdownParams(quorum=0.5), federation=fed)
    gen = torch.Generator().manual_seed(0)
    masks = [torch.rand(d, generator=gen) < 0.5 for _ in range(3)]
    rows = torch.stack([m.float() * (i + 1) for i, m in enumerate(masks)])
    batch = update_batch(rows, ids=[0, 3, 4])
    ctx = round_context(global_weights=torch.zeros(d), layout=layout, tools=tools)
    out, log = defense.before(batch, ctx)
    assert out is batch and set(log["mask_density"]) == {0, 3, 4}
    aggregate, info = defense.after(torch.zeros(d), ctx)
    np.testing.assert_allclose(aggregate.numpy(), mask_average(rows).numpy())
    assert info == {"quorum": 3}
    # consensus fusion after round 1: three clients' masks as sent, three still on the initial mask
    count = sum(m.int() for m in masks) + 3 * initial.int()
    after_1 = defense.deployed_state()
    fused, accept = lockdown_inference(LockdownParams(quorum=0.5), model, rt, 1, after_1)
    assert accept is None
    flat = layout.flatten_model(model)
    assert torch.equal(layout.flatten_model(fused), flat * (count >= 3))
    assert torch.equal(layout.flatten_model(model), flat)  # the caller's model is left as it was
    # round 2: client 3 sends another mask; the sum follows
    new = torch.rand(d, generator=gen) < 0.2
    defense.before(update_batch(new.float()[None], ids=[3]), round_context(global_weights=torch.zeros(d), layout=layout,
                                                                             rnd=2, tools=tools))
    count2 = masks[0].int() + new.int() + masks[2].int() + 3 * initial.int()
    assert torch.equal(defense.mask_sum, masks[0].int() + new.int() + masks[2].int())
    after_2 = defense.deployed_state()
    assert after_2[1] == 3 and torch.equal(after_2[0], defense.mask_sum)
    assert torch.equal(layout.flatten_model(lockdown_inference(LockdownParams(quorum=0.5), model, rt, 2, after_2)[0]),
                       flat * (count2 >= 3))
    # a snapshot: round 1's state is what it was (an evaluation one round behind fuses by it)
    assert torch.equal(layout.flatten_model(lockdown_inference(LockdownParams(quorum=0.5), model, rt, 1, after_1)[0]),
                       flat * (count >= 3))
    # before any round every client holds its initial mask
    none_yet = lockdown_inference(LockdownParams(quorum=0.5), model, rt, 0, None)[0]
    assert torch.equal(layout.flatten_model(none_yet), flat * (6 * initial.int() >= 3))
    restored = Lockdown(LockdownParams(quorum=0.5), federation=fed)
    restored.load_state_dict(defense.state_dict())
    assert torch.equal(restored.mask_sum, defense.mask_sum) and sorted(restored.masks) == [0, 3, 4]
    with pytest.raises(RuntimeError, match="without before"):
        restored.after(torch.zeros(d), ctx)


@pytest.mark.parametrize("extra,field", [
    ({"aggregator": {"name": "krum"}}, "aggregator"),
    ({"compression": {"name": "topk", "fraction": 0.1}}, "compression"),
    ({"lowrank": {"name": "pufferfish"}}, "lowrank"),
])
def test_what_lockdown_cannot_run_with_is_refused(extra, field):
    with pytest.raises(ScenarioError) as err:
        quick_scenario(defenses=[LOCKDOWN], **extra)
    assert any(p[0] == field for p in err.value.problems), err.value.problems


def test_local_dp_is_refused():
    with pytest.raises(ScenarioError) as err:
        quick_scenario("federation.local_dp={clip: 1.0, noise_multiplier: 1.0}", defenses=[LOCKDOWN])
    assert any(p[0] == "federation.local_dp" for p in err.value.problems)


def test_bad_parameters_name_the_field():
    with pytest.raises(ValueError, match="dense_ratio"):
        LockdownParams(dense_ratio=0)
    with pytest.raises(ValueError, match="quorum"):
        LockdownParams(quorum=1.5)


def test_digits_run_and_listed(tmp_path, capsys):
    from fedsim.cli import main

    attack = TAIL_ATTACK
    scenario = quick_scenario("federation.rounds=3", attack=attack, defenses=[LOCKDOWN])
    rounds = run_local(scenario, tmp_path).rounds
    assert [r["round"] for r in rounds] == [1, 2, 3]
    dens = LockdownParams().dense_ratio
    for r in rounds:
        info = r["defenses"]["lockdown"]
        assert r["skipped"] is None and info["quorum"] == 3
        honest = [p for p in r["sampled"] if p not in r["attackers"]]
        assert honest and all(abs(info["mask_density"][str(p)] - dens) < 0.01 for p in honest)  # their subspaces arrived
        assert 0.0 <= r["main_accuracy"] <= 1.0
    main(["list", "defenses"])
    assert "lockdown" in capsys.readouterr().out
