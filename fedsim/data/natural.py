"""The `natural` partitioner: clients are the data's own owners (writers, play roles, tweet authors).

Datasets with owners (femnist, shakespeare, sentiment140) carry each training example's owner id
in `ArrayDataset.groups`. With as many clients as owners, each client is one owner. With fewer
clients, the owners are dealt in a seeded random order (or in id order) into `num_partitions`
contiguous blocks whose sizes differ by at most one owner (the first `owners % clients` blocks
have one more), so a client holds every example of its owners and no owner is split. More
clients than owners is an error: some clients would have no data.

The split itself is flwr-datasets' NaturalIdPartitioner over a column holding each example's
client, so a client's rows are exactly what `load_partition(client)` gives.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np
from pydantic import Field

from fedsim.data.partition import _indices, flwr_partitioner
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
    sizes = [div + (i < mod) for i in range(num_clients)]
    out = np.empty(num_owners, dtype=np.int64)
    out[order] = np.repeat(np.arange(num_clients), sizes)
    return out


@PARTITIONERS.register("natural", NaturalParams, needs_groups=True)
def natural(
    labels: np.ndarray, num_partitions: int, seed: int, params: NaturalParams, groups: np.ndarray | None = None
) -> list[np.ndarray]:
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
    NaturalIdPartitioner = flwr_partitioner("NaturalIdPartitioner")
    import datasets  # flwr_partitioner has checked that it is installed

    client = client_of_owner(len(owners), num_partitions, seed, params.shuffle_owners)[rank.reshape(-1)]
    # arrow format: `ds[column]` is then a pyarrow array, which numpy converts at once; datasets 4's
    # default Column is converted row by row (65 s instead of 1 s for 700,000 FEMNIST-sized rows)
    ds = datasets.Dataset.from_dict({"client": client, "idx": np.arange(len(labels))}).with_format("arrow")
    return _indices(NaturalIdPartitioner(partition_by="client"), ds, num_partitions)
