"""The fast partition path gives exactly what flwr-datasets gives partition by partition.

`_indices` reads flwr-datasets' all-at-once assignment instead of building one `datasets.Dataset`
per client (12 s -> under 2 s for 10,000 clients); a wrong shortcut would silently give clients
other data, so each partitioner is compared with `load_partition(i)` on a fresh partitioner.
"""

from __future__ import annotations

import numpy as np
import pytest
from flwr_datasets.partitioner import DirichletPartitioner, IidPartitioner, ShardPartitioner

from fedsim.data.partition import _indices, _indices_one_by_one, _label_dataset


def _labels(n: int = 997) -> np.ndarray:
    return np.random.default_rng(3).integers(0, 10, size=n)


def _one_by_one(make, ds, n):
    partitioner = make()
    partitioner.dataset = ds
    return _indices_one_by_one(partitioner, range(n))


@pytest.mark.parametrize("n", [1, 7, 50, 997])
def test_iid_fast_path_matches_flwr_datasets(n):
    ds = _label_dataset(_labels(), seed=5)  # shuffled, as fedsim's iid partitioner uses it
    fast = _indices(IidPartitioner(n), ds, n)
    slow = _one_by_one(lambda: IidPartitioner(n), ds, n)
    assert len(fast) == n and all(np.array_equal(a, b) for a, b in zip(fast, slow))


@pytest.mark.parametrize("n", [3, 40])
def test_dirichlet_fast_path_matches_flwr_datasets(n):
    ds = _label_dataset(_labels())

    def make():
        return DirichletPartitioner(n, partition_by="label", alpha=0.3, min_partition_size=2, shuffle=True, seed=11)

    fast = _indices(make(), ds, n)
    slow = _one_by_one(make, ds, n)
    assert len(fast) == n and all(np.array_equal(a, b) for a, b in zip(fast, slow))
    assert sorted(np.concatenate(fast).tolist()) == sorted(set(np.concatenate(fast).tolist()))  # disjoint


@pytest.mark.parametrize("n", [5, 30])
def test_shard_fast_path_matches_flwr_datasets(n):
    ds = _label_dataset(_labels())

    def make():
        return ShardPartitioner(n, partition_by="label", num_shards_per_partition=2, shuffle=True, seed=2)

    fast = _indices(make(), ds, n)
    slow = _one_by_one(make, ds, n)
    assert len(fast) == n and all(np.array_equal(a, b) for a, b in zip(fast, slow))


def test_unknown_partitioners_are_loaded_one_by_one():
    """A partitioner without the all-at-once assignment still gets its own answer per partition."""

    class Halves(IidPartitioner):  # not the IID class itself: no shortcut may assume its layout
        def load_partition(self, partition_id):
            return self.dataset.select(range(partition_id, len(self.dataset), self.num_partitions))

    ds = _label_dataset(_labels(101))
    parts = _indices(Halves(2), ds, 2)
    assert parts[0].tolist() == list(range(0, 101, 2)) and parts[1].tolist() == list(range(1, 101, 2))


# --- fedsim's own computation of flwr-datasets' partitioners (fedsim/data/partition.py) ---------
def _flwr_dirichlet(labels, n, seed, params):
    def make():
        return DirichletPartitioner(n, partition_by="label", alpha=params.alpha, min_partition_size=params.min_partition_size,
                                    self_balancing=params.self_balancing, shuffle=True, seed=seed)

    return _one_by_one(make, _label_dataset(labels), n)


@pytest.mark.parametrize("n, alpha, min_size, balancing", [
    (1, 0.5, 0, False), (7, 0.3, 2, False), (40, 0.3, 2, False), (40, 0.3, 2, True),
    (40, 0.5, 8, False), (20, 0.2, 15, False),  # the second and the eleventh draw hold: resampled as flwr-datasets does
    (300, 2.0, 0, True)])
def test_dirichlet_draws_what_flwr_datasets_draws(n, alpha, min_size, balancing):
    """Partition by partition the rows DirichletPartitioner gives (its own `load_partition` on a
    fresh partitioner), resampling and self-balancing included."""
    import warnings

    from fedsim.data.partition import DirichletParams, dirichlet

    labels = _labels()
    params = DirichletParams(alpha=alpha, min_partition_size=min_size, self_balancing=balancing)
    ours = dirichlet(labels, n, 11, params)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = _flwr_dirichlet(labels, n, 11, params)
    assert len(ours) == n and all(np.array_equal(a, b) for a, b in zip(ours, theirs))
    assert min(len(p) for p in ours) >= min_size


@pytest.mark.parametrize("n", [1, 7, 50, 997])
def test_iid_is_flwr_datasets_iid_over_the_seeded_shuffle(n):
    from fedsim.data.partition import IidParams, iid

    ours = iid(_labels(), n, 5, IidParams())
    theirs = _one_by_one(lambda: IidPartitioner(n), _label_dataset(_labels(), seed=5), n)
    assert len(ours) == n and all(np.array_equal(a, b) for a, b in zip(ours, theirs))


@pytest.mark.parametrize("owners, n, shuffle", [(37, 37, True), (37, 10, True), (37, 10, False), (200, 1, True)])
def test_natural_is_flwr_datasets_natural_id(owners, n, shuffle):
    """Each client's rows are NaturalIdPartitioner's over the column of each example's client."""
    import datasets
    from flwr_datasets.partitioner import NaturalIdPartitioner

    from fedsim.data.natural import NaturalParams, client_of_owner, natural

    rng = np.random.default_rng(8)
    groups = rng.permutation(np.arange(1000) % owners)  # every owner has examples
    ours = natural(_labels(1000), n, 4, NaturalParams(shuffle_owners=shuffle), groups=groups)
    _, rank = np.unique(groups, return_inverse=True)
    client = client_of_owner(owners, n, 4, shuffle)[rank]
    ds = datasets.Dataset.from_dict({"client": client, "idx": np.arange(1000)}).with_format("arrow")
    theirs = _one_by_one(lambda: NaturalIdPartitioner(partition_by="client"), ds, n)
    assert len(ours) == n and all(np.array_equal(a, b) for a, b in zip(ours, theirs))


def test_dirichlet_over_more_clients_than_rows():
    """1,000,000 clients over 997 rows: every row with exactly one client, most clients empty, the
    largest draw's clients holding rows; a min_partition_size that cannot hold is refused with the numbers."""
    from fedsim.data.partition import DirichletParams, Partitions, dirichlet

    labels = _labels()
    parts = dirichlet(labels, 1_000_000, 0, DirichletParams(alpha=0.5, min_partition_size=0))
    assert isinstance(parts, Partitions) and len(parts) == 1_000_000
    assert np.array_equal(np.sort(parts.indices), np.arange(len(labels)))  # a disjoint cover
    assert parts.sizes.sum() == len(labels) and (parts.sizes == 0).mean() > 0.99
    assert parts[999_999].dtype == np.int64 and len(parts[-1]) == parts.sizes[-1]
    with pytest.raises(ValueError, match=r"min_partition_size=1 for each of 1,000,000 clients needs 1,000,000 examples"):
        dirichlet(labels, 1_000_000, 0, DirichletParams(alpha=0.5, min_partition_size=1))


def test_partitions_are_views_of_one_index_array():
    """`Partitions` reads like the list of arrays it replaces: indexing (negative too), length,
    iteration, slices; views are read-only (a client cannot change another's rows)."""
    from fedsim.data.partition import Partitions

    parts = Partitions.of([np.array([4, 2]), np.array([], dtype=np.int64), np.array([7])])
    assert len(parts) == 3 and [p.tolist() for p in parts] == [[4, 2], [], [7]]
    assert parts[-1].tolist() == [7] and [p.tolist() for p in parts[1:]] == [[], [7]]
    assert np.shares_memory(parts[0], parts.indices) and not parts[0].flags.writeable
    with pytest.raises(IndexError):
        parts[3]
    owners = Partitions.from_owners(np.array([2, 0, 2, 1, 0]), 4)
    assert [p.tolist() for p in owners] == [[1, 4], [3], [0, 2], []]


def test_iid_dirichlet_and_natural_need_no_flwr_datasets(monkeypatch):
    """Computed with numpy alone: a device without flwr-datasets (or `datasets`) can compute them."""
    import sys

    from fedsim.data.natural import NaturalParams, natural
    from fedsim.data.partition import DirichletParams, IidParams, dirichlet, iid

    for module in ("flwr_datasets", "flwr_datasets.partitioner", "datasets"):
        monkeypatch.setitem(sys.modules, module, None)  # importing it fails
    labels = _labels(100)
    assert len(iid(labels, 5, 0, IidParams())) == 5 and len(dirichlet(labels, 5, 0, DirichletParams())) == 5
    assert len(natural(labels, 4, 0, NaturalParams(), groups=np.arange(100) % 7)) == 4
