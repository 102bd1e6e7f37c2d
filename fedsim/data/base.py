"""The in-memory form every dataset loader returns, and where data files are looked up."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DATA_DIR_ENV = "FEDSIM_DATA_DIR"


class DataFileError(FileNotFoundError):
    """A dataset file is missing or malformed; the message names the expected path and format."""


@dataclass(frozen=True)
class ArrayDataset:
    """Train/test arrays ready for a model: float32 inputs (normalised), int64 labels.

    Images are `[N, C, H, W]`; tabular inputs are `[N, F]`; text is int64 token indices `[N, L]`.
    Datasets without labels (edge-case image pools) carry `y_* = -1`. `groups` is, for datasets
    with natural owners (LEAF writers, play roles, tweet authors), the int64 owner id of each
    training example, which the `natural` partitioner splits by; None elsewhere.
    """

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    groups: np.ndarray | None = None

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])


def resolve_data_dir(explicit: str | os.PathLike | None) -> Path:
    """The scenario's `data.dir` if set, else `$FEDSIM_DATA_DIR`; an error names both when neither is."""
    if explicit:
        return Path(explicit).expanduser()
    env = os.environ.get(DATA_DIR_ENV)
    if env:
        return Path(env).expanduser()
    raise DataFileError(
        f"no data directory: set `data.dir` in the scenario or the environment variable {DATA_DIR_ENV}"
    )
