"""Client partitions of the training rows, as one index array and a size per client.

`Partitions` holds every client's sorted row indices in one array with per-client offsets
(compressed sparse rows): a million clients cost two arrays, not a million numpy objects, and a
client's rows are a view taken when it is sampled. The same seed gives the same split on the
server and on every client.

`iid` and `dirichlet` are flwr-datasets' IidPartitioner and DirichletPartitioner computed with
numpy over the whole population at once, draw for draw: the same generator, the same draws in the
same order, the same cut points, so the clients get exactly the rows flwr-datasets gives them
(tests/test_partition_indices.py compares them partition by partition). flwr-datasets builds its
assignment with Python loops over the partitions (12 s for 10,000 Dirichlet clients, 4 s more to
read it back) and refuses more partitions than rows; here 1,000,000 clients take well under a second.

A Dirichlet split of n rows over N clients with N > n (a million clients over MNIST's 60,000)
gives most clients no row at all: each class's rows are cut at the cumulative Dirichlet shares,
and a client whose share of every class rounds to nothing holds nothing. That is allowed with
`min_partition_size: 0`: a client without data takes no step and uploads a zero update of weight
0 (fedsim/client/steps.py). A `min_partition_size` that N clients cannot all have
(N x min_partition_size > n) is refused at once, naming the numbers, instead of resampling.

`shard` and `natural` (fedsim/data/natural.py) use flwr-datasets' partitioners; flwr-datasets (with
`datasets`, pyarrow and pandas under it) is imported only when one of those is computed: a device
install leaves it out (deploy/device-requirements.txt) and trains on a partition cached by
fedsim/diskcache.py, or on its own data.
"""

from __future__ import annotations

import operator
import warnings
from collections.abc import Iterator, Sequence

import numpy as np
from pydantic import Field

from fedsim.registry import PARTITIONERS, Params


class Partitions(Sequence):
    """Client i's sorted row indices are `indices[offsets[i]:offsets[i + 1]]` (a read-only view).

    A sequence of index arrays: `parts[i]`, `len(parts)`, iteration, as the list it replaces."""

    def __init__(self, indices: np.ndarray, sizes: np.ndarray) -> None:
        self.indices = np.asarray(indices, dtype=np.int64)
        self.sizes = np.asarray(sizes, dtype=np.int64)
        self.offsets = np.zeros(len(self.sizes) + 1, dtype=np.int64)
        np.cumsum(self.sizes, out=self.offsets[1:])
        if self.offsets[-1] != len(self.indices):
            raise ValueError(f"partition sizes add up to {self.offsets[-1]}, not the {len(self.indices)} indices given")

    @classmethod
    def of(cls, parts) -> "Partitions":
        """`parts` as Partitions (a list of index arrays is concatenated once)."""
        if isinstance(parts, Partitions):
            return parts
        parts = [np.asarray(p, dtype=np.int64) for p in parts]
        indices = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        return cls(indices, np.array([len(p) for p in parts], dtype=np.int64))

    @classmethod
    def from_owners(cls, owner: np.ndarray, num_partitions: int) -> "Partitions":
        """Row r goes to client `owner[r]` (every owner in 0..num_partitions-1); each client's rows ascending."""
        owner = np.asarray(owner, dtype=np.int64)
        if owner.size and (owner.min() < 0 or owner.max() >= num_partitions):
            raise ValueError(f"owners must lie in 0..{num_partitions - 1}")
        return cls(np.argsort(owner, kind="stable"), np.bincount(owner, minlength=num_partitions))

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = operator.index(i)
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"partition {i} of {len(self)}")
        view = self.indices[self.offsets[i]:self.offsets[i + 1]]
        view.flags.writeable = False
        return view

    def __iter__(self) -> Iterator[np.ndarray]:
        return (self[i] for i in range(len(self)))


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
def iid(labels: np.ndarray, num_partitions: int, seed: int, params: IidParams) -> Partitions:
    """Uniform random split into equal parts (flwr-datasets IidPartitioner over a seeded shuffle)."""
    # `datasets.Dataset.shuffle(seed)` permutes the rows with default_rng(seed).permutation; the
    # IID partitioner cuts the shuffled rows into contiguous blocks (`Dataset.shard(contiguous=True)`)
    perm = np.random.default_rng(seed).permutation(len(labels))
    div, mod = divmod(len(labels), num_partitions)
    sizes = np.full(num_partitions, div, dtype=np.int64)
    sizes[:mod] += 1
    owner = np.empty(len(labels), dtype=np.int64)
    owner[perm] = np.repeat(np.arange(num_partitions), sizes)
    return Partitions.from_owners(owner, num_partitions)


@PARTITIONERS.register("dirichlet", DirichletParams)
def dirichlet(labels: np.ndarray, num_partitions: int, seed: int, params: DirichletParams) -> Partitions:
    """Label skew: class shares per client drawn from Dirichlet(alpha) (flwr-datasets DirichletPartitioner)."""
    labels = np.asarray(labels)
    n, minimum = len(labels), params.min_partition_size
    if num_partitions * minimum > n:
        raise ValueError(
            f"min_partition_size={minimum} for each of {num_partitions:,} clients needs {num_partitions * minimum:,} "
            f"examples, the training set has {n:,}; set data.partition.min_partition_size to at most "
            f"{n // num_partitions} (0 lets clients hold no example)")
    rng = np.random.default_rng(seed=seed)  # DirichletPartitioner's generator
    alpha = np.full(num_partitions, float(params.alpha))
    average = n / num_partitions  # self-balancing's bar
    rows_of = [np.flatnonzero(labels == k) for k in np.unique(labels)]  # classes in sorted order
    for attempt in range(11):  # DirichletPartitioner samples at most 11 times, then gives up
        owner = np.empty(n, dtype=np.int64)
        counts = np.zeros(num_partitions, dtype=np.int64)
        for rows in rows_of:
            shares = rng.dirichlet(alpha)
            if params.self_balancing:  # no more of this class for a client already above the average
                shares = np.where(counts > average, 0.0, shares)
                shares = shares / np.cumsum(shares)[-1]  # the sum added left to right, as Python's sum
            cuts = (np.cumsum(shares) * len(rows)).astype(int)[:-1]  # np.split's cut points
            # position j of the class's rows falls in piece i when cuts[i-1] <= j < cuts[i]
            piece = np.searchsorted(cuts, np.arange(len(rows)), side="right")
            owner[rows] = piece
            counts += np.bincount(piece, minlength=num_partitions)
        if counts.min() >= minimum:
            break
    else:
        raise ValueError(f"no Dirichlet(alpha={params.alpha}) draw in 11 gave every client min_partition_size="
                         f"{minimum} examples; lower it or raise alpha")
    # DirichletPartitioner then shuffles each client's rows; fedsim sorts them (the order never mattered)
    return Partitions.from_owners(owner, num_partitions)


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
