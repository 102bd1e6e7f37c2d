"""Datasets, partitions and edge-case sets; importing this registers the loaders and partitioners."""

from fedsim.data import digits, loaders, partition  # noqa: F401  (registers)
from fedsim.data import vision  # noqa: F401  (registers cifar100, emnist, tiny_imagenet)
from fedsim.data import leaf  # noqa: F401  (registers femnist, shakespeare)
from fedsim.data import text  # noqa: F401  (registers sentiment140)
from fedsim.data import natural  # noqa: F401  (registers the natural partitioner)
from fedsim.data.base import ArrayDataset, DataFileError, resolve_data_dir

__all__ = ["ArrayDataset", "DataFileError", "resolve_data_dir"]
