"""Client partitions, computed with flwr-datasets' partitioners on the training labels.

The partitioners run offline on an in-memory `datasets.Dataset` holding only the labels and the
row index, so a partition is a list of row indices into the training arrays. The same seed gives
the same split on the server and on every client.

flwr-datasets (with `datasets`, pyarrow and pandas under it) is imported only when a partition is
computed: a device install leaves it out (deploy/device-requirements.txt) and trains on a
partition cached by fedsim/diskcache.py, or on its own data.
"""

from __future__ import annotations

import warnings

import numpy as np
from pydantic import Field

from fedsim.registry import PARTITIONERS, Params


class IidParams(Params):
    pass


class DirichletParams(Params):
    alpha: float = Field(0.5, gt=0, description="Dirichlet concentration; smaller is more skewed")
    min_partition_size: int = Field(10, ge=0, description="resample until every client has at least this many")
    self_balancing: bool = Field(False, description="stop giving a class to clients above the average size")


class ShardParams(Params):
    num_shards_per_partition: int = Field(2, ge=1, description="label-sorted shards per client (McMahan et al.)")
    shard_size: int | None = Field(None, ge=1, description="rows per shard; default: as large as fits")


MISSING_FLWR_DATASETS = (
    "central partitions need flwr-datasets: pip install 'flwr-datasets>=0.6,<0.7', or give the node local-data"
)


def flwr_partitioner(name: str):
    """flwr-datasets' partitioner class `name`; on a device installed without flwr-datasets, an
    error that says what to install instead of a bare ModuleNotFoundError deep in a train message."""
    try:
        import datasets  # noqa: F401  (what _label_dataset builds on; flwr-datasets depends on it)
        from flwr_datasets import partitioner
    except ModuleNotFoundError as ex:
        raise ModuleNotFoundError(f"{MISSING_FLWR_DATASETS} (missing module {ex.name!r})", name=ex.name) from ex
    return getattr(partitioner, name)


def _label_dataset(labels: np.ndarray, seed: int | None = None):
    import datasets  # flwr_partitioner has checked that it is installed

    ds = datasets.Dataset.from_dict({"label": labels.astype(np.int64), "idx": np.arange(len(labels))})
    return ds.shuffle(seed=seed) if seed is not None else ds


def _indices(partitioner, ds, num_partitions: int) -> list[np.ndarray]:
    """Every partition's sorted row indices, exactly as `partitioner.load_partition(i)["idx"]` gives them.

    Loading partitions one by one builds a `datasets.Dataset` per client (about 1 ms each: 12 s for
    10,000 clients). flwr-datasets assigns all partitions at once on the first load, so after
    loading partition 0 the assignment is read directly: the Dirichlet and shard partitioners keep
    it as row positions per partition, and the IID partitioner cuts the (shuffled) rows into
    contiguous shards (`Dataset.shard(contiguous=True)`). Anything else is loaded one by one.
    """
    IidPartitioner = flwr_partitioner("IidPartitioner")

    partitioner.dataset = ds
    with warnings.catch_warnings():  # pyarrow deprecation noise from inside `datasets`
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", UserWarning)  # "min_partition_size not satisfied, resampling"
        first = np.asarray(partitioner.load_partition(0)["idx"], dtype=np.int64)
        rows = np.asarray(ds["idx"], dtype=np.int64)  # original index of each row of `ds` (after any shuffle)
        assigned = getattr(partitioner, "_partition_id_to_indices", None)
        if isinstance(assigned, dict) and sorted(assigned) == list(range(num_partitions)):
            parts = [rows[np.asarray(assigned[i], dtype=np.int64)] for i in range(num_partitions)]
        elif type(partitioner) is IidPartitioner:
            div, mod = divmod(len(rows), num_partitions)
            starts = [div * i + min(i, mod) for i in range(num_partitions + 1)]
            parts = [rows[starts[i] : starts[i + 1]] for i in range(num_partitions)]
        else:
            return [np.sort(first)] + _indices_one_by_one(partitioner, range(1, num_partitions))
        if not np.array_equal(np.sort(parts[0]), np.sort(first)):  # flwr-datasets changed its internals
            return [np.sort(first)] + _indices_one_by_one(partitioner, range(1, num_partitions))
        return [np.sort(p) for p in parts]


def _indices_one_by_one(partitioner, ids) -> list[np.ndarray]:
    return [np.sort(np.asarray(partitioner.load_partition(i)["idx"], dtype=np.int64)) for i in ids]


@PARTITIONERS.register("iid", IidParams)
def iid(labels: np.ndarray, num_partitions: int, seed: int, params: IidParams) -> list[np.ndarray]:
    """Uniform random split into equal parts (flwr-datasets IidPartitioner over a seeded shuffle)."""
    IidPartitioner = flwr_partitioner("IidPartitioner")

    return _indices(IidPartitioner(num_partitions), _label_dataset(labels, seed), num_partitions)


@PARTITIONERS.register("dirichlet", DirichletParams)
def dirichlet(labels: np.ndarray, num_partitions: int, seed: int, params: DirichletParams) -> list[np.ndarray]:
    """Label skew: class shares per client drawn from Dirichlet(alpha) (flwr-datasets DirichletPartitioner)."""
    DirichletPartitioner = flwr_partitioner("DirichletPartitioner")

    part = DirichletPartitioner(
        num_partitions,
        partition_by="label",
        alpha=params.alpha,
        min_partition_size=params.min_partition_size,
        self_balancing=params.self_balancing,
        shuffle=True,
        seed=seed,
    )
    return _indices(part, _label_dataset(labels), num_partitions)


@PARTITIONERS.register("shard", ShardParams)
def shard(labels: np.ndarray, num_partitions: int, seed: int, params: ShardParams) -> list[np.ndarray]:
    """Pathological non-IID: sort by label, cut into shards, deal shards to clients (flwr-datasets ShardPartitioner)."""
    ShardPartitioner = flwr_partitioner("ShardPartitioner")

    part = ShardPartitioner(
        num_partitions,
        partition_by="label",
        num_shards_per_partition=params.num_shards_per_partition,
        shard_size=params.shard_size,
        shuffle=True,
        seed=seed,
    )
    return _indices(part, _label_dataset(labels), num_partitions)
