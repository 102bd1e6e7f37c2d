"""The on-disk cache of datasets and partitions returns exactly what a fresh computation returns,
and a changed data file or library version is a different entry."""

from __future__ import annotations

import numpy as np

from fedsim.diskcache import cached_arrays, folder_fingerprint
from fedsim.runtime import Runtime
from fedsim.scenario import validate_scenario


def test_cached_dataset_and_partitions_equal_fresh_ones(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDSIM_CACHE_DIR", str(tmp_path))
    scenario = validate_scenario({"federation": {"num_clients": 12}})
    first = Runtime(scenario)
    data, parts = first.data, first.partitions
    assert len(list(tmp_path.glob("dataset-*.npz"))) == 1 and len(list(tmp_path.glob("partition-*.npz"))) == 1
    again = Runtime(scenario)  # served from disk
    np.testing.assert_array_equal(again.data.x_train, data.x_train)
    np.testing.assert_array_equal(again.data.y_test, data.y_test)
    assert again.data.num_classes == 10 and all(np.array_equal(a, b) for a, b in zip(again.partitions, parts))
    monkeypatch.setenv("FEDSIM_CACHE", "0")
    fresh = Runtime(scenario)
    assert all(np.array_equal(a, b) for a, b in zip(fresh.partitions, parts))


def test_keys_follow_their_inputs(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDSIM_CACHE_DIR", str(tmp_path / "cache"))
    calls = []
    compute = lambda: calls.append(1) or {"a": np.arange(3)}  # noqa: E731
    cached_arrays("t", "k1", compute)
    cached_arrays("t", "k1", compute)
    cached_arrays("t", "k2", compute)
    assert len(calls) == 2
    data = tmp_path / "data"
    data.mkdir()
    (data / "mnist.npz").write_bytes(b"x")
    before = folder_fingerprint(data)
    (data / "mnist.npz").write_bytes(b"xy")
    assert folder_fingerprint(data) != before
