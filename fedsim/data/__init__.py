"""Datasets, partitions and edge-case sets; importing this registers the loaders and partitioners."""

from fedsim.data import digits, loaders, partition  # noqa: F401  (registers)
from fedsim.data.base import ArrayDataset, DataFileError, resolve_data_dir

__all__ = ["ArrayDataset", "DataFileError", "resolve_data_dir"]
