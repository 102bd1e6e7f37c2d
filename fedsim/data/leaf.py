"""FEMNIST and Shakespeare in LEAF's JSON layout, with each example's writer (or play role).

LEAF (Caldas et al. 2018, github.com/TalwalkarLab/leaf) ships every federated dataset as
`<root>/train/*.json` and `<root>/test/*.json`, each file a dict with "users", "num_samples" and
"user_data": {user: {"x": [...], "y": [...]}}. The user is the natural client (a FEMNIST writer,
a Shakespeare speaking role), so the training examples keep it as `ArrayDataset.groups`: the
user's rank among the sorted training user names, which the `natural` partitioner splits by.
Examples are in file-name order, then each file's "users" order, then the user's own order.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import numpy as np

from fedsim.data.base import ArrayDataset, DataFileError
from fedsim.data.loaders import NoParams, _check_labels, _missing
from fedsim.data.natural import owner_ids
from fedsim.registry import DATASETS

FEMNIST_CLASSES = 62  # 10 digits, 26 upper-case and 26 lower-case letters (EMNIST byclass)
FEMNIST_PIXELS = 28 * 28

# LEAF's character vocabulary (models/utils/language_utils.py, ALL_LETTERS): newline, space,
# 18 punctuation marks, digits, upper- and lower-case letters; 80 characters, index = position.
# LEAF maps a character outside it to -1 (str.find); here it is an error instead.
SHAKESPEARE_VOCAB = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
SHAKESPEARE_SEQ_LEN = 80
_CHAR_INDEX = np.full(128, -1, dtype=np.int64)
_CHAR_INDEX[[ord(c) for c in SHAKESPEARE_VOCAB]] = np.arange(len(SHAKESPEARE_VOCAB))


# --------------------------------------------------------------------------- the JSON layout


def _leaf_root(data_dir: Path, name: str) -> Path:
    """The first of `<data_dir>/<name>/data` (LEAF's own tree) and `<data_dir>/<name>` with JSON in both splits."""
    roots = (data_dir / name / "data", data_dir / name)
    for root in roots:
        if all(any((root / split).glob("*.json")) for split in ("train", "test")):
            return root
    raise _missing(
        name,
        [f"{r}/train/*.json and {r}/test/*.json (LEAF's layout: users, num_samples, user_data)" for r in roots],
    )


def _user_examples(path: Path) -> Iterator[tuple[str, list, list]]:
    """(user, x, y) for every user of one LEAF file with at least one example, checking the layout."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataFileError(f"{path}: not a readable JSON file: {e}") from e
    if not (isinstance(doc, dict) and isinstance(doc.get("users"), list) and isinstance(doc.get("user_data"), dict)):
        raise DataFileError(f"{path}: expected LEAF's layout, a dict with 'users' (a list) and 'user_data' (a dict)")
    users, counts = doc["users"], doc.get("num_samples")
    if counts is not None and (not isinstance(counts, list) or len(counts) != len(users)):
        raise DataFileError(f"{path}: 'num_samples' must be a list with one count per user ({len(users)} users)")
    for i, user in enumerate(users):
        data = doc["user_data"].get(user) if isinstance(user, str) else None
        if not isinstance(data, dict) or not isinstance(data.get("x"), list) or not isinstance(data.get("y"), list):
            raise DataFileError(f"{path}: user {user!r} has no user_data entry with lists 'x' and 'y'")
        x, y = data["x"], data["y"]
        if len(x) != len(y):
            raise DataFileError(f"{path}: user {user!r} has {len(x)} x and {len(y)} y")
        if counts is not None and counts[i] != len(y):
            raise DataFileError(f"{path}: user {user!r} has {len(y)} examples, num_samples says {counts[i]}")
        if y:
            yield user, x, y


def _read_leaf(root: Path, decode) -> dict[str, list]:
    """Both splits decoded by `decode(path, user, x, y) -> (x array, y array)`, with each example's user."""
    out: dict[str, list] = {}
    for split in ("train", "test"):
        xs, ys, users = [], [], []
        for path in sorted((root / split).glob("*.json")):
            for user, x, y in _user_examples(path):
                a, b = decode(path, user, x, y)
                xs.append(a)
                ys.append(b)
                users += [user] * len(b)
        if not xs:
            raise DataFileError(f"{root / split}: the JSON files hold no examples")
        out[split] = [np.concatenate(xs), np.concatenate(ys), users]
    return out


def _leaf_dataset(name: str, splits: dict[str, list], num_classes: int) -> ArrayDataset:
    (x_tr, y_tr, u_tr), (x_te, y_te, _) = splits["train"], splits["test"]
    return ArrayDataset(name, x_tr, y_tr, x_te, y_te, num_classes, groups=owner_ids(u_tr))


# --------------------------------------------------------------------------- FEMNIST


def _femnist_user(path: Path, user: str, x: list, y: list) -> tuple[np.ndarray, np.ndarray]:
    """784 floats in [0, 1] per image (LEAF's `pixel / 255`, row-major 28x28) and a class in 0..61."""
    try:
        px = np.asarray(x, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise DataFileError(f"{path}: user {user!r}: x is not a list of 784 numbers per image: {e}") from e
    if px.ndim != 2 or px.shape[1] != FEMNIST_PIXELS:
        raise DataFileError(f"{path}: user {user!r}: x has shape {px.shape}, expected [n, 784]")
    if not np.all(np.isfinite(px)) or px.min() < 0 or px.max() > 1:
        raise DataFileError(f"{path}: user {user!r}: pixel values must be in [0, 1] (LEAF's pixel / 255)")
    labels = np.asarray(y)
    return px.astype(np.float32).reshape(-1, 1, 28, 28), _check_labels(
        path, f"user {user!r} y", labels, len(px), FEMNIST_CLASSES
    )


@DATASETS.register("femnist", NoParams)
def load_femnist(data_dir: Path, params: NoParams) -> ArrayDataset:
    """LEAF FEMNIST: 1x28x28 handwritten characters (62 classes), each image's writer kept, pixels as LEAF stores them."""
    return _leaf_dataset("femnist", _read_leaf(_leaf_root(data_dir, "femnist"), _femnist_user), FEMNIST_CLASSES)


# --------------------------------------------------------------------------- Shakespeare


def char_indices(path: Path, user: str, text: str) -> np.ndarray:
    """`text` as int64 indices into SHAKESPEARE_VOCAB; a character outside it is an error naming it."""
    codes = np.frombuffer(text.encode("utf-32-le"), dtype="<u4").astype(np.int64)
    idx = _CHAR_INDEX[np.minimum(codes, 127)]
    bad = (codes > 127) | (idx < 0)
    if bad.any():
        raise DataFileError(
            f"{path}: user {user!r}: character {chr(codes[bad][0])!r} is not in LEAF's 80-character vocabulary"
        )
    return idx


def _shakespeare_user(path: Path, user: str, x: list, y: list) -> tuple[np.ndarray, np.ndarray]:
    """x: 80-character strings; y: the single character that follows each."""
    n = SHAKESPEARE_SEQ_LEN
    if not all(isinstance(s, str) and len(s) == n for s in x):
        raise DataFileError(f"{path}: user {user!r}: every x must be a string of {n} characters")
    if not all(isinstance(c, str) and len(c) == 1 for c in y):
        raise DataFileError(f"{path}: user {user!r}: every y must be a single character")
    return char_indices(path, user, "".join(x)).reshape(-1, n), char_indices(path, user, "".join(y))


@DATASETS.register("shakespeare", NoParams)
def load_shakespeare(data_dir: Path, params: NoParams) -> ArrayDataset:
    """LEAF Shakespeare: next character (80 classes) after 80 characters (int64 [N, 80]), with each line's role."""
    splits = _read_leaf(_leaf_root(data_dir, "shakespeare"), _shakespeare_user)
    return _leaf_dataset("shakespeare", splits, len(SHAKESPEARE_VOCAB))
