"""Loaders for CIFAR-100, EMNIST and Tiny ImageNet, read from their official release formats.

Nothing is downloaded: each loader looks in the data directory for the files as the dataset's
authors distribute them (the CIFAR-100 python pickles, EMNIST's "gzip.zip" IDX files, the Tiny
ImageNet folder tree) and reuses the checks of fedsim/data/loaders.py, so a missing file names
every accepted path and a malformed one says what is wrong with it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import Field

from fedsim.data.base import ArrayDataset, DataFileError
from fedsim.data.loaders import (
    MNIST_MEAN,
    MNIST_STD,
    NoParams,
    SPLITS,
    _check_labels,
    _first_file,
    _labelled_split,
    _missing,
    normalize,
    read_idx,
    read_npz,
    safe_unpickle,
)
from fedsim.registry import DATASETS, Params

# Per-channel mean/std of the CIFAR-100 training pixels, as published in weiaicunzai/pytorch-cifar100
# (conf/global_settings.py, CIFAR100_TRAIN_MEAN / CIFAR100_TRAIN_STD), the constants most CIFAR-100
# papers' code copies. Pixel statistics do not depend on the labels: fine and coarse share them.
CIFAR100_MEAN = (0.5070751592371323, 0.48654887331495095, 0.4409178433670343)
CIFAR100_STD = (0.2673342858792401, 0.2564384629170883, 0.27615047132568404)
CIFAR100_CLASSES = {"fine": 100, "coarse": 20}

# EMNIST has no constants of its own that papers agree on (0.1307/0.3081, 0.1716/0.3297 and
# 0.1751/0.3332 are all in use, and the splits differ), and no copy is here to compute them:
# MNIST's (the PyTorch MNIST example's), which FL code for EMNIST most often reuses.
EMNIST_MEAN, EMNIST_STD = MNIST_MEAN, MNIST_STD
EMNIST_CLASSES = {"digits": 10, "balanced": 47, "byclass": 62}

# Tiny ImageNet is a 64x64 subset of ImageNet-1k: ImageNet's training-set constants, as in
# torchvision's and the PyTorch ImageNet example's `Normalize(mean, std)`.
TINY_IMAGENET_MEAN = (0.485, 0.456, 0.406)
TINY_IMAGENET_STD = (0.229, 0.224, 0.225)
TINY_IMAGENET_SIZE = 64
IMAGE_SUFFIXES = (".jpeg", ".jpg")


class Cifar100Params(Params):
    labels: Literal["fine", "coarse"] = Field(
        "fine", description="b'fine_labels' (100 classes) or b'coarse_labels' (20 superclasses)"
    )


class EmnistParams(Params):
    split: Literal["digits", "balanced", "byclass"] = Field(
        "digits", description="EMNIST split: digits (10 classes), balanced (47) or byclass (62)"
    )


# --------------------------------------------------------------------------- CIFAR-100


def _read_cifar100_file(path: Path, label_key: bytes, num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    """One official file: a dict with b"data" uint8 [n, 3072] (R, G, B planes of 32x32) and label lists."""
    batch = safe_unpickle(path)
    if not isinstance(batch, dict) or b"data" not in batch or label_key not in batch:
        keys = sorted(batch) if isinstance(batch, dict) else type(batch).__name__
        raise DataFileError(f"{path}: expected a dict with b'data' and {label_key!r}, found {keys}")
    data = batch[b"data"]
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072:
        desc = f"{data.dtype} {data.shape}" if isinstance(data, np.ndarray) else type(data).__name__
        raise DataFileError(f"{path}: b'data' is {desc}, expected uint8 [n, 3072]")
    labels = batch[label_key]
    if not (isinstance(labels, (list, np.ndarray)) and all(isinstance(v, (int, np.integer)) for v in labels)):
        raise DataFileError(f"{path}: {label_key!r} must be a list of integers")
    y = _check_labels(path, repr(label_key), np.asarray(labels, dtype=np.int64).reshape(-1), len(data), num_classes)
    return data.reshape(-1, 3, 32, 32), y


@DATASETS.register("cifar100", Cifar100Params)
def load_cifar100(data_dir: Path, params: Cifar100Params) -> ArrayDataset:
    """CIFAR-100 (50k/10k, 3x32x32, 100 fine or 20 coarse classes) from the official python-version pickles."""
    folders = (data_dir / "cifar-100-python", data_dir / "cifar100" / "cifar-100-python")
    folder = next((d for d in folders if (d / "train").is_file() and (d / "test").is_file()), None)
    if folder is None:
        raise _missing(
            "cifar100",
            [
                f"{d}/{{train, test}} (the official 'CIFAR-100 python version' pickles: dicts with "
                "b'data' uint8 [n, 3072], b'fine_labels', b'coarse_labels')"
                for d in folders
            ],
        )
    key, classes = f"{params.labels}_labels".encode(), CIFAR100_CLASSES[params.labels]
    x_tr, y_tr = _read_cifar100_file(folder / "train", key, classes)
    x_te, y_te = _read_cifar100_file(folder / "test", key, classes)
    return ArrayDataset(
        "cifar100",
        normalize(x_tr, CIFAR100_MEAN, CIFAR100_STD),
        y_tr,
        normalize(x_te, CIFAR100_MEAN, CIFAR100_STD),
        y_te,
        classes,
    )


# --------------------------------------------------------------------------- EMNIST

_EMNIST_PARTS = {
    "x_train": "train-images-idx3-ubyte",
    "y_train": "train-labels-idx1-ubyte",
    "x_test": "test-images-idx3-ubyte",
    "y_test": "test-labels-idx1-ubyte",
}


def _find_emnist_idx(folder: Path, split: str) -> dict[str, Path] | None:
    """The four `emnist-<split>-*` IDX files (plain or .gz) in `folder`; None if none, an error if some."""
    stems = {k: f"emnist-{split}-{s}" for k, s in _EMNIST_PARTS.items()}
    found = {k: _first_file([folder / s, folder / f"{s}.gz"]) for k, s in stems.items()}
    if all(found.values()):
        return found  # type: ignore[return-value]
    if any(found.values()):
        absent = [f"{folder / stems[k]}[.gz]" for k, p in found.items() if p is None]
        raise DataFileError(f"{folder}: incomplete EMNIST {split} IDX set, missing {', '.join(absent)}")
    return None


@DATASETS.register("emnist", EmnistParams)
def load_emnist(data_dir: Path, params: EmnistParams) -> ArrayDataset:
    """EMNIST handwritten digits and letters (1x28x28; digits/balanced/byclass: 10/47/62 classes), upright."""
    split, classes = params.split, EMNIST_CLASSES[params.split]
    npzs = (data_dir / f"emnist_{split}.npz", data_dir / "emnist" / f"emnist_{split}.npz")
    npz = _first_file(npzs)
    if npz is not None:  # already upright, like mnist.npz
        arrays = _labelled_split(read_npz(npz, SPLITS), dict.fromkeys(SPLITS, npz), (28, 28), classes)
    else:
        folders = (data_dir / "emnist" / "gzip", data_dir / "emnist", data_dir / "gzip", data_dir)
        where = next((w for w in (_find_emnist_idx(d, split) for d in folders) if w), None)
        if where is None:
            idx = ", ".join(f"emnist-{split}-{s}[.gz]" for s in _EMNIST_PARTS.values())
            raise _missing(
                "emnist",
                [f"{p} (uint8 arrays x_train [N,28,28] upright, y_train, x_test, y_test)" for p in npzs]
                + [f"the IDX files {idx} in {d}/ (EMNIST's gzip.zip release)" for d in folders],
            )
        arrays = _labelled_split({k: read_idx(p) for k, p in where.items()}, where, (28, 28), classes)
        for k in ("x_train", "x_test"):  # EMNIST's IDX images are stored transposed relative to MNIST
            arrays[k] = np.ascontiguousarray(arrays[k].transpose(0, 2, 1))
    return ArrayDataset(
        "emnist",
        normalize(arrays["x_train"][:, None], EMNIST_MEAN, EMNIST_STD),
        arrays["y_train"],
        normalize(arrays["x_test"][:, None], EMNIST_MEAN, EMNIST_STD),
        arrays["y_test"],
        classes,
    )


# --------------------------------------------------------------------------- Tiny ImageNet


def _pillow():
    try:
        from PIL import Image
    except ImportError as e:
        raise ImportError("tiny_imagenet: reading its JPEG files needs Pillow (pip install pillow)") from e
    return Image


def _read_wnids(path: Path) -> list[str]:
    try:
        wnids = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise DataFileError(f"{path}: cannot read the class list: {e}") from e
    if not wnids:
        raise DataFileError(f"{path}: no WordNet ids (one per line expected)")
    repeated = sorted({w for w in wnids if wnids.count(w) > 1})
    if repeated:
        raise DataFileError(f"{path}: WordNet ids listed more than once: {repeated}")
    return wnids


def _images_in(folder: Path) -> list[Path]:
    if not folder.is_dir():
        raise DataFileError(f"{folder}: missing folder of JPEG images")
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)


def _read_val_annotations(root: Path, index: dict[str, int]) -> tuple[list[Path], list[int]]:
    """`val/val_annotations.txt`: tab-separated file name, wnid, box; its line order is the test order."""
    path = root / "val" / "val_annotations.txt"
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise DataFileError(f"{path}: cannot read: {e}") from e
    files, labels = [], []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        fields = line.split("\t")
        if len(fields) < 2 or fields[1] not in index:
            raise DataFileError(
                f"{path}:{number}: expected '<file>\\t<wnid>\\t...' with a wnid of wnids.txt, got {line!r}"
            )
        files.append(root / "val" / "images" / fields[0])
        labels.append(index[fields[1]])
    on_disk = {p.name for p in _images_in(root / "val" / "images")}
    listed = {p.name for p in files}
    if on_disk != listed:
        odd = sorted(on_disk ^ listed)[0]
        where = "not annotated" if odd in on_disk else "annotated but not in val/images/"
        raise DataFileError(f"{path}: {odd} is {where} ({len(on_disk)} images, {len(listed)} annotations)")
    return files, labels


def _read_jpegs(files: list[Path]) -> np.ndarray:
    """RGB uint8 `[N, 3, 64, 64]`; greyscale files (Tiny ImageNet has some) are converted, never resized."""
    Image = _pillow()
    size = TINY_IMAGENET_SIZE
    out = np.empty((len(files), 3, size, size), dtype=np.uint8)
    for i, f in enumerate(files):
        try:
            with Image.open(f) as im:
                if im.size != (size, size):
                    raise DataFileError(f"{f}: image is {im.size[0]}x{im.size[1]}, Tiny ImageNet's are {size}x{size}")
                out[i] = np.asarray(im.convert("RGB"), dtype=np.uint8).transpose(2, 0, 1)
        except DataFileError:
            raise
        except Exception as e:  # Pillow raises OSError, ValueError, DecompressionBombError, ...
            raise DataFileError(f"{f}: not a readable image: {e}") from e
    return out


@DATASETS.register("tiny_imagenet", NoParams)
def load_tiny_imagenet(data_dir: Path, params: NoParams) -> ArrayDataset:
    """Tiny ImageNet (100k/10k val, 3x64x64, 200 classes) from the official folder tree; val is the test set."""
    roots = (data_dir / "tiny-imagenet-200", data_dir / "tiny_imagenet" / "tiny-imagenet-200")
    root = next((r for r in roots if (r / "wnids.txt").is_file()), None)
    if root is None:
        raise _missing(
            "tiny_imagenet",
            [
                f"{r}/ (the official tree: wnids.txt, train/<wnid>/images/*.JPEG, val/images/*.JPEG, "
                "val/val_annotations.txt)"
                for r in roots
            ],
        )
    wnids = _read_wnids(root / "wnids.txt")
    index = {w: i for i, w in enumerate(wnids)}
    train_files, train_labels = [], []
    for w in wnids:
        found = _images_in(root / "train" / w / "images")
        train_files += found
        train_labels += [index[w]] * len(found)
    test_files, test_labels = _read_val_annotations(root, index)
    mean, std = TINY_IMAGENET_MEAN, TINY_IMAGENET_STD
    return ArrayDataset(
        "tiny_imagenet",
        normalize(_read_jpegs(train_files), mean, std),
        np.asarray(train_labels, dtype=np.int64),
        normalize(_read_jpegs(test_files), mean, std),
        np.asarray(test_labels, dtype=np.int64),
        len(wnids),
    )
