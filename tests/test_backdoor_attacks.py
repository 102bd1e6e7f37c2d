"""Pixel-trigger backdoor, DBA and label flipping: exact masks and poisoned sets, the update scaling,
and short whole runs on digits through the in-process grid."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import quick_scenario, run_local

from fedsim.attacks.label_flip import LabelFlip, LabelFlipParams
from fedsim.attacks.trigger import DBAParams, DistributedBackdoor, TriggerBackdoor, TriggerParams, choose_poisoned, stamp, trigger_mask
from fedsim.data.base import ArrayDataset
from fedsim.runtime import Runtime
from fedsim.scenario import ScenarioError


def scenario(attack, seed=0, **federation):
    fed = {"num_clients": 8, "clients_per_round": 4, "rounds": 3, "local_epochs": 2, "batch_size": 16, "lr": 0.1, "momentum": 0.9}
    return quick_scenario(name="bd", seed=seed, model={"name": "mlp", "hidden": [64]},
                          federation={**fed, **federation}, attack=attack)  # QUICK's digits


def cells(mask):
    return set(zip(*np.nonzero(mask)))


# --------------------------------------------------------------------------- masks and stamping
@pytest.mark.parametrize(
    "pattern, size, location, expected",
    [
        ("square", 2, "bottom_right", {(2, 4), (2, 5), (3, 4), (3, 5)}),
        ("square", 2, "top_left", {(0, 0), (0, 1), (1, 0), (1, 1)}),
        ("plus", 3, "top_left", {(0, 1), (1, 0), (1, 1), (1, 2), (2, 1)}),
        ("plus", 3, "bottom_right", {(1, 4), (2, 3), (2, 4), (2, 5), (3, 4)}),
        ("bars", 3, "top_left", {(0, 0), (1, 0), (2, 0), (0, 2), (1, 2), (2, 2)}),
        ("bars", 3, "bottom_right", {(1, 3), (2, 3), (3, 3), (1, 5), (2, 5), (3, 5)}),
    ],
)
def test_trigger_mask_exact_pixels(pattern, size, location, expected):
    mask = trigger_mask((4, 6), pattern, size, location)  # not square: rows and columns cannot be swapped
    assert mask.shape == (4, 6) and mask.dtype == bool
    assert cells(mask) == expected


def test_trigger_mask_rejects_what_does_not_fit():
    with pytest.raises(ValueError, match="attack.size"):
        trigger_mask((4, 6), "square", 5, "top_left")
    with pytest.raises(ValueError, match="odd"):
        trigger_mask((8, 8), "plus", 2, "top_left")
    with pytest.raises(ValueError, match="odd"):
        TriggerParams(pattern="plus", size=2)


def test_stamp_changes_only_masked_pixels():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(5, 3, 4, 6)).astype(np.float32)
    before = x.copy()
    mask = trigger_mask((4, 6), "plus", 3, "bottom_right")
    per_channel = np.array([7.0, 8.0, 9.0], dtype=np.float32)
    out = stamp(x, mask, per_channel)
    assert out.dtype == np.float32 and out.shape == x.shape
    np.testing.assert_array_equal(x, before)  # a copy: the input is untouched
    np.testing.assert_array_equal(out[:, :, ~mask], x[:, :, ~mask])
    for c in range(3):
        assert (out[:, c][:, mask] == per_channel[c]).all()
    assert (stamp(x, mask, 2.5)[:, :, mask] == 2.5).all()


# --------------------------------------------------------------------------- trigger attack
def test_trigger_training_set_poisons_exact_share_deterministically():
    attack_spec = {"name": "trigger", "attacker_ids": [1], "size": 2, "poison_fraction": 0.3, "target_class": 4}
    rt = Runtime(scenario(attack_spec))
    attack = rt.attack
    idx = rt.partitions[1]
    x0, y0 = rt.data.x_train[idx], rt.data.y_train[idx]
    x, y = attack.training_set(rt, 1)
    rows = attack.poisoned_rows(rt, 1)
    assert len(x) == len(idx)  # its own partition, nothing more
    assert len(rows) == len(set(rows.tolist())) == round(0.3 * len(idx))
    clean = np.setdiff1d(np.arange(len(idx)), rows)
    mask = trigger_mask((8, 8), "square", 2, "bottom_right")
    np.testing.assert_array_equal(x[rows], stamp(x0[rows], mask, rt.data.x_train.max()))
    assert (x[rows][:, :, mask] == 1.0).all()  # digits are scaled to [0, 1]: white is 1
    assert (y[rows] == 4).all()
    np.testing.assert_array_equal(x[clean], x0[clean])
    np.testing.assert_array_equal(y[clean], y0[clean])
    rt2 = Runtime(scenario(attack_spec))  # a fresh process's view: same seed, same poisoned set
    x2, y2 = rt2.attack.training_set(rt2, 1)
    np.testing.assert_array_equal(x, x2)
    np.testing.assert_array_equal(y, y2)
    assert not np.array_equal(choose_poisoned(100, 0.3, 0, 1), choose_poisoned(100, 0.3, 1, 1))


def test_trigger_backdoor_test_set_is_stamped_non_targets():
    rt = Runtime(scenario({"name": "trigger", "size": 2, "target_class": 3, "value": 0.75, "location": "top_left"}))
    x, y = rt.attack.backdoor_test_set(rt)
    keep = rt.data.y_test != 3
    assert len(x) == keep.sum() and (y == 3).all() and y.dtype == np.int64
    np.testing.assert_array_equal(x, stamp(rt.data.x_test[keep], trigger_mask((8, 8), "square", 2, "top_left"), 0.75))


def test_trigger_target_must_be_a_class():
    rt = Runtime(scenario({"name": "trigger", "size": 2, "target_class": 10}))
    with pytest.raises(ValueError, match="target_class=10"):
        rt.attack.backdoor_test_set(rt)


def test_attacks_cache_through_the_runtime_once_per_key():
    """`Runtime.cached`: computed once per key; keys are tuples led by their owner's name."""
    rt = Runtime(scenario({"name": "trigger", "size": 2, "target_class": 3}))
    calls = []
    make = lambda: calls.append(1) or object()  # noqa: E731
    first = rt.cached(("test", 1), make)
    assert rt.cached(("test", 1), make) is first and len(calls) == 1
    assert rt.cached(("test", 2), make) is not first and len(calls) == 2
    for bad in ("test", (), (1, "test")):
        with pytest.raises(TypeError, match="tuple led by its owner"):
            rt.cached(bad, make)
    x, _ = rt.attack.training_set(rt, 1)
    assert rt.attack.training_set(rt, 1)[0] is x  # the poisoned set is made once
    assert all(isinstance(k, tuple) and isinstance(k[0], str) for k in rt.cache)


# --------------------------------------------------------------------------- DBA
def fake_runtime(attackers, h=28, w=28, n=120, seed=0):
    """A runtime-like object with random 28x28 images (DBA's default geometry is for MNIST)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 1, h, w)).astype(np.float32)
    y = rng.integers(0, 10, size=n).astype(np.int64)
    data = ArrayDataset("fake", x, y, x[:40].copy(), y[:40].copy(), num_classes=10)
    parts = np.array_split(rng.permutation(n), 10)
    rt = SimpleNamespace(data=data, partitions=parts, attackers=sorted(attackers), scenario=SimpleNamespace(seed=seed), cache={})
    rt.cached = lambda key, make: Runtime.cached(rt, key, make)  # the runtime's own memo
    return rt


def global_trigger(rows=(0, 3), cols=((0, 3), (6, 9)), shape=(28, 28)):
    mask = np.zeros(shape, dtype=bool)
    for r in rows:
        for lo, hi in cols:
            mask[r, lo : hi + 1] = True
    return mask


@pytest.mark.parametrize("num_pieces", [4, 2, 1])
def test_dba_pieces_are_disjoint_and_union_to_the_full_trigger(num_pieces):
    rt = fake_runtime([0, 1, 2, 3])
    pieces = DistributedBackdoor(DBAParams(num_pieces=num_pieces)).pieces(rt)
    assert pieces.shape == (num_pieces, 28, 28)
    assert pieces.sum(axis=0).max() == 1  # pairwise disjoint
    np.testing.assert_array_equal(pieces.any(axis=0), global_trigger())
    assert all(p.sum() == 16 // num_pieces for p in pieces)


def test_dba_default_piece_order():
    pieces = DistributedBackdoor(DBAParams()).pieces(fake_runtime([0]))
    expected = [(0, range(0, 4)), (0, range(6, 10)), (3, range(0, 4)), (3, range(6, 10))]
    for piece, (row, cols) in zip(pieces, expected):
        assert cells(piece) == {(row, c) for c in cols}


def test_dba_attacker_k_stamps_piece_k_mod_num_pieces():
    attackers = [1, 3, 4, 6, 8, 9]  # six attackers, four pieces: the 5th and 6th reuse pieces 0 and 1
    rt = fake_runtime(attackers)
    attack = DistributedBackdoor(DBAParams(num_attackers=6))
    pieces = attack.pieces(rt)
    white = rt.data.x_train.max()
    for k, pid in enumerate(attackers):
        idx = rt.partitions[pid]
        x, y = attack.training_set(rt, pid)
        rows = attack.poisoned_rows(rt, pid)
        assert len(rows) == round(0.3125 * len(idx)) and (y[rows] == 2).all()
        changed = (x != rt.data.x_train[idx]).any(axis=(0, 1))
        np.testing.assert_array_equal(changed, pieces[k % 4])
        assert (x[rows][:, :, pieces[k % 4]] == white).all()
    assert attack.report(rt)["piece_of_attacker"] == {1: 0, 3: 1, 4: 2, 6: 3, 8: 0, 9: 1}


def test_dba_test_set_uses_the_full_trigger():
    rt = fake_runtime([0, 1, 2, 3])
    x, y = DistributedBackdoor(DBAParams(offset=(2, 5))).backdoor_test_set(rt)
    keep = rt.data.y_test != 2
    full = global_trigger(rows=(2, 5), cols=((5, 8), (11, 14)))
    np.testing.assert_array_equal(x, stamp(rt.data.x_test[keep], full, rt.data.x_train.max()))
    assert (y == 2).all() and len(y) == keep.sum()


def test_dba_geometry_is_validated():
    rt = Runtime(scenario({"name": "dba"}))  # 8x8 digits: the MNIST bars (columns up to 9) do not fit
    with pytest.raises(ValueError, match="attack.bar_cols"):
        rt.attack.backdoor_test_set(rt)
    with pytest.raises(ValueError, match="attack.bar_rows"):
        DistributedBackdoor(DBAParams(bar_rows=[0, 9], bar_cols=[(0, 1)], num_pieces=2)).pieces(fake_runtime([0], h=8, w=8))
    with pytest.raises(ValueError, match="overlap"):
        DBAParams(bar_cols=[(0, 3), (3, 5)])
    with pytest.raises(ValueError, match="num_pieces"):
        DBAParams(num_pieces=5)
    small = Runtime(scenario({"name": "dba", "bar_cols": [[0, 1], [4, 5]]}))
    assert small.attack.test_mask(small).sum() == 8


# --------------------------------------------------------------------------- label flipping
def test_label_flip_all_maps_to_mirror_class():
    rt = Runtime(scenario({"name": "label_flip", "attacker_ids": [2]}))
    idx = rt.partitions[2]
    x, y = rt.attack.training_set(rt, 2)
    np.testing.assert_array_equal(x, rt.data.x_train[idx])
    np.testing.assert_array_equal(y, 9 - rt.data.y_train[idx])
    x_bd, y_bd = rt.attack.backdoor_test_set(rt)
    np.testing.assert_array_equal(x_bd, rt.data.x_test)
    np.testing.assert_array_equal(y_bd, 9 - rt.data.y_test)


def test_label_flip_targeted_changes_only_the_source():
    rt = Runtime(scenario({"name": "label_flip", "mode": "targeted", "source_class": 7, "target_class": 1, "attacker_ids": [2]}))
    y0 = rt.data.y_train[rt.partitions[2]]
    _, y = rt.attack.training_set(rt, 2)
    assert (y[y0 == 7] == 1).all()
    np.testing.assert_array_equal(y[y0 != 7], y0[y0 != 7])
    x_bd, y_bd = rt.attack.backdoor_test_set(rt)
    np.testing.assert_array_equal(x_bd, rt.data.x_test[rt.data.y_test == 7])
    assert (y_bd == 1).all()
    assert rt.attack.report(rt)["flipped_per_attacker"] == {2: int((y0 == 7).sum())}


def test_label_flip_classes_are_validated():
    with pytest.raises(ScenarioError, match="must differ"):
        scenario({"name": "label_flip", "mode": "targeted", "source_class": 3, "target_class": 3})
    rt = Runtime(scenario({"name": "label_flip", "mode": "targeted", "source_class": 12}))
    with pytest.raises(ValueError, match="attack.source_class=12"):
        rt.attack.backdoor_test_set(rt)


# --------------------------------------------------------------------------- update scaling
@pytest.mark.parametrize(
    "attack",
    [TriggerBackdoor(TriggerParams(scale="auto")), DistributedBackdoor(DBAParams()), LabelFlip(LabelFlipParams(scale="auto"))],
)
def test_auto_scale_is_the_inverse_fedavg_weight(attack):
    delta = torch.randn(50)
    out = attack.finish_update(delta, {"num_examples": 40, "round_total_examples": 250, "server-round": 1, "lr": 0.1})
    assert torch.equal(out, delta * (250 / 40))


def test_numeric_scale_multiplies_and_default_keeps_the_update():
    delta = torch.randn(50)
    info = {"num_examples": 40, "round_total_examples": 250}
    assert torch.equal(TriggerBackdoor(TriggerParams(scale=3.5)).finish_update(delta, info), delta * 3.5)
    assert torch.equal(TriggerBackdoor(TriggerParams()).finish_update(delta, info), delta)
    assert torch.equal(LabelFlip(LabelFlipParams()).finish_update(delta, info), delta)
    with pytest.raises(ValueError):
        TriggerParams(scale=0)
    with pytest.raises(ValueError):
        TriggerParams(scale="big")


# --------------------------------------------------------------------------- whole runs
def run(tmp_path, attack, seed=0):
    done = run_local(scenario(attack, seed), tmp_path)
    return done.rounds, done.summary


EVERY = {"name": "every_round"}


@pytest.mark.parametrize(
    "attack",
    [
        {"name": "trigger", "size": 2, "schedule": EVERY},
        {"name": "dba", "bar_cols": [[0, 1], [4, 5]], "schedule": EVERY},
        {"name": "label_flip", "schedule": EVERY},
        {"name": "label_flip", "mode": "targeted", "schedule": EVERY},
    ],
    ids=["trigger", "dba", "label_flip_all", "label_flip_targeted"],
)
def test_short_run_reports_backdoor_success_every_round(tmp_path, attack):
    rounds, summary = run(tmp_path, attack)
    assert [r["round"] for r in rounds] == [1, 2, 3]
    assert all(len(r["attackers"]) == 1 for r in rounds)
    assert all(0.0 <= r["backdoor_success"] <= 1.0 for r in rounds)
    assert summary["attack"]  # the attack's report reached summary.json


def test_trigger_with_model_replacement_beats_the_clean_baseline(tmp_path):
    attack = {"name": "trigger", "size": 2, "scale": "auto", "attacker_ids": [3]}
    attacked, _ = run(tmp_path / "attacked", {**attack, "schedule": EVERY})
    # the same scenario whose attacker never strikes: the clean model measured on the same trigger set
    clean, _ = run(tmp_path / "clean", {**attack, "schedule": {"name": "rounds", "rounds": [100]}})
    assert all(r["attackers"] == [3] for r in attacked) and all(r["attackers"] == [] for r in clean)
    baseline = max(r["backdoor_success"] for r in clean)
    assert baseline < 0.3
    assert attacked[-1]["backdoor_success"] > baseline + 0.4
