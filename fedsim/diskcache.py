"""A small on-disk cache for derived arrays (loaded datasets, partitions).

In deployment every message runs in a fresh ClientApp process, and a simulation starts fresh Ray
workers: without a cache each of them re-reads and re-normalises its dataset and recomputes the
client partitions (importing scikit-learn and `datasets` on the way). Entries are `.npz` files
(read with `allow_pickle=False`) named by a hash of everything they depend on, written
atomically. `FEDSIM_CACHE=0` turns the cache off; `FEDSIM_CACHE_DIR` moves it.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Callable

import numpy as np

MAX_BYTES = 64 * 1024**2  # larger results are recomputed rather than cached


def cache_dir() -> Path:
    return Path(os.environ.get("FEDSIM_CACHE_DIR", Path.home() / ".cache" / "fedsim"))


def enabled() -> bool:
    return os.environ.get("FEDSIM_CACHE", "1") != "0"


def key_of(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]


def folder_fingerprint(folder: Path | None, depth: int = 2) -> list:
    """Names, sizes and modification times of the files a loader may read: a change invalidates."""
    if folder is None or not Path(folder).is_dir():
        return []
    out = []
    for root, dirs, files in os.walk(folder):
        if len(Path(root).relative_to(folder).parts) >= depth:
            dirs.clear()
        for name in sorted(files):
            st = (Path(root) / name).stat()
            out.append([str(Path(root, name).relative_to(folder)), st.st_size, st.st_mtime_ns])
    return sorted(out)


def cached_arrays(kind: str, key: str, compute: Callable[[], dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """`compute()`'s arrays, from the cache when an entry for `key` exists."""
    if not enabled():
        return compute()
    path = cache_dir() / f"{kind}-{key}.npz"
    if path.exists():
        try:
            with np.load(path, allow_pickle=False) as data:
                return {k: data[k] for k in data.files}
        except (OSError, ValueError):  # a damaged entry: recompute it
            path.unlink(missing_ok=True)
    arrays = compute()
    if sum(a.nbytes for a in arrays.values()) <= MAX_BYTES:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}.npz")
        np.savez(tmp, **arrays)
        tmp.replace(path)
    return arrays
