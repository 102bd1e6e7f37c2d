"""RLR, the robust learning rate (defenses/rlr.py), against independent oracles: hand computations
and numpy sign votes. With FreqFed in the round pipeline: test_freqfed.py."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import fedsim.defenses.rlr as rlr_mod
from conftest import round_context, update_batch
from fedsim.defenses.rlr import RLRParams, RobustLearningRate, sign_agreement
from fedsim.updates import RoundContext, UpdateBatch


def make_ctx(d: int, rnd: int = 1, seed: int = 0, global_weights: torch.Tensor | None = None, layout=None) -> RoundContext:
    """The shared round context, on a layout of a weight vector and a one-value bias unless given."""
    return round_context(d, rnd, seed, global_weights=global_weights, layout=layout, bias=True)


def make_batch(updates, ids=None, weights=None) -> UpdateBatch:
    """The shared update batch, each client with 10 examples unless given."""
    return update_batch(updates, ids, weights, weight=10.0)


def fedavg(batch: UpdateBatch) -> torch.Tensor:
    return (batch.weights / batch.weights.sum()) @ batch.updates


def test_rlr_by_hand_three_clients():
    # signs per coordinate: (+,+,+) (+,+,+) (+,-,+) (+,0,+)  ->  |sum| = 3, 3, 1, 2
    rows = [[1.0, 1.0, 2.0, 0.5], [2.0, 3.0, -1.0, 0.0], [3.0, 2.0, 4.0, 1.5]]
    batch = make_batch(rows, ids=(7, 8, 9), weights=[1.0, 1.0, 1.0])
    mean = torch.tensor([2.0, 2.0, 5.0 / 3.0, 2.0 / 3.0])

    rlr = RobustLearningRate(RLRParams(threshold=2))
    out, log = rlr.before(batch, make_ctx(4))
    assert out is batch and log == {}
    new, log = rlr.after(fedavg(out), make_ctx(4))
    torch.testing.assert_close(new, torch.tensor([2.0, 2.0, -5.0 / 3.0, 2.0 / 3.0]))  # only the split coordinate reversed
    assert log == {"flipped": 1, "flipped_fraction": 0.25}

    rlr3 = RobustLearningRate(RLRParams(threshold=3))  # the zero vote no longer reaches θ either
    rlr3.before(batch, make_ctx(4))
    new, log = rlr3.after(mean, make_ctx(4))
    torch.testing.assert_close(new, torch.tensor([2.0, 2.0, -5.0 / 3.0, -2.0 / 3.0]))
    assert log["flipped"] == 2
    json.dumps(log)


def test_rlr_threshold_zero_is_fedavg():
    g = torch.Generator().manual_seed(1)
    batch = make_batch(torch.randn(9, 300, generator=g), weights=torch.rand(9, generator=g) + 0.5)
    rlr = RobustLearningRate(RLRParams(threshold=0))
    out, _ = rlr.before(batch, make_ctx(300))
    agg = fedavg(out)
    new, log = rlr.after(agg, make_ctx(300))
    assert torch.equal(new, agg) and log["flipped"] == 0


@pytest.mark.parametrize("block", [None, 5, 7])  # 5, 7: the column blocks do not divide d
def test_sign_agreement_matches_numpy(monkeypatch, block):
    if block is not None:
        monkeypatch.setattr(rlr_mod, "_BLOCK_ELEMENTS", block)
    rng = np.random.default_rng(2)
    u = rng.normal(size=(7, 503)).astype(np.float32)
    u[rng.random(size=u.shape) < 0.2] = 0.0  # zeros cast no vote
    u[:, :50] = np.abs(u[:, :50])  # some unanimous coordinates
    expected = np.abs(np.sign(u).sum(axis=0))
    got = sign_agreement(torch.from_numpy(u))
    np.testing.assert_array_equal(got.numpy(), expected.astype(np.int64))

    for theta in (1, 3, 5, 7):
        rlr = RobustLearningRate(RLRParams(threshold=theta))
        rlr.before(make_batch(u), make_ctx(503))
        agg = torch.from_numpy(rng.normal(size=503).astype(np.float32))
        new, log = rlr.after(agg, make_ctx(503))
        lr = np.where(expected >= theta, 1.0, -1.0)
        np.testing.assert_array_equal(new.numpy(), agg.numpy() * lr)
        assert log["flipped"] == int((expected < theta).sum())


def test_rlr_reverses_a_lone_backdoor_coordinate_and_keeps_the_consensus():
    # 9 honest clients agree on coordinates 0..9 and are split on 10..19; one attacker pushes 10..19 hard
    rng = np.random.default_rng(3)
    split = np.where(np.arange(9)[:, None] < 5, 0.01, -0.01) * np.ones((1, 10))  # 5 honest up, 4 down
    honest = np.concatenate([np.abs(rng.normal(size=(9, 10))) + 0.1, split], axis=1)
    attacker = np.concatenate([np.zeros(10), np.full(10, 5.0)])[None, :]
    batch = make_batch(np.concatenate([honest, attacker]))
    rlr = RobustLearningRate(RLRParams(threshold=4))  # the official runner's θ for 10 agents
    rlr.before(batch, make_ctx(20))
    agg = fedavg(batch)
    new, log = rlr.after(agg, make_ctx(20))
    # votes on 10..19: 5 + 1 up, 4 down -> |2| < 4: reversed; on 0..9: 9 up (the attacker's 0 casts none)
    assert log["flipped"] == 10
    torch.testing.assert_close(new[:10], agg[:10])
    torch.testing.assert_close(new[10:], -agg[10:])
    assert (agg[10:] > 0).all() and (new[10:] < 0).all()


def test_rlr_is_round_local_and_notes_an_unreachable_threshold():
    rlr = RobustLearningRate(RLRParams(threshold=5))
    batch = make_batch([[1.0, -1.0], [2.0, -3.0]])
    _, log = rlr.before(batch, make_ctx(2, rnd=3))
    assert "note" in log
    new, out = rlr.after(torch.tensor([1.5, -2.0]), make_ctx(2, rnd=3))
    assert torch.equal(new, torch.tensor([-1.5, 2.0])) and out["flipped"] == 2
    with pytest.raises(RuntimeError):
        rlr.after(torch.zeros(2), make_ctx(2, rnd=3))  # used once
    rlr.before(batch, make_ctx(2, rnd=4))
    with pytest.raises(RuntimeError):
        rlr.after(torch.zeros(2), make_ctx(2, rnd=5))  # another round's vote
    assert rlr.state_dict() == {}
