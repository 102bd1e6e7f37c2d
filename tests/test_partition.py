"""Partitions: every training row goes to exactly one client, sizes as configured, same seed same split."""

from __future__ import annotations

import numpy as np
import pytest

from fedsim.data.partition import DirichletParams, IidParams, ShardParams, dirichlet, iid, shard

LABELS = np.random.default_rng(0).integers(0, 10, size=2000)


def assert_disjoint_cover(parts, n):
    allidx = np.concatenate(parts)
    assert len(allidx) == len(np.unique(allidx))
    assert set(allidx.tolist()) <= set(range(n))


@pytest.mark.parametrize(
    "fn, params", [(iid, IidParams()), (dirichlet, DirichletParams(alpha=0.5)), (shard, ShardParams(num_shards_per_partition=2))]
)
def test_deterministic_and_disjoint(fn, params):
    a = fn(LABELS, 20, 3, params)
    b = fn(LABELS, 20, 3, params)
    c = fn(LABELS, 20, 4, params)
    assert len(a) == 20
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))
    assert_disjoint_cover(a, len(LABELS))


def test_iid_sizes_equal_and_cover_everything():
    parts = iid(LABELS, 8, 0, IidParams())
    assert [len(p) for p in parts] == [250] * 8


def test_dirichlet_min_size_and_skew():
    parts = dirichlet(LABELS, 20, 0, DirichletParams(alpha=0.2, min_partition_size=15))
    assert min(len(p) for p in parts) >= 15
    assert sum(len(p) for p in parts) == len(LABELS)
    # alpha = 0.2 is strongly skewed: most clients are dominated by few classes
    top_share = [np.bincount(LABELS[p], minlength=10).max() / len(p) for p in parts]
    assert np.median(top_share) > 0.4


def test_shard_clients_see_few_classes():
    parts = shard(np.sort(LABELS), 10, 0, ShardParams(num_shards_per_partition=2))
    assert max(len(np.unique(np.sort(LABELS)[p])) for p in parts) <= 4
