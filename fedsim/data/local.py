"""A device's own training data: the files its node config's `local-data` points at.

A real device does not hold a partition of the scenario's central dataset; it holds its own
images. This module reads them and turns them into exactly what the scenario's model takes, the
same way the central dataset's loader would (raw pixels -> `x / pixel_max`, then that dataset's
per-channel mean/std, NCHW float32). To do that without the central dataset's files, each dataset
a device can train on has static facts here (`FACTS`); `tests/test_local_data.py` checks them
against the real loaders.

Accepted forms, told apart by the path:

* a folder of class sub-folders holding images (read with Pillow). Sub-folders named by class
  index ("0".."9") give that index; otherwise the names are sorted and their rank is the index
  (as torchvision's ImageFolder does), which is only unambiguous when every class has a folder,
  so then all `num_classes` must be there. Images are converted to the dataset's colour mode
  (L or RGB) but never resized: a wrong size is an error.
* a `.npz` with arrays `x`, `y` (or `x_train`, `y_train`), or a folder with `x.npy` and `y.npy`
  (or the `x.npy` file itself, `y.npy` beside it). `x` is `[N, H, W]`, `[N, C, H, W]`,
  `[N, H, W, C]` or flattened `[N, C*H*W]` (channel planes in order, like CIFAR's batches).
  Arrays are not colour-converted.
* a `.csv`: the label in the first column, then the flattened pixels (Kaggle's mnist_train.csv);
  a header line is skipped when it is not numeric.

Pixels are raw whole numbers in 0..pixel_max (255, or 16 for scikit-learn's digits), labels whole
numbers in 0..num_classes-1. Every problem is a `DataFileError` naming the path, what was found
and what the scenario expects.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from fedsim.data import vision
from fedsim.data.base import DataFileError
from fedsim.data.loaders import CIFAR_NORMALIZATIONS, FASHION_MEAN, FASHION_STD, MNIST_MEAN, MNIST_STD, read_npz
from fedsim.diskcache import folder_fingerprint

NODE_CONFIG_KEY = "local-data"
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".pgm", ".ppm", ".pnm")
NPZ_PAIRS = (("x", "y"), ("x_train", "y_train"))


@dataclass(frozen=True)
class DatasetFacts:
    """What a device must know of the scenario's dataset to turn its own images into model inputs."""

    name: str
    input_shape: tuple[int, int, int]  # C, H, W
    num_classes: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    pixel_max: int = 255  # raw pixels are whole numbers 0..pixel_max

    @property
    def channels(self) -> int:
        return self.input_shape[0]

    @property
    def mode(self) -> str:
        """The Pillow mode images are converted to."""
        return "L" if self.channels == 1 else "RGB"

    def shape_text(self) -> str:
        return "x".join(map(str, self.input_shape))


# One entry per dataset a device can hold data of; `southwest` is left out: it is an unlabelled
# edge-case pool, never a training set; so are the text datasets (shakespeare, sentiment140): a
# device's own data is read as images. A dataset's parameters may change its facts (CIFAR-10's
# normalisation), so an entry is a function of the dataset's spec.
FACTS: dict[str, Callable[[object], DatasetFacts]] = {
    "mnist": lambda spec: DatasetFacts("mnist", (1, 28, 28), 10, MNIST_MEAN, MNIST_STD),
    "fashion_mnist": lambda spec: DatasetFacts("fashion_mnist", (1, 28, 28), 10, FASHION_MEAN, FASHION_STD),
    "ardis": lambda spec: DatasetFacts("ardis", (1, 28, 28), 10, MNIST_MEAN, MNIST_STD),
    "cifar10": lambda spec: DatasetFacts("cifar10", (3, 32, 32), 10, *CIFAR_NORMALIZATIONS[spec.normalization]),
    # scikit-learn's digits are whole numbers 0..16, scaled by 1/16 and not centred
    "digits": lambda spec: DatasetFacts("digits", (1, 8, 8), 10, (0.0,), (1.0,), pixel_max=16),
    "cifar100": lambda spec: DatasetFacts(
        "cifar100", (3, 32, 32), vision.CIFAR100_CLASSES[spec.labels], vision.CIFAR100_MEAN, vision.CIFAR100_STD
    ),
    "emnist": lambda spec: DatasetFacts(
        "emnist", (1, 28, 28), vision.EMNIST_CLASSES[spec.split], vision.EMNIST_MEAN, vision.EMNIST_STD
    ),
    # LEAF stores FEMNIST pixels as pixel / 255, not centred: the model takes them as they are
    "femnist": lambda spec: DatasetFacts("femnist", (1, 28, 28), 62, (0.0,), (1.0,)),
    "tiny_imagenet": lambda spec: DatasetFacts(
        "tiny_imagenet", (3, 64, 64), 200, vision.TINY_IMAGENET_MEAN, vision.TINY_IMAGENET_STD
    ),
}


def dataset_facts(spec) -> DatasetFacts | None:
    """The static facts of a scenario's dataset spec (its `data.dataset`), or None if it has none."""
    make = FACTS.get(spec.name)
    return None if make is None else make(spec)


def require_facts(spec, path) -> DatasetFacts:
    facts = dataset_facts(spec)
    if facts is None:
        raise DataFileError(
            f"{NODE_CONFIG_KEY} {path}: the scenario's dataset {spec.name!r} cannot be replaced by a device's own "
            f"data (datasets that can: {', '.join(sorted(FACTS))})"
        )
    return facts


# --------------------------------------------------------------------------- entry points


def load_local(path: str | Path, facts: DatasetFacts) -> tuple[np.ndarray, np.ndarray]:
    """The device's examples as model inputs (float32 `[N, C, H, W]`, normalised like the central
    dataset) and int64 labels, after checking shape, pixel range and labels against `facts`."""
    where = Path(path).expanduser()
    x, y = read_local(where, facts)
    return to_inputs(x, facts), y


def to_inputs(x: np.ndarray, facts: DatasetFacts) -> np.ndarray:
    """Raw pixels `[N, C, H, W]` -> `(x / pixel_max - mean_c) / std_c` in float32, the operations
    and order of `loaders.normalize` so the values are bit-identical to the central loader's."""
    out = x.astype(np.float32)
    out *= np.float32(1.0 / facts.pixel_max)
    shape = (1, facts.channels, 1, 1)
    out -= np.asarray(facts.mean, np.float32).reshape(shape)
    out /= np.asarray(facts.std, np.float32).reshape(shape)
    return out


def read_local(where: Path, facts: DatasetFacts) -> tuple[np.ndarray, np.ndarray]:
    """Raw uint8 pixels `[N, C, H, W]` and int64 labels from whichever form `where` has."""
    if where.is_dir():
        if (where / "x.npy").is_file() or (where / "y.npy").is_file():
            x, y = _read_npy_pair(where, where / "x.npy", where / "y.npy")
            return _arrays(where, x, y, facts)
        return _read_image_folder(where, facts)
    if not where.exists():
        raise DataFileError(f"{NODE_CONFIG_KEY} {where}: no such file or folder")
    suffix = where.suffix.lower()
    if suffix == ".npz":
        return _arrays(where, *_read_npz(where), facts)
    if suffix == ".csv":
        return _read_csv(where, facts)
    if where.name == "x.npy":
        return _arrays(where, *_read_npy_pair(where, where, where.with_name("y.npy")), facts)
    raise DataFileError(
        f"{NODE_CONFIG_KEY} {where}: unknown kind of file {where.name!r}; expected a folder of class "
        "sub-folders with images, a .npz with x and y, a folder with x.npy and y.npy (or its x.npy), "
        "or a .csv with the label first then the pixels"
    )


def source_files(where: Path) -> list[Path]:
    """The files `read_local` reads for `where` (a folder: all of it, two levels down)."""
    if where.is_dir():
        return [where]
    return [where, where.with_name("y.npy")] if where.name == "x.npy" else [where]


def fingerprint(path: str | Path) -> list:
    """Names, sizes and modification times of what the device's data is read from: a change invalidates."""
    out = []
    for p in source_files(Path(path).expanduser()):
        if p.is_dir():
            out.append([str(p.resolve()), folder_fingerprint(p)])
        elif p.is_file():
            st = p.stat()
            out.append([str(p.resolve()), st.st_size, st.st_mtime_ns])
    return out


def cache_parts(path: str | Path, facts: DatasetFacts) -> list:
    """Everything the loaded arrays depend on besides library versions: files, facts, image decoder."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        pillow = version("pillow")
    except PackageNotFoundError:
        pillow = "unknown"
    return [fingerprint(path), asdict(facts), pillow]


# --------------------------------------------------------------------------- shape, pixels, labels


def _mismatch(where: Path, found: str, facts: DatasetFacts, hint: str = "") -> DataFileError:
    return DataFileError(
        f"{NODE_CONFIG_KEY} {where}: images are {found}, the scenario's model (dataset {facts.name}) takes "
        f"{facts.shape_text()}{hint}"
    )


def _as_nchw(where: Path, x: np.ndarray, facts: DatasetFacts) -> np.ndarray:
    """`x` in one of the accepted array layouts -> `[N, C, H, W]`; no resizing, no colour conversion."""
    c, h, w = facts.input_shape
    no_convert = " (arrays are neither resized nor colour-converted)"
    if x.ndim == 2:
        if x.shape[1] != c * h * w:
            raise DataFileError(
                f"{NODE_CONFIG_KEY} {where}: rows have {x.shape[1]} pixel values, the scenario's model "
                f"(dataset {facts.name}) takes {facts.shape_text()} = {c * h * w}{no_convert}"
            )
        return x.reshape(-1, c, h, w)
    if x.ndim == 3:
        if c == 1 and x.shape[1:] == (h, w):
            return x[:, None]
        raise _mismatch(where, f"1x{x.shape[1]}x{x.shape[2]}", facts, no_convert)
    if x.ndim == 4:
        if x.shape[1:] == (c, h, w):
            return x
        if x.shape[1:] == (h, w, c):
            return x.transpose(0, 3, 1, 2)
        channels_last = x.shape[3] in (1, 3, 4) and x.shape[1] not in (1, 3, 4)
        n, a, b, d = x.shape
        found = f"{d}x{a}x{b} (channels last)" if channels_last else f"{a}x{b}x{d}"
        raise _mismatch(where, found, facts, no_convert)
    raise DataFileError(
        f"{NODE_CONFIG_KEY} {where}: x has shape {x.shape}; expected images as [N, H, W], [N, C, H, W], "
        f"[N, H, W, C] or flattened [N, C*H*W] for the model's {facts.shape_text()}"
    )


def _pixels(where: Path, x: np.ndarray, facts: DatasetFacts) -> np.ndarray:
    """Raw pixel values as uint8: whole numbers in 0..pixel_max, never already-normalised floats."""
    if x.dtype.kind not in "iuf":
        raise DataFileError(f"{NODE_CONFIG_KEY} {where}: pixels have dtype {x.dtype}, expected whole numbers")
    if x.dtype != np.uint8 or facts.pixel_max != 255:
        bad = not np.all(np.isfinite(x)) or np.any(x != np.round(x))
        if bad or x.min() < 0 or x.max() > facts.pixel_max:
            scale = " (its own raw scale, not 0..255)" if facts.pixel_max != 255 else ""
            raise DataFileError(
                f"{NODE_CONFIG_KEY} {where}: pixel values must be whole numbers in 0..{facts.pixel_max} for "
                f"dataset {facts.name}{scale}, found values from {x.min()} to {x.max()}"
                + (" that are not all whole numbers" if bad else "")
                + " (raw pixels, not normalised ones)"
            )
    return x.astype(np.uint8)


def _labels(where: Path, y: np.ndarray, n: int, facts: DatasetFacts) -> np.ndarray:
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]
    if y.ndim != 1 or y.dtype.kind not in "iuf":
        raise DataFileError(
            f"{NODE_CONFIG_KEY} {where}: labels must be one number per example, got {y.dtype} {y.shape}"
        )
    if len(y) != n:
        raise DataFileError(f"{NODE_CONFIG_KEY} {where}: {len(y)} labels for {n} images")
    if y.dtype.kind == "f" and (not np.all(np.isfinite(y)) or np.any(y != np.round(y))):
        raise DataFileError(f"{NODE_CONFIG_KEY} {where}: labels must be whole numbers (class indices)")
    bad = (y < 0) | (y >= facts.num_classes)
    if bad.any():
        raise DataFileError(
            f"{NODE_CONFIG_KEY} {where}: labels must be in 0..{facts.num_classes - 1} (dataset {facts.name} has "
            f"{facts.num_classes} classes), found {y[bad][0]:g} ({int(bad.sum())} such labels)"
        )
    return y.astype(np.int64)


def _arrays(where: Path, x: np.ndarray, y: np.ndarray, facts: DatasetFacts) -> tuple[np.ndarray, np.ndarray]:
    if len(x) == 0:
        raise DataFileError(f"{NODE_CONFIG_KEY} {where}: holds no examples")
    x = _pixels(where, _as_nchw(where, x, facts), facts)
    return x, _labels(where, y, len(x), facts)


# --------------------------------------------------------------------------- the forms


def _read_npz(where: Path) -> tuple[np.ndarray, np.ndarray]:
    try:
        with np.load(where, allow_pickle=False) as z:
            names = set(z.files)
    except Exception as e:  # numpy raises several types for a file that is not an npz
        raise DataFileError(f"{NODE_CONFIG_KEY} {where}: not a readable .npz of plain arrays: {e}") from e
    keys = next((pair for pair in NPZ_PAIRS if set(pair) <= names), None)
    if keys is None:
        raise DataFileError(
            f"{NODE_CONFIG_KEY} {where}: expected arrays x and y (or x_train and y_train), found {sorted(names)}"
        )
    arrays = read_npz(where, keys)
    return arrays[keys[0]], arrays[keys[1]]


def _read_npy_pair(where: Path, x_file: Path, y_file: Path) -> tuple[np.ndarray, np.ndarray]:
    out = []
    for f in (x_file, y_file):
        if not f.is_file():
            raise DataFileError(f"{NODE_CONFIG_KEY} {where}: x.npy and y.npy belong together, {f} is missing")
        try:
            out.append(np.load(f, allow_pickle=False))
        except (ValueError, OSError, EOFError) as e:
            raise DataFileError(f"{NODE_CONFIG_KEY} {f}: not a readable .npy of plain numbers: {e}") from e
    return out[0], out[1]


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _read_csv(where: Path, facts: DatasetFacts) -> tuple[np.ndarray, np.ndarray]:
    """Label, then the flattened pixels, one example per line; numpy only (no pandas on a device)."""
    try:
        with open(where, "r", encoding="utf-8-sig") as f:
            first = f.readline()
        header = bool(first.strip()) and not all(_is_number(v) for v in first.split(","))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # an empty file: reported below, not as a numpy warning
            m = np.loadtxt(where, delimiter=",", skiprows=int(header), dtype=np.float64, ndmin=2,
                           encoding="utf-8-sig")
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise DataFileError(f"{NODE_CONFIG_KEY} {where}: not a numeric CSV (label, then pixels): {e}") from e
    if m.shape[0] == 0:
        raise DataFileError(f"{NODE_CONFIG_KEY} {where}: holds no examples")
    return _arrays(where, m[:, 1:], m[:, 0], facts)


def _class_indices(where: Path, names: list[str], facts: DatasetFacts) -> list[int]:
    """Sub-folder names -> class indices: numbers are indices, other names are ranked when all are there."""
    numeric = [bool(re.fullmatch(r"\d+", n)) for n in names]
    last = facts.num_classes - 1
    if all(numeric):
        idx = [int(n) for n in names]
        wrong = [n for n, i in zip(names, idx) if i > last]
        if wrong:
            raise DataFileError(
                f"{NODE_CONFIG_KEY} {where}: sub-folder {wrong[0]!r} is not a class of dataset {facts.name} "
                f"(classes 0..{last})"
            )
        if len(set(idx)) != len(idx):
            raise DataFileError(f"{NODE_CONFIG_KEY} {where}: two sub-folders name the same class: {sorted(names)}")
        return idx
    if any(numeric):
        raise DataFileError(
            f"{NODE_CONFIG_KEY} {where}: sub-folders mix class indices and class names: {sorted(names)}; "
            f"use one or the other"
        )
    if len(names) != facts.num_classes:
        raise DataFileError(
            f"{NODE_CONFIG_KEY} {where}: {len(names)} sub-folders named by class name, dataset {facts.name} has "
            f"{facts.num_classes} classes; sorted names are ranked into indices only when every class has a "
            f"folder, so name them by class index (0..{last}) instead"
        )
    return list(range(len(names)))  # names are sorted by the caller


def _pillow():
    try:
        from PIL import Image
    except ImportError as e:
        raise ImportError(
            f"{NODE_CONFIG_KEY}: reading a folder of images needs Pillow (pip install pillow), "
            "or give the data as .npz, .npy or .csv"
        ) from e
    return Image


def _read_image_folder(where: Path, facts: DatasetFacts) -> tuple[np.ndarray, np.ndarray]:
    folders = sorted((d for d in where.iterdir() if d.is_dir() and not d.name.startswith(".")), key=lambda d: d.name)
    if not folders:
        raise DataFileError(
            f"{NODE_CONFIG_KEY} {where}: a folder with neither class sub-folders of images nor x.npy and y.npy"
        )
    indices = _class_indices(where, [d.name for d in folders], facts)
    Image = _pillow()
    c, h, w = facts.input_shape
    xs, ys = [], []
    for folder, label in zip(folders, indices):
        for f in sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith(".")):
            if f.suffix.lower() not in IMAGE_SUFFIXES:
                raise DataFileError(
                    f"{NODE_CONFIG_KEY} {f}: not an image file (expected one of {', '.join(IMAGE_SUFFIXES)})"
                )
            try:
                with Image.open(f) as im:
                    if im.size != (w, h):  # checked before decoding: no resizing, ever
                        found = f"{len(im.getbands())}x{im.size[1]}x{im.size[0]}"
                        raise _mismatch(f, found, facts, f" (colour is converted, size is not: make them {h}x{w})")
                    xs.append(np.asarray(im.convert(facts.mode), dtype=np.uint8).reshape(h, w, c))
            except DataFileError:
                raise
            except Exception as e:  # Pillow raises OSError, ValueError, DecompressionBombError, ...
                raise DataFileError(f"{NODE_CONFIG_KEY} {f}: not a readable image: {e}") from e
            ys.append(label)
    if not xs:
        raise DataFileError(f"{NODE_CONFIG_KEY} {where}: holds no examples (the class sub-folders are empty)")
    x = np.stack(xs).transpose(0, 3, 1, 2)
    return _pixels(where, x, facts), np.asarray(ys, dtype=np.int64)
