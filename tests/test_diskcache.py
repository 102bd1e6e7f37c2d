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
    assert len(list(tmp_path.glob("dataset-*"))) == 1 and len(list(tmp_path.glob("partition-*"))) == 1
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


def test_large_arrays_come_back_memory_mapped_read_only(tmp_path, monkeypatch):
    """Above MMAP_BYTES an array is mapped, not read: equal to the fresh one, read-only, and usable
    everywhere the runtime uses it (client data, evaluation) without torch's non-writable warning."""
    import warnings

    import fedsim.diskcache as diskcache
    from fedsim.server.evaluation import CentralEvaluator

    monkeypatch.setenv("FEDSIM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(diskcache, "MMAP_BYTES", 100_000)  # digits' x_train (1437 x 64 float32) is 368 KB
    scenario = validate_scenario({"federation": {"num_clients": 12}})
    fresh = Runtime(scenario).data
    cached = Runtime(scenario)
    x = cached.data.x_train
    assert isinstance(x, np.memmap) and not x.flags.writeable
    assert not isinstance(cached.data.y_train, np.memmap)  # small: read into memory
    np.testing.assert_array_equal(x, fresh.x_train)
    monkeypatch.setattr(diskcache, "MMAP_BYTES", 1)  # the test set mapped too
    mapped = Runtime(scenario)
    assert isinstance(mapped.data.x_test, np.memmap)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        xc, _ = mapped.client_data(0)
        assert xc.flags.writeable
        model = mapped.build_model()
        assert CentralEvaluator(mapped)(model) == CentralEvaluator(Runtime(scenario))(model)


def test_a_package_without_metadata_does_not_stop_the_cache_key(monkeypatch):
    """A device running fedsim from a copied folder has no `fedsim` metadata (issue #21): the
    version in the cache key is then "unknown" instead of an error in every train."""
    import importlib.metadata as metadata

    from fedsim.runtime import versions

    real = metadata.version

    def without_fedsim(package):
        if package == "fedsim":
            raise metadata.PackageNotFoundError(package)
        return real(package)

    monkeypatch.setattr(metadata, "version", without_fedsim)
    versions.cache_clear()  # asked once per process: ask again under the patch
    try:
        got = versions()
    finally:
        versions.cache_clear()  # the next caller reads the real metadata
    assert got[0] == "unknown" and got[3] == real("numpy")

