"""CIFAR-100, EMNIST, Tiny ImageNet, FEMNIST, Shakespeare, Sentiment140 and the `natural` partitioner.

No copy of these datasets is here: each test writes a few examples in the official format into
tmp_path (pickles with the official keys, IDX files with the official magic numbers, LEAF JSON, the
latin-1 CSVs, a JPEG tree) and checks the loader against values computed here by hand from what
was written: pixel / 255 normalised with the constants written out below, EMNIST's transposition,
LEAF's vocabulary, a vocabulary counted by hand. The partitioner is checked against flwr-datasets'
own NaturalIdPartitioner and against each writer's rows.
"""

from __future__ import annotations

import csv
import gzip
import json
import os
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest

from fedsim.data import leaf, natural, text, vision
from fedsim.data.base import DataFileError
from fedsim.data.local import dataset_facts, load_local
from fedsim.data.loaders import NoParams
from fedsim.registry import DATASETS, PARTITIONERS

NO = NoParams()
# Written out here, not imported: pytorch-cifar100's training-set statistics, ImageNet's, MNIST's.
CIFAR100_MEAN = np.array([0.5070751592371323, 0.48654887331495095, 0.4409178433670343])
CIFAR100_STD = np.array([0.2673342858792401, 0.2564384629170883, 0.27615047132568404])
IMAGENET_MEAN, IMAGENET_STD = np.array([0.485, 0.456, 0.406]), np.array([0.229, 0.224, 0.225])
MNIST_MEAN, MNIST_STD = 0.1307, 0.3081
# LEAF's models/utils/language_utils.py ALL_LETTERS, copied independently of fedsim.data.leaf.
LEAF_LETTERS = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"


def by_hand(raw: np.ndarray, mean, std) -> np.ndarray:
    """uint8 [N, C, H, W] -> (x / 255 - mean_c) / std_c in float64."""
    m, s = np.asarray(mean, float).reshape(1, -1, 1, 1), np.asarray(std, float).reshape(1, -1, 1, 1)
    return (raw.astype(np.float64) / 255 - m) / s


def close(got: np.ndarray, want: np.ndarray) -> bool:
    return got.dtype == np.float32 and got.shape == want.shape and np.allclose(got, want, rtol=0, atol=1e-5)


def spec(name: str, **params):
    return DATASETS.get(name).spec_model()(name=name, **params)


# --------------------------------------------------------------------------- CIFAR-100


def write_cifar100(folder: Path, rng, n_train=7, n_test=3, protocol=2) -> dict:
    """The official files: dicts with bytes keys, b'data' uint8 [n, 3072] (R, G, B planes)."""
    folder.mkdir(parents=True)
    out = {}
    for name, n in (("train", n_train), ("test", n_test)):
        data = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
        fine, coarse = rng.integers(0, 100, n).tolist(), rng.integers(0, 20, n).tolist()
        batch = {b"filenames": [f"img_{i}.png".encode() for i in range(n)], b"batch_label": f"{name}".encode(),
                 b"fine_labels": fine, b"coarse_labels": coarse, b"data": data}
        (folder / name).write_bytes(pickle.dumps(batch, protocol=protocol))
        out[name] = (data, fine, coarse)
    return out


@pytest.mark.parametrize("sub, protocol", [("cifar-100-python", 2), ("cifar100/cifar-100-python", 4)])
def test_cifar100_official_pickles_fine_and_coarse(tmp_path, sub, protocol):
    raw = write_cifar100(tmp_path / sub, np.random.default_rng(1), protocol=protocol)
    ds = vision.load_cifar100(tmp_path, vision.Cifar100Params())
    assert (ds.name, ds.num_classes, ds.x_train.shape, ds.x_test.shape) == ("cifar100", 100, (7, 3, 32, 32), (3, 3, 32, 32))
    for x, (data, fine, _) in ((ds.x_train, raw["train"]), (ds.x_test, raw["test"])):
        planes = np.stack([data[:, c * 1024:(c + 1) * 1024].reshape(-1, 32, 32) for c in range(3)], axis=1)
        assert close(x, by_hand(planes, CIFAR100_MEAN, CIFAR100_STD))
    assert ds.y_train.dtype == np.int64 and ds.y_train.tolist() == raw["train"][1]
    # one value spelled out: byte 2048 + 32*4 + 9 of test row 2 is blue at (4, 9)
    b = raw["test"][0][2, 2048 + 32 * 4 + 9]
    assert ds.x_test[2, 2, 4, 9] == pytest.approx((b / 255 - 0.4409178433670343) / 0.27615047132568404, abs=1e-5)

    coarse = vision.load_cifar100(tmp_path, vision.Cifar100Params(labels="coarse"))
    assert coarse.num_classes == 20 and coarse.y_test.tolist() == raw["test"][2]
    assert np.array_equal(coarse.x_train, ds.x_train)


def test_cifar100_malformed_and_hostile_files(tmp_path):
    folder = tmp_path / "cifar-100-python"
    write_cifar100(folder, np.random.default_rng(2))
    (folder / "test").write_bytes(pickle.dumps({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 1]}))
    with pytest.raises(DataFileError, match=r"test: expected a dict with b'data' and b'fine_labels', found \[b'data', b'labels'\]"):
        vision.load_cifar100(tmp_path, vision.Cifar100Params())
    (folder / "test").write_bytes(pickle.dumps({b"data": np.zeros((2, 3072), np.uint8), b"fine_labels": [0, 100],
                                                b"coarse_labels": [0, 1]}))
    with pytest.raises(DataFileError, match=r"test: b'fine_labels' has labels outside 0\.\.99"):
        vision.load_cifar100(tmp_path, vision.Cifar100Params())
    (folder / "test").write_bytes(pickle.dumps({b"data": np.zeros((2, 3072), np.uint8), b"fine_labels": [0, 1],
                                                b"coarse_labels": [0, 20]}))
    with pytest.raises(DataFileError, match=r"b'coarse_labels' has labels outside 0\.\.19"):
        vision.load_cifar100(tmp_path, vision.Cifar100Params(labels="coarse"))

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'pwned'}",))

    (folder / "train").write_bytes(pickle.dumps({b"data": Evil(), b"fine_labels": []}))
    with pytest.raises(DataFileError, match=r"train: not a plain numpy/CIFAR pickle: refused global"):
        vision.load_cifar100(tmp_path, vision.Cifar100Params())
    assert not (tmp_path / "pwned").exists()


# --------------------------------------------------------------------------- EMNIST


def idx_bytes(a: np.ndarray) -> bytes:
    """IDX: magic 00 00 08 <ndim> (0x801 labels, 0x803 images), big-endian uint32 dims, uint8 data."""
    return struct.pack(">I", 0x800 + a.ndim) + struct.pack(f">{a.ndim}I", *a.shape) + a.astype(np.uint8).tobytes()


def write_emnist(folder: Path, split: str, upright: dict, gz: bool) -> None:
    """The gzip.zip release's files: each image stored transposed, as EMNIST does."""
    folder.mkdir(parents=True, exist_ok=True)
    for part, a in (("train-images-idx3", upright["x_train"].transpose(0, 2, 1)), ("train-labels-idx1", upright["y_train"]),
                    ("test-images-idx3", upright["x_test"].transpose(0, 2, 1)), ("test-labels-idx1", upright["y_test"])):
        name = f"emnist-{split}-{part}-ubyte"
        if gz:
            (folder / f"{name}.gz").write_bytes(gzip.compress(idx_bytes(a)))
        else:
            (folder / name).write_bytes(idx_bytes(a))


def emnist_arrays(rng, classes: int) -> dict:
    x = rng.integers(0, 256, (9, 28, 28), dtype=np.uint8)
    x[0] = 0
    x[0, 2, 3:25] = 255  # a horizontal bar near the top: upright, row 2 is lit, column 2 is not
    return {"x_train": x[:6], "y_train": rng.integers(0, classes, 6).astype(np.uint8),
            "x_test": x[6:], "y_test": np.array([0, classes - 1, 1], np.uint8)}


@pytest.mark.parametrize("sub, gz, split, classes", [
    ("emnist/gzip", True, "digits", 10), ("emnist", False, "balanced", 47), ("gzip", True, "byclass", 62),
    ("", False, "digits", 10),
])
def test_emnist_idx_images_are_transposed_upright(tmp_path, sub, gz, split, classes):
    up = emnist_arrays(np.random.default_rng(3), classes)
    write_emnist(tmp_path / sub, split, up, gz)
    ds = vision.load_emnist(tmp_path, vision.EmnistParams(split=split))
    assert (ds.name, ds.num_classes, ds.x_train.shape) == ("emnist", classes, (6, 1, 28, 28))
    assert close(ds.x_train, by_hand(up["x_train"][:, None], [MNIST_MEAN], [MNIST_STD]))
    assert close(ds.x_test, by_hand(up["x_test"][:, None], [MNIST_MEAN], [MNIST_STD]))
    assert ds.x_train.flags.c_contiguous
    lit = ds.x_train[0, 0] > 0
    assert lit[2, 3:25].all() and lit.sum() == 22 and not lit[:, 2].any()  # the bar is a row again
    assert ds.y_train.tolist() == up["y_train"].tolist() and ds.y_test.tolist() == [0, classes - 1, 1]


def test_emnist_npz_is_taken_upright_and_params_are_checked(tmp_path):
    up = emnist_arrays(np.random.default_rng(4), 47)
    np.savez(tmp_path / "emnist_balanced.npz", **up)
    ds = vision.load_emnist(tmp_path, vision.EmnistParams(split="balanced"))
    assert ds.num_classes == 47 and close(ds.x_train, by_hand(up["x_train"][:, None], [MNIST_MEAN], [MNIST_STD]))
    with pytest.raises(ValueError):
        vision.EmnistParams(split="letters")
    up["y_test"][1] = 47
    np.savez(tmp_path / "emnist_balanced.npz", **up)
    with pytest.raises(DataFileError, match=r"emnist_balanced\.npz: y_test has labels outside 0\.\.46"):
        vision.load_emnist(tmp_path, vision.EmnistParams(split="balanced"))


def test_emnist_malformed_idx(tmp_path):
    up = emnist_arrays(np.random.default_rng(5), 10)
    write_emnist(tmp_path / "emnist", "digits", up, gz=False)
    bad = tmp_path / "emnist" / "emnist-digits-test-labels-idx1-ubyte"
    bad.write_bytes(b"\x00\x00\x08\x01" + struct.pack(">I", 5) + bytes(3))  # header says 5, holds 3
    with pytest.raises(DataFileError, match=r"test-labels-idx1-ubyte: IDX data truncated"):
        vision.load_emnist(tmp_path, vision.EmnistParams())
    bad.write_bytes(b"\x08\x08\x08\x01")
    with pytest.raises(DataFileError, match=r"bad IDX magic number 08080801"):
        vision.load_emnist(tmp_path, vision.EmnistParams())
    bad.unlink()
    with pytest.raises(DataFileError, match=r"incomplete EMNIST digits IDX set, missing .*emnist-digits-test-labels-idx1-ubyte\[\.gz\]"):
        vision.load_emnist(tmp_path, vision.EmnistParams())


# --------------------------------------------------------------------------- Tiny ImageNet


def write_tiny_imagenet(root: Path, rng) -> dict:
    """wnids.txt in a non-alphabetical order, two JPEGs per class (one greyscale), val in shuffled order."""
    from PIL import Image

    wnids = ["n03", "n01", "n02"]
    root.mkdir(parents=True)
    (root / "wnids.txt").write_text("\n".join(wnids) + "\n")
    written = {"train": [], "val": []}
    for w in wnids:
        folder = root / "train" / w / "images"
        folder.mkdir(parents=True)
        (root / "train" / w / f"{w}_boxes.txt").write_text("")
        for i in range(2):
            f = folder / f"{w}_{i}.JPEG"
            if i == 1:
                Image.fromarray(rng.integers(0, 256, (64, 64), dtype=np.uint8), "L").save(f, quality=95)
            else:
                Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8), "RGB").save(f, quality=95)
            written["train"].append((f, wnids.index(w)))
    (root / "val" / "images").mkdir(parents=True)
    lines = []
    for i, w in [(3, "n02"), (0, "n03"), (2, "n01"), (1, "n02")]:
        f = root / "val" / "images" / f"val_{i}.JPEG"
        Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8), "RGB").save(f)
        lines.append(f"{f.name}\t{w}\t0\t1\t62\t63")
        written["val"].append((f, wnids.index(w)))
    (root / "val" / "val_annotations.txt").write_text("\n".join(lines) + "\n")
    return written


def decoded(files) -> np.ndarray:
    """The test's own decoding of the JPEGs it wrote: RGB uint8 [N, 3, 64, 64]."""
    from PIL import Image

    return np.stack([np.asarray(Image.open(f).convert("RGB")) for f in files]).transpose(0, 3, 1, 2)


@pytest.mark.parametrize("sub", ["tiny-imagenet-200", "tiny_imagenet/tiny-imagenet-200"])
def test_tiny_imagenet_folder_tree(tmp_path, sub):
    pytest.importorskip("PIL")
    written = write_tiny_imagenet(tmp_path / sub, np.random.default_rng(6))
    ds = vision.load_tiny_imagenet(tmp_path, NO)
    assert (ds.name, ds.num_classes, ds.x_train.shape, ds.x_test.shape) == ("tiny_imagenet", 3, (6, 3, 64, 64), (4, 3, 64, 64))
    train_files, train_y = zip(*written["train"])  # wnids.txt order, files by name
    val_files, val_y = zip(*written["val"])  # val_annotations.txt order
    assert ds.y_train.tolist() == list(train_y) == [0, 0, 1, 1, 2, 2]
    assert ds.y_test.tolist() == list(val_y) == [2, 0, 1, 2]
    assert close(ds.x_train, by_hand(decoded(train_files), IMAGENET_MEAN, IMAGENET_STD))
    assert close(ds.x_test, by_hand(decoded(val_files), IMAGENET_MEAN, IMAGENET_STD))
    grey = decoded([train_files[1]])[0]
    assert (grey[0] == grey[1]).all() and (grey[1] == grey[2]).all()  # greyscale JPEG: R = G = B


def test_tiny_imagenet_malformed_tree(tmp_path):
    from PIL import Image

    root = tmp_path / "tiny-imagenet-200"
    write_tiny_imagenet(root, np.random.default_rng(7))
    notes = root / "val" / "val_annotations.txt"
    good = notes.read_text()
    notes.write_text(good + "val_9.JPEG\tn99\t0\t0\t1\t1\n")
    with pytest.raises(DataFileError, match=r"val_annotations\.txt:5: expected .* wnid of wnids\.txt"):
        vision.load_tiny_imagenet(tmp_path, NO)
    notes.write_text(good)
    Image.fromarray(np.zeros((64, 64, 3), np.uint8)).save(root / "val" / "images" / "val_7.JPEG")
    with pytest.raises(DataFileError, match=r"val_7\.JPEG is not annotated"):
        vision.load_tiny_imagenet(tmp_path, NO)
    (root / "val" / "images" / "val_7.JPEG").unlink()
    Image.fromarray(np.zeros((32, 32, 3), np.uint8)).save(root / "train" / "n01" / "images" / "n01_0.JPEG")
    with pytest.raises(DataFileError, match=r"n01_0\.JPEG: image is 32x32, Tiny ImageNet's are 64x64"):
        vision.load_tiny_imagenet(tmp_path, NO)
    (root / "train" / "n01" / "images" / "n01_0.JPEG").write_bytes(b"not a jpeg")
    with pytest.raises(DataFileError, match=r"n01_0\.JPEG: not a readable image"):
        vision.load_tiny_imagenet(tmp_path, NO)
    (root / "wnids.txt").write_text("n03\nn01\nn03\n")
    with pytest.raises(DataFileError, match=r"wnids\.txt: WordNet ids listed more than once: \['n03'\]"):
        vision.load_tiny_imagenet(tmp_path, NO)
    (root / "wnids.txt").write_text("n03\nn04\n")
    with pytest.raises(DataFileError, match=r"train/n04/images: missing folder of JPEG images"):
        vision.load_tiny_imagenet(tmp_path, NO)


# --------------------------------------------------------------------------- LEAF: FEMNIST


def write_leaf(root: Path, split: str, name: str, users: dict[str, tuple[list, list]]) -> None:
    (root / split).mkdir(parents=True, exist_ok=True)
    doc = {"users": list(users), "num_samples": [len(y) for _, y in users.values()],
           "user_data": {u: {"x": x, "y": y} for u, (x, y) in users.items()}}
    (root / split / name).write_text(json.dumps(doc))


def femnist_user(rng, n: int) -> tuple[list, list, np.ndarray]:
    px = rng.integers(0, 256, (n, 784))
    return (px / 255).tolist(), rng.integers(0, 62, n).tolist(), px


@pytest.mark.parametrize("sub", ["femnist/data", "femnist"])
def test_femnist_leaf_json_with_writers(tmp_path, sub):
    rng = np.random.default_rng(8)
    root = tmp_path / sub
    a, b, c, t = (femnist_user(rng, n) for n in (3, 2, 4, 2))
    # file order b_ then a_ by name; inside a file, the "users" order (not alphabetical)
    write_leaf(root, "train", "b_part.json", {"f0003_12": a[:2], "f0001_40": b[:2]})
    write_leaf(root, "train", "a_part.json", {"f0002_07": c[:2]})
    write_leaf(root, "test", "all.json", {"f0001_40": t[:2]})
    ds = leaf.load_femnist(tmp_path, NO)
    assert (ds.name, ds.num_classes, ds.x_train.shape, ds.x_test.shape) == ("femnist", 62, (9, 1, 28, 28), (2, 1, 28, 28))
    raw = np.concatenate([c[2], a[2], b[2]])
    assert close(ds.x_train, (raw / 255).reshape(-1, 1, 28, 28))
    assert ds.y_train.tolist() == c[1] + a[1] + b[1] and ds.y_test.tolist() == t[1]
    # writers ranked by sorted name: f0001_40 -> 0, f0002_07 -> 1, f0003_12 -> 2
    assert ds.groups.dtype == np.int64 and ds.groups.tolist() == [1] * 4 + [2] * 3 + [0] * 2


def test_femnist_malformed_json(tmp_path):
    rng = np.random.default_rng(9)
    root = tmp_path / "femnist"
    x, y, _ = femnist_user(rng, 2)
    write_leaf(root, "test", "t.json", {"u": (x, y)})
    cases = [
        ({"u": (x, y[:1])}, r"user 'u' has 2 x and 1 y"),
        ({"u": ([r[:783] for r in x], y)}, r"user 'u': x has shape \(2, 783\), expected \[n, 784\]"),
        ({"u": ([[2.0] * 784, x[1]], y)}, r"pixel values must be in \[0, 1\]"),
        ({"u": (x, [3, 62])}, r"user 'u' y has labels outside 0\.\.61"),
        ({"u": (x, [3.0, 1.0])}, r"user 'u' y must be a 1-D integer array"),
    ]
    for users, message in cases:
        write_leaf(root, "train", "p.json", users)
        with pytest.raises(DataFileError, match=message):
            leaf.load_femnist(tmp_path, NO)
    doc = {"users": ["u"], "num_samples": [5], "user_data": {"u": {"x": x, "y": y}}}
    (root / "train" / "p.json").write_text(json.dumps(doc))
    with pytest.raises(DataFileError, match=r"p\.json: user 'u' has 2 examples, num_samples says 5"):
        leaf.load_femnist(tmp_path, NO)
    (root / "train" / "p.json").write_text('{"users": ["u"], "user_data": {}}')
    with pytest.raises(DataFileError, match=r"user 'u' has no user_data entry"):
        leaf.load_femnist(tmp_path, NO)
    (root / "train" / "p.json").write_text('{"users": [')
    with pytest.raises(DataFileError, match=r"p\.json: not a readable JSON file"):
        leaf.load_femnist(tmp_path, NO)


# --------------------------------------------------------------------------- LEAF: Shakespeare


def test_shakespeare_characters_map_to_leaf_vocabulary(tmp_path):
    rng = np.random.default_rng(10)
    assert len(LEAF_LETTERS) == 80 and leaf.SHAKESPEARE_VOCAB == LEAF_LETTERS

    def lines(n):
        x = ["".join(rng.choice(list(LEAF_LETTERS), 80)) for _ in range(n)]
        return x, [str(rng.choice(list(LEAF_LETTERS))) for _ in range(n)]

    king, fool, test = lines(3), lines(2), lines(2)
    x0 = ("To be, or not to be: that is the question.\n" + "Whether 'tis nobler in the mind to suffer}")[:80]
    king = ([x0] + king[0][1:], ["T"] + king[1][1:])
    root = tmp_path / "shakespeare" / "data"
    write_leaf(root, "train", "train.json", {"KING_LEAR_LEAR": king, "KING_LEAR_FOOL": fool})
    write_leaf(root, "test", "test.json", {"KING_LEAR_LEAR": test})
    ds = leaf.load_shakespeare(tmp_path, NO)
    want_x = [[LEAF_LETTERS.find(ch) for ch in s] for s in king[0] + fool[0]]
    assert ds.x_train.dtype == np.int64 and ds.x_train.shape == (5, 80) and ds.x_train.tolist() == want_x
    assert ds.y_train.tolist() == [LEAF_LETTERS.find(ch) for ch in king[1] + fool[1]]
    assert ds.x_test.tolist() == [[LEAF_LETTERS.find(ch) for ch in s] for s in test[0]]
    assert ds.num_classes == 80 and ds.x_train[0, :3].tolist() == [44, 67, 1]  # 'T', 'o', ' '
    assert ds.groups.tolist() == [1, 1, 1, 0, 0]  # FOOL < LEAR

    write_leaf(root, "train", "train.json", {"R": (["x" * 79 + "|"], ["a"])})
    with pytest.raises(DataFileError, match=r"user 'R': character '\|' is not in LEAF's 80-character vocabulary"):
        leaf.load_shakespeare(tmp_path, NO)
    write_leaf(root, "train", "train.json", {"R": (["x" * 79 + "é"], ["a"])})
    with pytest.raises(DataFileError, match=r"character 'é' is not in LEAF's"):
        leaf.load_shakespeare(tmp_path, NO)
    write_leaf(root, "train", "train.json", {"R": (["x" * 79], ["a"])})
    with pytest.raises(DataFileError, match=r"every x must be a string of 80 characters"):
        leaf.load_shakespeare(tmp_path, NO)
    write_leaf(root, "train", "train.json", {"R": (["x" * 80], ["ab"])})
    with pytest.raises(DataFileError, match=r"every y must be a single character"):
        leaf.load_shakespeare(tmp_path, NO)


# --------------------------------------------------------------------------- Sentiment140


def write_csv(path: Path, rows) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="", encoding="latin-1") as f:
        csv.writer(f, quoting=csv.QUOTE_ALL).writerows(rows)


def row(polarity, user, tweet):
    return [str(polarity), "1467810369", "Mon Apr 06 22:19:45 PDT 2009", "NO_QUERY", user, tweet]


@pytest.mark.parametrize("sub", ["sentiment140", ""])
def test_sentiment140_vocabulary_and_padding_by_hand(tmp_path, sub):
    write_csv(tmp_path / sub / text.TRAIN_CSV, [
        row(0, "alice", "Love it, love it!"),
        row(4, "josé", 'I\'m "so" happy'),
        row(4, "alice", "so SO so happy today"),
    ])
    write_csv(tmp_path / sub / text.TEST_CSV, [
        row(4, "bob", "Happy happy joy"), row(2, "carl", "meh"), row(0, "dan", "it is so sad, café"),
    ])
    ds = text.load_sentiment140(tmp_path, text.Sentiment140Params(vocab_size=3, max_len=4))
    # counts: so 4; happy, it, love 2; i'm, today 1 -> so=2, then the ties alphabetically: happy=3, it=4
    assert ds.x_train.dtype == np.int64 and ds.x_train.tolist() == [[1, 4, 1, 4], [1, 2, 3, 0], [2, 2, 2, 3]]
    assert ds.y_train.tolist() == [0, 1, 1] and ds.num_classes == 2
    assert ds.x_test.tolist() == [[3, 3, 1, 0], [4, 1, 2, 1]] and ds.y_test.tolist() == [1, 0]  # neutral dropped
    assert ds.groups.tolist() == [0, 1, 0]  # alice, josé (latin-1 read back)
    assert text.tokenize("Don't STOP, it's ok!!") == ["don't", "stop", "it's", "ok"]


def test_sentiment140_malformed_csv(tmp_path):
    write_csv(tmp_path / text.TEST_CSV, [row(0, "a", "fine")])
    write_csv(tmp_path / text.TRAIN_CSV, [row(0, "a", "ok"), row(4, "b", "ok")[:5]])
    with pytest.raises(DataFileError, match=r"noemoticon\.csv:2: 5 fields, expected 6 \(polarity, id, date"):
        text.load_sentiment140(tmp_path, text.Sentiment140Params())
    write_csv(tmp_path / text.TRAIN_CSV, [row(0, "a", "ok"), row(1, "b", "ok")])
    with pytest.raises(DataFileError, match=r"noemoticon\.csv:2: polarity '1', expected 0, 2 or 4"):
        text.load_sentiment140(tmp_path, text.Sentiment140Params())
    write_csv(tmp_path / text.TEST_CSV, [row(2, "a", "meh")])
    write_csv(tmp_path / text.TRAIN_CSV, [row(0, "a", "ok")])
    with pytest.raises(DataFileError, match=r"testdata\.manual\.2009\.06\.14\.csv: no negative \(0\) or positive \(4\)"):
        text.load_sentiment140(tmp_path, text.Sentiment140Params())


# --------------------------------------------------------------------------- missing files


@pytest.mark.parametrize("name, params, expected", [
    ("cifar100", {}, ["cifar-100-python/{train, test}", "cifar100/cifar-100-python/{train, test}", "b'fine_labels'"]),
    ("emnist", {"split": "byclass"}, ["emnist_byclass.npz", "emnist/emnist_byclass.npz", "emnist/gzip/",
                                      "emnist-byclass-train-images-idx3-ubyte[.gz]", "gzip.zip"]),
    ("tiny_imagenet", {}, ["tiny-imagenet-200/", "tiny_imagenet/tiny-imagenet-200/", "val/val_annotations.txt"]),
    ("femnist", {}, ["femnist/data/train/*.json", "femnist/test/*.json", "LEAF"]),
    ("shakespeare", {}, ["shakespeare/data/train/*.json", "shakespeare/train/*.json"]),
    ("sentiment140", {}, [f"sentiment140/{text.TRAIN_CSV}", f"{text.TEST_CSV}", "latin-1"]),
])
def test_missing_files_name_every_accepted_path(tmp_path, name, params, expected):
    entry = DATASETS.get(name)
    with pytest.raises(DataFileError) as e:
        entry.obj(tmp_path, entry.params(**params))
    msg = str(e.value)
    assert msg.startswith(f"{name}: no data files found; expected one of:")
    for part in expected:
        assert part in msg, part
    assert f"{tmp_path}/" in msg


def test_registered_with_params_and_summaries():
    for name, params in [("cifar100", vision.Cifar100Params), ("emnist", vision.EmnistParams),
                         ("tiny_imagenet", NoParams), ("femnist", NoParams), ("shakespeare", NoParams),
                         ("sentiment140", text.Sentiment140Params)]:
        entry = DATASETS.get(name)
        assert entry.params is params and entry.summary
    entry = PARTITIONERS.get("natural")
    assert entry.params is natural.NaturalParams and entry.traits.needs_groups is True


# --------------------------------------------------------------------------- facts vs loaders


def test_image_facts_match_the_loaders_bit_for_bit(tmp_path):
    """A device holding the same raw pixels gets exactly the central loader's inputs."""
    raw = write_cifar100(tmp_path / "cifar-100-python", np.random.default_rng(11))
    planes = raw["train"][0].reshape(-1, 3, 32, 32)
    np.savez(tmp_path / "c100.npz", x=planes, y=np.array(raw["train"][2]))
    for labels, classes in (("fine", 100), ("coarse", 20)):
        ds = vision.load_cifar100(tmp_path, vision.Cifar100Params(labels=labels))
        f = dataset_facts(spec("cifar100", labels=labels))
        assert (f.input_shape, f.num_classes) == (ds.input_shape, classes)
        assert np.array_equal(load_local(tmp_path / "c100.npz", f)[0], ds.x_train)

    up = emnist_arrays(np.random.default_rng(12), 62)
    write_emnist(tmp_path / "emnist", "byclass", up, gz=True)
    ds = vision.load_emnist(tmp_path, vision.EmnistParams(split="byclass"))
    f = dataset_facts(spec("emnist", split="byclass"))
    np.savez(tmp_path / "e.npz", x=up["x_train"], y=up["y_train"])
    assert (f.input_shape, f.num_classes) == (ds.input_shape, 62)
    assert np.array_equal(load_local(tmp_path / "e.npz", f)[0], ds.x_train)

    rng = np.random.default_rng(13)
    x, y, px = femnist_user(rng, 3)
    write_leaf(tmp_path / "femnist", "train", "a.json", {"w": (x, y)})
    write_leaf(tmp_path / "femnist", "test", "a.json", {"w": (x, y)})
    ds = leaf.load_femnist(tmp_path, NO)
    f = dataset_facts(spec("femnist"))
    np.savez(tmp_path / "f.npz", x=px.reshape(-1, 28, 28).astype(np.uint8), y=np.array(y))
    assert (f.input_shape, f.num_classes) == (ds.input_shape, 62)
    assert close(load_local(tmp_path / "f.npz", f)[0], ds.x_train.astype(np.float64))  # pixel / 255 either way

    pytest.importorskip("PIL")
    written = write_tiny_imagenet(tmp_path / "tiny-imagenet-200", np.random.default_rng(14))
    ds = vision.load_tiny_imagenet(tmp_path, NO)
    f = dataset_facts(spec("tiny_imagenet"))
    np.savez(tmp_path / "t.npz", x=decoded([p for p, _ in written["train"]]), y=ds.y_train)
    assert f.input_shape == ds.input_shape and f.num_classes == 200
    assert np.array_equal(load_local(tmp_path / "t.npz", f)[0], ds.x_train)


# --------------------------------------------------------------------------- the natural partitioner

GROUPS = np.array([3, 3, 1, 7, 1, 3, 9, 7, 7, 1, 3])  # writers 1, 3, 7, 9


def rows_of(groups: np.ndarray) -> dict[int, list[int]]:
    return {int(w): np.flatnonzero(groups == w).tolist() for w in np.unique(groups)}


def part(n: int, seed: int = 0, groups=GROUPS, **params) -> list[list[int]]:
    parts = natural.natural(np.zeros(len(groups), np.int64), n, seed, natural.NaturalParams(**params), groups=groups)
    return [p.tolist() for p in parts]


def test_one_client_per_writer_is_each_writers_rows():
    rows = rows_of(GROUPS)
    assert part(4, shuffle_owners=False) == [rows[1], rows[3], rows[7], rows[9]]  # client i = i-th writer id
    for seed in range(5):
        got = part(4, seed)
        assert sorted(got) == sorted(rows.values()) and got == part(4, seed)  # a permutation, deterministic
    assert len({tuple(map(tuple, part(4, s))) for s in range(10)}) > 1  # the seed decides who is who


def test_as_flwr_datasets_natural_id_partitioner_gives_them():
    import datasets
    from flwr_datasets.partitioner import NaturalIdPartitioner

    p = NaturalIdPartitioner(partition_by="writer")
    p.dataset = datasets.Dataset.from_dict({"writer": GROUPS, "idx": np.arange(len(GROUPS))})
    flwr = [sorted(p.load_partition(i)["idx"]) for i in range(p.num_partitions)]
    assert part(4, shuffle_owners=False) == flwr


def test_fewer_clients_group_whole_writers():
    rows = rows_of(GROUPS)
    # id order, blocks of 2, 1, 1 writers: the first 4 % 3 blocks get one more
    assert part(3, shuffle_owners=False) == [sorted(rows[1] + rows[3]), rows[7], rows[9]]
    writer_of = {r: w for w, rs in rows.items() for r in rs}
    for seed in range(5):
        got = part(3, seed)
        assert sorted(r for p in got for r in p) == list(range(len(GROUPS)))
        held = [{writer_of[r] for r in p} for p in got]
        assert [len(h) for h in held] == [2, 1, 1]
        assert all(sorted(p) == sorted(r for w in h for r in rows[w]) for p, h in zip(got, held))  # whole writers
    assert part(1, 3) == [list(range(len(GROUPS)))]


def test_natural_partition_errors():
    with pytest.raises(ValueError, match=r"4 owners \(writers\) cannot fill 5 clients; set federation\.num_clients to at most 4"):
        part(5)
    with pytest.raises(ValueError, match=r"needs each training example's owner .* femnist, shakespeare, sentiment140"):
        natural.natural(np.zeros(3, np.int64), 2, 0, natural.NaturalParams())
    with pytest.raises(ValueError, match=r"\(2,\) owner ids for 3 training examples"):
        natural.natural(np.zeros(3, np.int64), 2, 0, natural.NaturalParams(), groups=np.array([0, 1]))


def test_femnist_writers_become_clients(tmp_path):
    rng = np.random.default_rng(15)
    users = {f"f{i:04d}_00": femnist_user(rng, n)[:2] for i, n in enumerate([2, 5, 1, 3])}
    write_leaf(tmp_path / "femnist", "train", "a.json", dict(list(users.items())[:2]))
    write_leaf(tmp_path / "femnist", "train", "b.json", dict(list(users.items())[2:]))
    write_leaf(tmp_path / "femnist", "test", "a.json", {"f0000_00": users["f0000_00"]})
    ds = leaf.load_femnist(tmp_path, NO)
    parts = PARTITIONERS.get("natural").obj(ds.y_train, 4, 0, natural.NaturalParams(), groups=ds.groups)
    pixels = {tuple(np.round(ds.x_train[p].ravel() * 255).astype(int)) for p in parts}
    want = {tuple(np.round(np.array(x) * 255).astype(int).ravel()) for x, _ in users.values()}
    assert pixels == want  # each client holds exactly one writer's images


def test_a_femnist_scenario_gives_each_client_one_writer_through_the_runtime(tmp_path, monkeypatch):
    """The runtime hands the writers to the natural partitioner and keeps them through the disk cache:
    a fresh runtime (reading the cache) gives the same partitions, each exactly one writer's examples."""
    from fedsim.runtime import Runtime
    from fedsim.scenario import load_scenario

    monkeypatch.setenv("FEDSIM_CACHE_DIR", str(tmp_path / "cache"))
    rng = np.random.default_rng(3)
    users = {f"f{k:04d}_00": femnist_user(rng, n)[:2] for k, n in enumerate((3, 5, 2))}
    write_leaf(tmp_path / "femnist", "train", "all.json", users)
    write_leaf(tmp_path / "femnist", "test", "all.json", {"f0000_00": femnist_user(rng, 2)[:2]})
    overrides = [f"data.dir={tmp_path}", "data.dataset=femnist", "data.partition={name: natural, shuffle_owners: false}",
                 "federation.num_clients=3", "federation.clients_per_round=3", "attack=null", "model=mlp"]
    sc = load_scenario("scenarios/quickstart.yaml", overrides)
    first = Runtime(sc)
    parts = first.partitions
    writers = first.data.groups
    assert sorted(len(p) for p in parts) == [2, 3, 5]
    assert all(len(set(writers[p].tolist())) == 1 for p in parts)  # one writer per client, whole
    again = Runtime(sc)  # from the disk cache: the writers survive it
    assert again.data.groups is not None and np.array_equal(np.asarray(again.data.groups), writers)
    assert [p.tolist() for p in again.partitions] == [p.tolist() for p in parts]
