"""The `natural` partitioner: clients are the data's own owners (writers, play roles, tweet authors).

Datasets with owners (femnist, shakespeare, sentiment140) carry each training example's owner id
in `ArrayDataset.groups`. With as many clients as owners, each client is one owner. With fewer
clients, the owners are dealt in a seeded random order (or in id order) into `num_partitions`
contiguous blocks whose sizes differ by at most one owner (the first `owners % clients` blocks
have one more), so a client holds every example of its owners and no owner is split. More
clients than owners is an error: some clients would have no data.

A client's rows are exactly what flwr-datasets' NaturalIdPartitioner over a column holding each
example's client gives for `load_partition(client)` (its rows in ascending order; client ids are
0..num_clients-1, its sorted natural ids), computed with one stable sort of that column instead of
its Python loop over the rows (tests/test_partition_indices.py compares the two).
"""

from __future__ import annotations

from typing import Iterable

import numpy as np
from pydantic import Field

from fedsim.data.partition import Partitions
from fedsim.registry import PARTITIONERS, Params


class NaturalParams(Params):
    shuffle_owners: bool = Field(
        True, description="deal owners to clients in a seeded random order; false: in owner-id order"
    )


def owner_ids(owners: Iterable[str]) -> np.ndarray:
    """Each example's owner name as its rank among the sorted distinct names (int64): the `groups` ids."""
    owners = list(owners)
    rank = {name: i for i, name in enumerate(sorted(set(owners)))}
    return np.fromiter((rank[name] for name in owners), dtype=np.int64, count=len(owners))


def client_of_owner(num_owners: int, num_clients: int, seed: int, shuffle: bool = True) -> np.ndarray:
    """The client of each owner (by its rank among the owner ids): contiguous near-equal blocks of
    a seeded permutation of the owners (of the id order without `shuffle`)."""
    order = np.random.default_rng(seed).permutation(num_owners) if shuffle else np.arange(num_owners)
    div, mod = divmod(num_owners, num_clients)
    sizes = np.full(num_clients, div, dtype=np.int64)
    sizes[:mod] += 1
    out = np.empty(num_owners, dtype=np.int64)
    out[order] = np.repeat(np.arange(num_clients), sizes)
    return out


@PARTITIONERS.register("natural", NaturalParams, needs_groups=True)
def natural(
    labels: np.ndarray, num_partitions: int, seed: int, params: NaturalParams, groups: np.ndarray | None = None
) -> Partitions:
    """One client per writer, role or author of the data, or whole ones grouped when fewer (NaturalIdPartitioner)."""
    if groups is None:
        raise ValueError(
            "partition 'natural' needs each training example's owner (ArrayDataset.groups); datasets that "
            "have one: femnist, shakespeare, sentiment140"
        )
    groups = np.asarray(groups)
    if groups.shape != (len(labels),):
        raise ValueError(f"partition 'natural': {groups.shape} owner ids for {len(labels)} training examples")
    owners, rank = np.unique(groups, return_inverse=True)
    if num_partitions > len(owners):
        raise ValueError(
            f"partition 'natural': {len(owners)} owners (writers) cannot fill {num_partitions} clients; "
            f"set federation.num_clients to at most {len(owners)}"
        )
    client = client_of_owner(len(owners), num_partitions, seed, params.shuffle_owners)[rank.reshape(-1)]
    return Partitions.from_owners(client, num_partitions)
