"""The simulation keeps OpenBLAS single-threaded while Ray forks beside the ServerApp thread."""

from __future__ import annotations

import numpy as np
from threadpoolctl import threadpool_info

from fedsim.engine.simulate import single_threaded_openblas


def _openblas_threads() -> list[int]:
    return [lib["num_threads"] for lib in threadpool_info() if lib.get("internal_api") == "openblas"]


def test_openblas_runs_single_threaded_inside_and_is_restored_after():
    import scipy.linalg  # noqa: F401  (scipy's OpenBLAS too)

    np.linalg.eigh(np.eye(4))  # make sure numpy's OpenBLAS is loaded
    before = _openblas_threads()
    assert before, "numpy links OpenBLAS here; this check needs it"
    with single_threaded_openblas():
        assert _openblas_threads() == [1] * len(before)
    assert _openblas_threads() == before
