"""scikit-learn's bundled 8x8 digits: the embedded dataset, so the quickstart needs no files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from pydantic import Field

from fedsim.data.base import ArrayDataset
from fedsim.registry import DATASETS, Params


class DigitsParams(Params):
    test_fraction: float = Field(0.25, gt=0, lt=1, description="share of the 1797 images held out for testing")
    split_seed: int = Field(0, description="seed of the fixed stratified train/test split")


@DATASETS.register("digits", DigitsParams, embedded=True)
def load_digits(data_dir: Path | None, params: DigitsParams) -> ArrayDataset:
    """scikit-learn's 8x8 handwritten digits (1797 images, bundled, offline), scaled to [0, 1]."""
    try:
        from sklearn.datasets import load_digits as sk_load
        from sklearn.model_selection import train_test_split
    except ModuleNotFoundError as err:  # a device install (deploy/device-requirements.txt) has no scikit-learn
        raise ModuleNotFoundError(
            f"the digits dataset ships with scikit-learn, which is not installed ({err.name} missing): "
            "pip install 'scikit-learn>=1.4', or give the node local-data (docs/local_data.md)") from err

    x, y = sk_load(return_X_y=True)
    x = (x / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
    y = y.astype(np.int64)
    x_tr, x_te, y_tr, y_te = train_test_split(
        x, y, test_size=params.test_fraction, random_state=params.split_seed, stratify=y
    )
    return ArrayDataset("digits", x_tr, y_tr, x_te, y_te, num_classes=10)
