"""Shared fixtures: where the real datasets are, and small scenarios."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


def data_dir() -> Path | None:
    """FEDSIM_DATA_DIR if set, else ../shared/data when it exists."""
    env = os.environ.get("FEDSIM_DATA_DIR")
    if env and Path(env).is_dir():
        return Path(env)
    return SHARED_DATA if SHARED_DATA.is_dir() else None


@pytest.fixture
def real_data_dir() -> Path:
    path = data_dir()
    if path is None:
        pytest.skip("../shared/data not found; set FEDSIM_DATA_DIR to a folder with the datasets")
    return path
