"""Loaders for the real image datasets: MNIST, Fashion-MNIST, ARDIS IV, CIFAR-10 and Southwest planes.

Each loader reads either the compact `.npz` of shared/data (plain arrays, `allow_pickle=False`) or
the dataset's upstream format (IDX, ARDIS whitespace-separated text, the CIFAR-10 python pickles).
The pickles are read with an allow-list unpickler that can rebuild numpy arrays and nothing else,
so a crafted file cannot run code. Nothing is cached here; callers cache above this module.
"""

from __future__ import annotations

import gzip
import math
import pickle
import zipfile
from pathlib import Path
from typing import Any, Literal, Sequence

import numpy as np
from pydantic import Field

from fedsim.data.base import ArrayDataset, DataFileError
from fedsim.registry import DATASETS, Params

SPLITS = ("x_train", "y_train", "x_test", "y_test")

# The PyTorch MNIST example's constants, used by the papers this platform reproduces.
MNIST_MEAN, MNIST_STD = (0.1307,), (0.3081,)
FASHION_MEAN, FASHION_STD = (0.2860,), (0.3530,)

# OOD_Federated_Learning ("Attack of the Tails") normalises CIFAR-10 in two ways: its test loader
# and attacker pipeline use the pytorch-cifar constants ("ood_fl_test"), while the honest clients'
# training transform uses the [125.3, 123.0, 113.9] / [63.0, 62.1, 66.7] constants
# ("ood_fl_honest"). The difference is small (< 0.01 in mean, ~0.05 in std); one scenario uses one.
CIFAR_NORMALIZATIONS: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {
    "ood_fl_test": ((0.4914, 0.4822, 0.4465), (0.2023, 0.1994, 0.2010)),
    "ood_fl_honest": (
        (125.3 / 255, 123.0 / 255, 113.9 / 255),
        (63.0 / 255, 62.1 / 255, 66.7 / 255),
    ),
}


class NoParams(Params):
    """This loader has no parameters."""


class CifarParams(Params):
    normalization: Literal["ood_fl_test", "ood_fl_honest"] = Field(
        "ood_fl_test",
        description="per-channel mean/std: OOD_FL's test/attacker constants or its honest-client ones",
    )


# --------------------------------------------------------------------------- shared helpers


def normalize(x: np.ndarray, mean: Sequence[float], std: Sequence[float]) -> np.ndarray:
    """uint8 `[N, C, H, W]` -> float32 `(x/255 - mean_c) / std_c`, without a float64 copy."""
    out = x.astype(np.float32)
    out *= np.float32(1.0 / 255.0)
    shape = (1, len(mean), 1, 1)
    out -= np.asarray(mean, np.float32).reshape(shape)
    out /= np.asarray(std, np.float32).reshape(shape)
    return out


def _first_file(paths: Sequence[Path]) -> Path | None:
    return next((p for p in paths if p.is_file()), None)


def _missing(name: str, options: Sequence[str]) -> DataFileError:
    """The not-found error: every accepted location and its format, one per line."""
    listed = "\n  - ".join(options)
    return DataFileError(f"{name}: no data files found; expected one of:\n  - {listed}")


def read_npz(path: Path, keys: Sequence[str]) -> dict[str, np.ndarray]:
    """The named arrays of a `.npz`, refusing object arrays (no pickle) and naming missing keys."""
    try:
        with np.load(path, allow_pickle=False) as z:
            absent = [k for k in keys if k not in z.files]
            if absent:
                raise DataFileError(f"{path}: missing arrays {absent} (has {sorted(z.files)})")
            return {k: z[k] for k in keys}
    except DataFileError:
        raise
    except (ValueError, OSError, zipfile.BadZipFile, EOFError) as e:
        raise DataFileError(f"{path}: not a readable .npz of plain arrays: {e}") from e


def _as_uint8(where: Path, what: str, a: np.ndarray) -> np.ndarray:
    """Pixel values as uint8; other numeric dtypes only if every value is a whole number in 0..255."""
    if a.dtype == np.uint8:
        return a
    if a.dtype.kind not in "iuf":
        raise DataFileError(f"{where}: {what} has dtype {a.dtype}, expected uint8 pixel values")
    if a.size and (not np.all(np.isfinite(a)) or a.min() < 0 or a.max() > 255 or np.any(a != np.round(a))):
        raise DataFileError(f"{where}: {what} pixel values are not whole numbers in 0..255")
    return a.astype(np.uint8)


def _check_images(where: Path, what: str, x: np.ndarray, tail: tuple[int, ...]) -> np.ndarray:
    if x.ndim != 1 + len(tail) or tuple(x.shape[1:]) != tail:
        want = ", ".join(["N", *map(str, tail)])
        raise DataFileError(f"{where}: {what} has shape {x.shape}, expected ({want})")
    return _as_uint8(where, what, x)


def _check_labels(where: Path, what: str, y: np.ndarray, n: int, num_classes: int) -> np.ndarray:
    if y.ndim != 1 or y.dtype.kind not in "iu":
        raise DataFileError(f"{where}: {what} must be a 1-D integer array, got {y.dtype} {y.shape}")
    if len(y) != n:
        raise DataFileError(f"{where}: {what} has {len(y)} labels for {n} images")
    if n and (y.min() < 0 or y.max() >= num_classes):
        raise DataFileError(f"{where}: {what} has labels outside 0..{num_classes - 1}")
    return y.astype(np.int64)


def _labelled_split(
    arrays: dict[str, np.ndarray], where: dict[str, Path], tail: tuple[int, ...], num_classes: int
) -> dict[str, np.ndarray]:
    """Validate x/y of both splits: image shape, uint8 pixels, label count and range."""
    out: dict[str, np.ndarray] = {}
    for split in ("train", "test"):
        x = _check_images(where[f"x_{split}"], f"x_{split}", arrays[f"x_{split}"], tail)
        out[f"x_{split}"] = x
        out[f"y_{split}"] = _check_labels(
            where[f"y_{split}"], f"y_{split}", arrays[f"y_{split}"], len(x), num_classes
        )
    return out


def _grey_dataset(name: str, a: dict[str, np.ndarray], mean, std) -> ArrayDataset:
    return ArrayDataset(
        name,
        normalize(a["x_train"][:, None], mean, std),
        a["y_train"],
        normalize(a["x_test"][:, None], mean, std),
        a["y_test"],
        num_classes=10,
    )


# --------------------------------------------------------------------------- IDX (MNIST family)

_IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
_IDX_STEMS = {
    "x_train": "train-images-idx3-ubyte",
    "y_train": "train-labels-idx1-ubyte",
    "x_test": "t10k-images-idx3-ubyte",
    "y_test": "t10k-labels-idx1-ubyte",
}


def _read_at_most(f, limit: int) -> bytes:
    """Read up to `limit` bytes in chunks, so a lying header cannot make us allocate its claim."""
    chunks, left = [], limit
    while left > 0:
        chunk = f.read(min(left, 1 << 24))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def read_idx(path: Path) -> np.ndarray:
    """One IDX file (plain or `.gz`): magic `00 00 <type> <ndim>`, big-endian uint32 dims, data."""
    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            head = f.read(4)
            if len(head) != 4 or head[:2] != b"\0\0" or head[2] not in _IDX_DTYPES or head[3] == 0:
                raise DataFileError(f"{path}: bad IDX magic number {head.hex() or '(empty)'}")
            raw_dims = f.read(4 * head[3])
            if len(raw_dims) != 4 * head[3]:
                raise DataFileError(f"{path}: IDX header truncated")
            dims = tuple(int(d) for d in np.frombuffer(raw_dims, ">u4"))
            dtype = np.dtype(_IDX_DTYPES[head[2]])
            size = math.prod(dims) * dtype.itemsize
            data = _read_at_most(f, size + 1)
    except DataFileError:
        raise
    except (OSError, EOFError, zipfile.BadZipFile) as e:
        raise DataFileError(f"{path}: unreadable IDX file: {e}") from e
    if len(data) != size:
        problem = "truncated" if len(data) < size else "longer than its header says"
        raise DataFileError(f"{path}: IDX data {problem} (header dims {dims})")
    return np.frombuffer(data, dtype).reshape(dims).astype(dtype.newbyteorder("="))


def _idx_names(stem: str) -> list[str]:
    """Standard names plus the `train-images.idx3-ubyte` spelling some mirrors use."""
    dotted = stem.replace("-idx", ".idx")
    return [stem, stem + ".gz", dotted, dotted + ".gz"]


def _find_idx_set(folder: Path) -> dict[str, Path] | None:
    """The four IDX files in `folder`; None if none are there, an error if only some are."""
    found = {k: _first_file([folder / n for n in _idx_names(s)]) for k, s in _IDX_STEMS.items()}
    if all(found.values()):
        return found  # type: ignore[return-value]
    if any(found.values()):
        absent = [f"{folder / _IDX_STEMS[k]}[.gz]" for k, p in found.items() if p is None]
        raise DataFileError(f"{folder}: incomplete IDX set, missing {', '.join(absent)}")
    return None


def _load_mnist_like(name: str, data_dir: Path, mean, std) -> ArrayDataset:
    npz = data_dir / f"{name}.npz"
    if npz.is_file():
        arrays, where = read_npz(npz, SPLITS), dict.fromkeys(SPLITS, npz)
    else:
        folders = (data_dir / name, data_dir)
        where = next((w for w in map(_find_idx_set, folders) if w), None)
        if where is None:
            idx = ", ".join(f"{s}[.gz]" for s in _IDX_STEMS.values())
            raise _missing(
                name,
                [f"{npz} (uint8 arrays x_train [N,28,28], y_train, x_test, y_test)"]
                + [f"the IDX files {idx} in {d}/ (or spelled train-images.idx3-ubyte, ...)" for d in folders],
            )
        arrays = {k: read_idx(p) for k, p in where.items()}
    return _grey_dataset(name, _labelled_split(arrays, where, (28, 28), 10), mean, std)


@DATASETS.register("mnist", NoParams)
def load_mnist(data_dir: Path, params: NoParams) -> ArrayDataset:
    """MNIST handwritten digits (60k/10k, 1x28x28), from mnist.npz or the IDX files."""
    return _load_mnist_like("mnist", data_dir, MNIST_MEAN, MNIST_STD)


@DATASETS.register("fashion_mnist", NoParams)
def load_fashion_mnist(data_dir: Path, params: NoParams) -> ArrayDataset:
    """Fashion-MNIST clothing images (60k/10k, 1x28x28), from fashion_mnist.npz or the IDX files."""
    return _load_mnist_like("fashion_mnist", data_dir, FASHION_MEAN, FASHION_STD)


# --------------------------------------------------------------------------- ARDIS IV

_ARDIS_FILES = {
    "x_train": "ARDIS_train_2828.csv",
    "y_train": "ARDIS_train_labels.csv",
    "x_test": "ARDIS_test_2828.csv",
    "y_test": "ARDIS_test_labels.csv",
}


def _read_text_matrix(path: Path, cols: int) -> np.ndarray:
    """A numeric text table; the upstream files are whitespace-separated, commas are accepted too."""
    try:
        with open(path, "rb") as f:
            comma = b"," in f.readline()
        m = np.loadtxt(path, dtype=np.float64, delimiter="," if comma else None, ndmin=2)
    except (OSError, ValueError) as e:
        raise DataFileError(f"{path}: not a numeric table: {e}") from e
    if m.shape[1] != cols:
        raise DataFileError(f"{path}: rows have {m.shape[1]} values, expected {cols}")
    return m


def _one_hot_labels(path: Path, m: np.ndarray) -> np.ndarray:
    if m.size and not (np.all((m == 0) | (m == 1)) and np.all(m.sum(axis=1) == 1)):
        raise DataFileError(f"{path}: label rows are not one-hot (exactly one 1, the rest 0)")
    return m.argmax(axis=1).astype(np.int64)


def _read_ardis_csvs(where: dict[str, Path]) -> dict[str, np.ndarray]:
    """CSV rows are 784 pixels row-major, already upright like MNIST (no transpose needed)."""
    out = {}
    for split in ("train", "test"):
        px = _read_text_matrix(where[f"x_{split}"], 28 * 28)
        out[f"x_{split}"] = px.reshape(-1, 28, 28)
        out[f"y_{split}"] = _one_hot_labels(where[f"y_{split}"], _read_text_matrix(where[f"y_{split}"], 10))
    return out


@DATASETS.register("ardis", NoParams)
def load_ardis(data_dir: Path, params: NoParams) -> ArrayDataset:
    """ARDIS IV Swedish historical digits (6600/1000, 1x28x28, class-sorted), MNIST-normalised."""
    npz = data_dir / "ardis_iv.npz"
    if npz.is_file():
        arrays, where = read_npz(npz, SPLITS), dict.fromkeys(SPLITS, npz)
    else:
        folders = (data_dir / "ardis", data_dir)
        where = next(
            (
                {k: d / n for k, n in _ARDIS_FILES.items()}
                for d in folders
                if all((d / n).is_file() for n in _ARDIS_FILES.values())
            ),
            None,
        )
        if where is None:
            csvs = ", ".join(_ARDIS_FILES.values())
            raise _missing(
                "ardis",
                [f"{npz} (uint8 arrays x_train [N,28,28], y_train, x_test, y_test)"]
                + [
                    f"the CSVs {csvs} in {d}/ (784 pixel values 0-255 per row; one-hot label rows)"
                    for d in folders
                ],
            )
        arrays = _read_ardis_csvs(where)
    # MNIST constants on purpose: ARDIS is the edge-case set fed to MNIST-trained models.
    return _grey_dataset("ardis", _labelled_split(arrays, where, (28, 28), 10), MNIST_MEAN, MNIST_STD)


# --------------------------------------------------------------------------- restricted unpickling

try:  # numpy >= 2
    from numpy._core import multiarray as _np_multiarray, numeric as _np_numeric
except ImportError:  # numpy 1.x
    from numpy.core import multiarray as _np_multiarray, numeric as _np_numeric  # type: ignore[no-redef]


def _latin1_encode(text: str, encoding: str = "latin1") -> bytes:
    """Protocol-2 pickles written by Python 3 store bytes as `_codecs.encode(str, 'latin1')`."""
    if encoding not in ("latin1", "latin-1") or not isinstance(text, str):
        raise pickle.UnpicklingError(f"_codecs.encode only allowed with latin1, got {encoding!r}")
    return text.encode("latin1")


# Everything needed to rebuild a numpy array (protocols 2-5, numpy 1.x and 2.x names) and nothing else.
_PICKLE_ALLOWED: dict[tuple[str, str], Any] = {
    ("numpy.core.multiarray", "_reconstruct"): _np_multiarray._reconstruct,
    ("numpy._core.multiarray", "_reconstruct"): _np_multiarray._reconstruct,
    ("numpy.core.numeric", "_frombuffer"): _np_numeric._frombuffer,
    ("numpy._core.numeric", "_frombuffer"): _np_numeric._frombuffer,
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
    ("_codecs", "encode"): _latin1_encode,
}


class _ArrayOnlyUnpickler(pickle.Unpickler):
    """Unpickler that resolves only the numpy array globals above; anything else is refused."""

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _PICKLE_ALLOWED[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(
                f"refused global {module}.{name}: only numpy array reconstruction is allowed"
            ) from None


def safe_unpickle(path: Path) -> Any:
    """Read an official-format pickle (CIFAR batch, Southwest array) without executing code."""
    try:
        with open(path, "rb") as f:
            return _ArrayOnlyUnpickler(f, encoding="bytes").load()
    except OSError as e:
        raise DataFileError(f"{path}: cannot read: {e}") from e
    except Exception as e:  # anything a malformed or hostile pickle raises while loading
        raise DataFileError(f"{path}: not a plain numpy/CIFAR pickle: {e}") from e


# --------------------------------------------------------------------------- CIFAR-10

_CIFAR_TRAIN = tuple(f"data_batch_{i}" for i in range(1, 6))
_CIFAR_TEST = ("test_batch",)


def _read_cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """One batch dict: b"data" uint8 [n, 3072] (R, G, B planes, each 32x32 row-major), b"labels"."""
    batch = safe_unpickle(path)
    if not isinstance(batch, dict) or b"data" not in batch or b"labels" not in batch:
        raise DataFileError(f"{path}: expected a dict with b'data' and b'labels'")
    data = batch[b"data"]
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072:
        desc = f"{data.dtype} {data.shape}" if isinstance(data, np.ndarray) else type(data).__name__
        raise DataFileError(f"{path}: b'data' is {desc}, expected uint8 [n, 3072]")
    labels = batch[b"labels"]
    if not (isinstance(labels, (list, np.ndarray)) and all(isinstance(v, (int, np.integer)) for v in labels)):
        raise DataFileError(f"{path}: b'labels' must be a list of integers")
    y = _check_labels(path, "b'labels'", np.asarray(labels, dtype=np.int64).reshape(-1), len(data), 10)
    return data.reshape(-1, 3, 32, 32), y


def _read_cifar_split(folder: Path, names: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    parts = [_read_cifar_batch(folder / n) for n in names]
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


@DATASETS.register("cifar10", CifarParams)
def load_cifar10(data_dir: Path, params: CifarParams) -> ArrayDataset:
    """CIFAR-10 (50k/10k, 3x32x32) from the official python-version batches, read without code execution."""
    folders = (data_dir / "cifar-10-batches-py", data_dir / "cifar10" / "cifar-10-batches-py")
    names = _CIFAR_TRAIN + _CIFAR_TEST
    folder = next((d for d in folders if all((d / n).is_file() for n in names)), None)
    if folder is None:
        raise _missing(
            "cifar10",
            [
                f"{d}/{{data_batch_1..data_batch_5, test_batch}} (the official "
                "'CIFAR-10 python version' pickles: dicts with b'data' uint8 [10000, 3072], b'labels')"
                for d in folders
            ],
        )
    x_tr, y_tr = _read_cifar_split(folder, _CIFAR_TRAIN)
    x_te, y_te = _read_cifar_split(folder, _CIFAR_TEST)
    mean, std = CIFAR_NORMALIZATIONS[params.normalization]
    return ArrayDataset("cifar10", normalize(x_tr, mean, std), y_tr, normalize(x_te, mean, std), y_te, 10)


# --------------------------------------------------------------------------- Southwest edge case

_SOUTHWEST_PKL = {"x_train": "southwest_images_new_train.pkl", "x_test": "southwest_images_new_test.pkl"}


def _hwc_images(where: Path, what: str, x: Any) -> np.ndarray:
    """Validate uint8 `[N, 32, 32, 3]` (RGB, HWC like CIFAR-10) and return it as `[N, 3, 32, 32]`."""
    if not isinstance(x, np.ndarray):
        raise DataFileError(f"{where}: {what} is a {type(x).__name__}, expected a numpy array")
    return _check_images(where, what, x, (32, 32, 3)).transpose(0, 3, 1, 2)


@DATASETS.register("southwest", CifarParams)
def load_southwest(data_dir: Path, params: CifarParams) -> ArrayDataset:
    """Southwest Airlines plane photos (784/196, 3x32x32, unlabelled: y=-1), the CIFAR-10 edge case."""
    npz = data_dir / "southwest_edgecase.npz"
    if npz.is_file():
        raw = read_npz(npz, ("x_train", "x_test"))
        x = {k: _hwc_images(npz, k, v) for k, v in raw.items()}
    else:
        folders = (data_dir / "southwest", data_dir)
        folder = next((d for d in folders if all((d / n).is_file() for n in _SOUTHWEST_PKL.values())), None)
        if folder is None:
            pkls = " and ".join(_SOUTHWEST_PKL.values())
            raise _missing(
                "southwest",
                [f"{npz} (uint8 arrays x_train [N,32,32,3], x_test)"]
                + [f"{pkls} in {d}/ (each one pickled uint8 ndarray [N,32,32,3])" for d in folders],
            )
        x = {k: _hwc_images(folder / n, k, safe_unpickle(folder / n)) for k, n in _SOUTHWEST_PKL.items()}
    mean, std = CIFAR_NORMALIZATIONS[params.normalization]
    unlabelled = {k: np.full(len(v), -1, dtype=np.int64) for k, v in x.items()}
    return ArrayDataset(
        "southwest",
        normalize(x["x_train"], mean, std),
        unlabelled["x_train"],
        normalize(x["x_test"], mean, std),
        unlabelled["x_test"],
        num_classes=10,
    )
