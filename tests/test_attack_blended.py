"""The blended-injection backdoor (#20; Chen et al. 2017): the blend by hand and at its ends, the
seeded share of poisoned rows, the test set, a pattern file from the data directory, and a short
run on digits."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import quick_scenario, run_local

from fedsim.attacks.blended import blend
from fedsim.attacks.trigger import choose_poisoned
from fedsim.data.base import DataFileError
from fedsim.runtime import Runtime
from fedsim.scenario import ScenarioError


def scenario(attack, seed=0, data_dir=None, *overrides):
    """A small digits run (6 clients, 3 a round, 2 rounds of one epoch, batch 32, plain SGD at 0.1) with `attack`."""
    data = {"dataset": "digits", **({"dir": str(data_dir)} if data_dir else {})}
    return quick_scenario("name=nt", f"seed={seed}", "federation.batch_size=32", "federation.lr=0.1",
                          "federation.momentum=0.0", "federation.weight_decay=0.0", *overrides, data=data, attack=attack)


# --------------------------------------------------------------------------- blend
def test_blend_at_zero_and_one_gives_the_image_and_the_pattern_bit_for_bit():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(5, 3, 4, 6)).astype(np.float32)
    pattern = rng.normal(size=(3, 4, 6)).astype(np.float32)
    clean = blend(x, pattern, 0.0)
    assert clean.dtype == np.float32 and clean.tobytes() == x.tobytes()
    full = blend(x, pattern, 1.0)
    assert full.tobytes() == np.broadcast_to(pattern, x.shape).tobytes()
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        blend(x, pattern, 1.5)


def test_blend_by_hand_on_a_2x2_image():
    x = np.array([[[[0.0, 1.0], [0.5, 0.25]]]], dtype=np.float32)  # [1, 1, 2, 2]
    pattern = np.array([[[1.0, 0.0], [0.5, 1.0]]], dtype=np.float32)
    # 0.75 x + 0.25 k: 0.25, 0.75, 0.5, 0.1875 + 0.25
    np.testing.assert_array_equal(blend(x, pattern, 0.25), [[[[0.25, 0.75], [0.5, 0.4375]]]])


# --------------------------------------------------------------------------- blended attack
def test_blended_poisons_a_seeded_share_of_its_partition():
    attack = {"name": "blended", "attacker_ids": [1], "poison_fraction": 0.3, "target_class": 4, "alpha_train": 0.2}
    rt = Runtime(scenario(attack))
    idx = rt.partitions[1]
    x0, y0 = rt.data.x_train[idx], rt.data.y_train[idx]
    x, y = rt.attack.training_set(rt, 1)
    rows = choose_poisoned(len(idx), 0.3, 0, 1)
    np.testing.assert_array_equal(rt.attack.poisoned_rows(rt, 1), rows)
    assert len(rows) == round(0.3 * len(idx)) and len(x) == len(idx)
    pattern = rt.attack.pattern(rt).astype(np.float64)
    assert pattern.shape == (1, 8, 8) and 0.0 <= pattern.min() and pattern.max() <= 1.0  # digits lie in [0, 1]
    assert pattern.std() > 0.2  # uniform noise over [0, 1] (std 0.29), not a constant
    np.testing.assert_allclose(x[rows], 0.8 * x0[rows].astype(np.float64) + 0.2 * pattern, rtol=1e-6, atol=1e-7)
    assert (y[rows] == 4).all()
    clean = np.setdiff1d(np.arange(len(idx)), rows)
    np.testing.assert_array_equal(x[clean], x0[clean])
    np.testing.assert_array_equal(y[clean], y0[clean])
    again = Runtime(scenario(attack))  # another process's view: the same key and rows
    np.testing.assert_array_equal(again.attack.training_set(again, 1)[0], x)
    other = Runtime(scenario(attack, seed=1))
    assert not np.array_equal(other.attack.pattern(other), rt.attack.pattern(rt))


def test_blended_test_set_is_every_non_target_image_blended_with_alpha_test():
    rt = Runtime(scenario({"name": "blended", "target_class": 3, "alpha_train": 0.1, "alpha_test": 0.6}))
    x, y = rt.attack.backdoor_test_set(rt)
    keep = rt.data.y_test != 3
    assert len(x) == keep.sum() and (y == 3).all() and y.dtype == np.int64
    expected = 0.4 * rt.data.x_test[keep].astype(np.float64) + 0.6 * rt.attack.pattern(rt).astype(np.float64)
    np.testing.assert_allclose(x, expected, rtol=1e-6, atol=1e-7)


def test_blended_reads_a_pattern_file_from_the_data_directory(tmp_path):
    key = np.linspace(0, 1, 64, dtype=np.float32).reshape(8, 8)
    np.save(tmp_path / "kitty.npy", key)
    for path in ("kitty.npy", str(tmp_path / "kitty.npy")):  # relative to data.dir, or absolute
        rt = Runtime(scenario({"name": "blended", "pattern_file": path, "alpha_test": 1.0}, data_dir=tmp_path))
        x, _ = rt.attack.backdoor_test_set(rt)
        assert (x == key).all()  # α = 1: every test input is the key
    np.save(tmp_path / "wide.npy", np.zeros((8, 9), dtype=np.float32))
    rt = Runtime(scenario({"name": "blended", "pattern_file": "wide.npy"}, data_dir=tmp_path))
    with pytest.raises(ValueError, match=r"attack.pattern_file.*\[8, 9\]"):
        rt.attack.backdoor_test_set(rt)
    rt = Runtime(scenario({"name": "blended", "pattern_file": "nothere.npy"}, data_dir=tmp_path))
    with pytest.raises(DataFileError, match="nothere.npy"):
        rt.attack.backdoor_test_set(rt)


@pytest.mark.parametrize("field,value", [("alpha_train", 0), ("alpha_test", 1.5), ("poison_fraction", 0)])
def test_blended_bad_parameters_are_named(field, value):
    with pytest.raises(ScenarioError, match=f"attack.blended.{field}"):
        scenario({"name": "blended", field: value})


def test_short_run_on_digits(tmp_path):
    sc = scenario({"name": "blended", "schedule": {"name": "every_round"}}, 0, None, "federation.num_clients=5")
    run = run_local(sc, tmp_path)
    assert [r["round"] for r in run.rounds] == [1, 2]
    assert all(len(r["attackers"]) == 1 for r in run.rounds)
    assert all(0.0 <= r["backdoor_success"] <= 1.0 for r in run.rounds)
    assert run.summary["attack"]
