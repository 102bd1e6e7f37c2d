"""Dataset loaders: the shared .npz files, and each upstream format written here from known arrays."""

from __future__ import annotations

import gzip
import os
import pickle
from pathlib import Path

import numpy as np
import pytest

from fedsim.data import loaders as L
from fedsim.data.base import DATA_DIR_ENV, DataFileError
from fedsim.registry import DATASETS

NO = L.NoParams()
CIFAR_TEST_MEAN, CIFAR_TEST_STD = L.CIFAR_NORMALIZATIONS["ood_fl_test"]


def _shared_dir() -> Path:
    env = os.environ.get(DATA_DIR_ENV)
    d = Path(env) if env else Path(__file__).resolve().parents[2] / "shared" / "data"
    if not d.is_dir():
        pytest.skip(f"{d}: ../shared/data not found; set {DATA_DIR_ENV}")
    return d


def _need(name: str) -> Path:
    d = _shared_dir()
    if not (d / name).is_file():
        pytest.skip(f"{d / name} not found; set {DATA_DIR_ENV} to a folder holding it")
    return d


def _denorm(x: np.ndarray, mean, std) -> np.ndarray:
    """Back to 0..255 pixel values, for exact comparison with the raw uint8 arrays."""
    shape = (1, len(mean), 1, 1)
    v = (x * np.asarray(std, np.float32).reshape(shape) + np.asarray(mean, np.float32).reshape(shape)) * 255
    return np.rint(v).astype(np.int64)


# --------------------------------------------------------------------------- shared/data


@pytest.mark.parametrize(
    "name, loader, mean, std, train_counts, test_counts",
    [
        (
            "mnist", L.load_mnist, L.MNIST_MEAN, L.MNIST_STD,
            [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949],
            [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009],
        ),
        ("fashion_mnist", L.load_fashion_mnist, L.FASHION_MEAN, L.FASHION_STD, [6000] * 10, [1000] * 10),
    ],
)
def test_mnist_family_from_shared_npz(name, loader, mean, std, train_counts, test_counts):
    d = _need(f"{name}.npz")
    ds = loader(d, NO)
    assert ds.name == name and ds.num_classes == 10
    assert ds.x_train.shape == (60000, 1, 28, 28) and ds.x_test.shape == (10000, 1, 28, 28)
    assert ds.x_train.dtype == np.float32 and ds.y_train.dtype == np.int64 and ds.y_test.dtype == np.int64
    assert np.bincount(ds.y_train, minlength=10).tolist() == train_counts
    assert np.bincount(ds.y_test, minlength=10).tolist() == test_counts
    assert abs(float(ds.x_train.mean(dtype=np.float64))) < 2e-3
    assert abs(float(ds.x_train.std(dtype=np.float64)) - 1) < 2e-3
    raw = np.load(d / f"{name}.npz")
    np.testing.assert_array_equal(_denorm(ds.x_test[:500], mean, std)[:, 0], raw["x_test"][:500])
    np.testing.assert_array_equal(ds.y_train, raw["y_train"])


def test_ardis_from_shared_npz():
    d = _need("ardis_iv.npz")
    ds = L.load_ardis(d, NO)
    assert ds.x_train.shape == (6600, 1, 28, 28) and ds.x_test.shape == (1000, 1, 28, 28)
    assert ds.x_train.dtype == np.float32 and ds.y_train.dtype == np.int64
    assert np.bincount(ds.y_train).tolist() == [660] * 10
    assert np.bincount(ds.y_test).tolist() == [100] * 10
    assert np.all(np.diff(ds.y_train) >= 0), "upstream order is sorted by class"
    # MNIST constants, so ARDIS is slightly brighter than MNIST: mean ~0.07, std ~1.03.
    assert abs(float(ds.x_train.mean())) < 0.15 and abs(float(ds.x_train.std()) - 1) < 0.1
    raw = np.load(d / "ardis_iv.npz")
    np.testing.assert_array_equal(_denorm(ds.x_train, L.MNIST_MEAN, L.MNIST_STD)[:, 0], raw["x_train"])
    # White on black like MNIST: the border is background (the minimum value).
    assert np.median(ds.x_train[:, 0, 0, :]) == pytest.approx(-0.1307 / 0.3081, abs=1e-5)


def test_southwest_from_shared_npz():
    d = _need("southwest_edgecase.npz")
    ds = L.load_southwest(d, L.CifarParams())
    assert ds.x_train.shape == (784, 3, 32, 32) and ds.x_test.shape == (196, 3, 32, 32)
    assert ds.x_train.dtype == np.float32
    assert (ds.y_train == -1).all() and (ds.y_test == -1).all() and ds.y_train.dtype == np.int64
    raw = np.load(d / "southwest_edgecase.npz")
    np.testing.assert_array_equal(
        _denorm(ds.x_train, CIFAR_TEST_MEAN, CIFAR_TEST_STD), raw["x_train"].transpose(0, 3, 1, 2)
    )
    # Each group of 4 is one photo at 0/90/180/270 degrees: still true after HWC -> CHW.
    np.testing.assert_array_equal(np.rot90(ds.x_test[0], 1, axes=(1, 2)), ds.x_test[1])


# --------------------------------------------------------------------------- IDX


def _write_idx(path: Path, a: np.ndarray, code: int = 0x08) -> None:
    body = bytes([0, 0, code, a.ndim]) + np.asarray(a.shape, ">u4").tobytes() + a.tobytes()
    with (gzip.open if path.name.endswith(".gz") else open)(path, "wb") as f:
        f.write(body)


def _tiny_mnist(rng) -> dict[str, np.ndarray]:
    return {
        "x_train": rng.integers(0, 256, (7, 28, 28), dtype=np.uint8),
        "y_train": rng.integers(0, 10, 7).astype(np.uint8),
        "x_test": rng.integers(0, 256, (3, 28, 28), dtype=np.uint8),
        "y_test": rng.integers(0, 10, 3).astype(np.uint8),
    }


@pytest.mark.parametrize("sub, gz", [("mnist", {"x_train", "y_test"}), ("", set()), ("mnist", set(L.SPLITS))])
def test_idx_files_load_back_exactly(tmp_path, sub, gz):
    arrays = _tiny_mnist(np.random.default_rng(0))
    folder = tmp_path / sub
    folder.mkdir(exist_ok=True)
    for k, stem in L._IDX_STEMS.items():
        _write_idx(folder / (stem + (".gz" if k in gz else "")), arrays[k])
        assert np.array_equal(L.read_idx(folder / (stem + (".gz" if k in gz else ""))), arrays[k])
    ds = L.load_mnist(tmp_path, NO)
    assert ds.x_train.shape == (7, 1, 28, 28) and ds.x_train.dtype == np.float32
    np.testing.assert_array_equal(_denorm(ds.x_train, L.MNIST_MEAN, L.MNIST_STD)[:, 0], arrays["x_train"])
    np.testing.assert_array_equal(_denorm(ds.x_test, L.MNIST_MEAN, L.MNIST_STD)[:, 0], arrays["x_test"])
    assert ds.y_train.dtype == np.int64 and ds.y_train.tolist() == arrays["y_train"].tolist()
    assert ds.y_test.tolist() == arrays["y_test"].tolist()


def test_idx_dotted_spelling_and_fashion_folder(tmp_path):
    arrays = _tiny_mnist(np.random.default_rng(1))
    (tmp_path / "fashion_mnist").mkdir()
    for k, stem in L._IDX_STEMS.items():
        _write_idx(tmp_path / "fashion_mnist" / stem.replace("-idx", ".idx"), arrays[k])
    ds = L.load_fashion_mnist(tmp_path, NO)
    np.testing.assert_array_equal(_denorm(ds.x_test, L.FASHION_MEAN, L.FASHION_STD)[:, 0], arrays["x_test"])


def test_idx_reader_other_dtypes_big_endian(tmp_path):
    a = np.arange(-6, 6, dtype=">i2").reshape(3, 4)
    _write_idx(tmp_path / "a.idx", a, code=0x0B)
    b = L.read_idx(tmp_path / "a.idx")
    assert b.dtype == np.int16 and b.dtype.isnative and np.array_equal(b, a)


def test_idx_bad_magic_truncated_and_count_mismatch(tmp_path):
    bad = tmp_path / "train-images-idx3-ubyte"
    bad.write_bytes(b"\x08\x03\x00\x00" + bytes(100))
    with pytest.raises(DataFileError, match="bad IDX magic") as e:
        L.read_idx(bad)
    assert str(bad) in str(e.value)

    short = tmp_path / "short.gz"
    _write_idx(short, np.zeros((2, 28, 28), np.uint8))
    with gzip.open(short, "rb") as f:
        body = f.read()
    with gzip.open(short, "wb") as f:
        f.write(body[:-5])
    with pytest.raises(DataFileError, match="truncated"):
        L.read_idx(short)

    arrays = _tiny_mnist(np.random.default_rng(2))
    arrays["y_test"] = arrays["y_test"][:2]
    for k, stem in L._IDX_STEMS.items():
        _write_idx(tmp_path / stem, arrays[k])
    with pytest.raises(DataFileError, match="2 labels for 3 images") as e:
        L.load_mnist(tmp_path, NO)
    assert "t10k-labels-idx1-ubyte" in str(e.value)


def test_incomplete_idx_set_names_missing_file(tmp_path):
    (tmp_path / "mnist").mkdir()
    _write_idx(tmp_path / "mnist" / "train-images-idx3-ubyte.gz", np.zeros((1, 28, 28), np.uint8))
    with pytest.raises(DataFileError, match="t10k-labels-idx1-ubyte"):
        L.load_mnist(tmp_path, NO)


# --------------------------------------------------------------------------- npz validation


def test_npz_wrong_shape_and_object_arrays_are_refused(tmp_path):
    np.savez(tmp_path / "mnist.npz", x_train=np.zeros((2, 28, 27), np.uint8), y_train=np.zeros(2, np.int64),
             x_test=np.zeros((1, 28, 28), np.uint8), y_test=np.zeros(1, np.int64))
    with pytest.raises(DataFileError, match=r"x_train has shape \(2, 28, 27\)"):
        L.load_mnist(tmp_path, NO)
    np.savez(tmp_path / "ardis_iv.npz", x_train=np.array([{"a": 1}], dtype=object), y_train=np.zeros(1),
             x_test=np.zeros(1), y_test=np.zeros(1))
    with pytest.raises(DataFileError, match="ardis_iv.npz"):
        L.load_ardis(tmp_path, NO)


# --------------------------------------------------------------------------- ARDIS CSV


def _write_ardis(folder: Path, rng) -> dict[str, np.ndarray]:
    """The upstream layout: np.loadtxt-style whitespace-separated floats, one image / one-hot row per line."""
    folder.mkdir(exist_ok=True)
    out = {}
    for split, n in (("train", 6), ("test", 4)):
        x = rng.integers(0, 256, (n, 28, 28)).astype(np.float64)
        y = rng.integers(0, 10, n)
        np.savetxt(folder / f"ARDIS_{split}_2828.csv", x.reshape(n, 784))
        np.savetxt(folder / f"ARDIS_{split}_labels.csv", np.eye(10)[y])
        out[f"x_{split}"], out[f"y_{split}"] = x, y
    return out


@pytest.mark.parametrize("sub", ["ardis", ""])
def test_ardis_csv_format(tmp_path, sub):
    raw = _write_ardis(tmp_path / sub, np.random.default_rng(3))
    ds = L.load_ardis(tmp_path, NO)
    assert ds.x_train.shape == (6, 1, 28, 28) and ds.x_test.shape == (4, 1, 28, 28)
    for split in ("train", "test"):
        x, y = getattr(ds, f"x_{split}"), getattr(ds, f"y_{split}")
        np.testing.assert_array_equal(_denorm(x, L.MNIST_MEAN, L.MNIST_STD)[:, 0], raw[f"x_{split}"])
        assert y.dtype == np.int64 and y.tolist() == raw[f"y_{split}"].tolist()


def test_ardis_csv_rejects_bad_labels_and_pixels(tmp_path):
    _write_ardis(tmp_path, np.random.default_rng(4))
    np.savetxt(tmp_path / "ARDIS_test_labels.csv", np.full((4, 10), 0.1))
    with pytest.raises(DataFileError, match="ARDIS_test_labels.csv.*not one-hot"):
        L.load_ardis(tmp_path, NO)
    _write_ardis(tmp_path, np.random.default_rng(4))
    np.savetxt(tmp_path / "ARDIS_train_2828.csv", np.full((6, 784), 0.5))
    with pytest.raises(DataFileError, match="ARDIS_train_2828.csv.*whole numbers"):
        L.load_ardis(tmp_path, NO)


# --------------------------------------------------------------------------- CIFAR-10 pickles


def _write_cifar(folder: Path, rng) -> dict[str, np.ndarray]:
    """Tiny official-format batches; protocols 2, 4 and 5 exercise every allowed numpy global."""
    folder.mkdir(parents=True)
    images, labels = {}, {}
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for i, name in enumerate(names):
        n = 2 if name != "test_batch" else 3
        chw = rng.integers(0, 256, (n, 3, 32, 32), dtype=np.uint8)
        y = rng.integers(0, 10, n).tolist()
        batch = {
            b"batch_label": f"training batch {i + 1} of 5".encode(),
            b"labels": y,
            b"data": chw.reshape(n, 3072),  # R plane, G plane, B plane, each row-major
            b"filenames": [f"img_{i}_{j}.png".encode() for j in range(n)],
        }
        with open(folder / name, "wb") as f:
            pickle.dump(batch, f, protocol=(2, 4, 5)[i % 3])
        images[name], labels[name] = chw, y
    return {
        "x_train": np.concatenate([images[n] for n in names[:5]]),
        "y_train": np.array(sum((labels[n] for n in names[:5]), [])),
        "x_test": images["test_batch"],
        "y_test": np.array(labels["test_batch"]),
    }


@pytest.mark.parametrize("sub", ["cifar-10-batches-py", "cifar10/cifar-10-batches-py"])
def test_cifar10_official_pickles(tmp_path, sub):
    raw = _write_cifar(tmp_path / sub, np.random.default_rng(5))
    ds = L.load_cifar10(tmp_path, L.CifarParams())
    assert ds.x_train.shape == (10, 3, 32, 32) and ds.x_test.shape == (3, 3, 32, 32) and ds.num_classes == 10
    assert ds.x_train.dtype == np.float32 and ds.y_train.dtype == np.int64
    np.testing.assert_array_equal(_denorm(ds.x_train, CIFAR_TEST_MEAN, CIFAR_TEST_STD), raw["x_train"])
    np.testing.assert_array_equal(_denorm(ds.x_test, CIFAR_TEST_MEAN, CIFAR_TEST_STD), raw["x_test"])
    assert ds.y_train.tolist() == raw["y_train"].tolist() and ds.y_test.tolist() == raw["y_test"].tolist()
    # Channel order spelled out: byte 1024 + 32*5 + 7 of a row is G at (5, 7).
    row = raw["x_test"].reshape(3, 3072)[1]
    expect = (row[1024 + 32 * 5 + 7] / 255 - CIFAR_TEST_MEAN[1]) / CIFAR_TEST_STD[1]
    assert ds.x_test[1, 1, 5, 7] == pytest.approx(expect, abs=1e-5)

    honest = L.load_cifar10(tmp_path, L.CifarParams(normalization="ood_fl_honest"))
    m, s = L.CIFAR_NORMALIZATIONS["ood_fl_honest"]
    np.testing.assert_array_equal(_denorm(honest.x_train, m, s), raw["x_train"])


class _Evil:
    """Unpickling this would call `func(arg)`."""

    def __init__(self, func, arg) -> None:
        self.func, self.arg = func, arg

    def __reduce__(self):
        return (self.func, (self.arg,))


def test_cifar10_pickle_with_forbidden_global_is_refused(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    _write_cifar(folder, np.random.default_rng(6))
    marker = tmp_path / "pwned"
    evil = {b"data": np.zeros((1, 3072), np.uint8), b"labels": [0], b"x": _Evil(os.system, f"touch {marker}")}
    with open(folder / "test_batch", "wb") as f:
        pickle.dump(evil, f)
    with pytest.raises(DataFileError, match=r"refused global (posix|nt)\.system") as e:
        L.load_cifar10(tmp_path, L.CifarParams())
    assert "test_batch" in str(e.value)
    assert not marker.exists()

    code = f"open({str(marker)!r}, 'w').close()"
    for proto in (0, 2, 4, 5):
        (tmp_path / "evil.pkl").write_bytes(pickle.dumps(_Evil(eval, code), protocol=proto))
        with pytest.raises(DataFileError, match=r"refused global (builtins|__builtin__)\.eval"):
            L.safe_unpickle(tmp_path / "evil.pkl")
        assert not marker.exists()


def test_cifar10_bad_batch_content(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    _write_cifar(folder, np.random.default_rng(7))
    with open(folder / "data_batch_3", "wb") as f:
        pickle.dump({b"data": np.zeros((2, 3000), np.uint8), b"labels": [0, 1]}, f)
    with pytest.raises(DataFileError, match=r"data_batch_3: b'data' is uint8 \(2, 3000\)"):
        L.load_cifar10(tmp_path, L.CifarParams())


def test_cifar_params_forbid_unknown():
    with pytest.raises(ValueError):
        L.CifarParams(normalization="imagenet")
    with pytest.raises(ValueError):
        L.NoParams(normalization="ood_fl_test")


# --------------------------------------------------------------------------- Southwest pickles


@pytest.mark.parametrize("sub", ["southwest", ""])
def test_southwest_original_pickles(tmp_path, sub):
    rng = np.random.default_rng(8)
    folder = tmp_path / sub
    folder.mkdir(exist_ok=True)
    raw = {"train": rng.integers(0, 256, (8, 32, 32, 3), dtype=np.uint8),
           "test": rng.integers(0, 256, (4, 32, 32, 3), dtype=np.uint8)}
    for split, a in raw.items():
        with open(folder / f"southwest_images_new_{split}.pkl", "wb") as f:
            pickle.dump(a, f, protocol=2)
    m, s = L.CIFAR_NORMALIZATIONS["ood_fl_honest"]
    ds = L.load_southwest(tmp_path, L.CifarParams(normalization="ood_fl_honest"))
    assert ds.x_train.shape == (8, 3, 32, 32) and (ds.y_test == -1).all()
    np.testing.assert_array_equal(_denorm(ds.x_train, m, s), raw["train"].transpose(0, 3, 1, 2))
    np.testing.assert_array_equal(_denorm(ds.x_test, m, s), raw["test"].transpose(0, 3, 1, 2))


# --------------------------------------------------------------------------- missing files


@pytest.mark.parametrize(
    "loader, params, expected",
    [
        (L.load_mnist, NO, ["mnist.npz", "mnist/", "train-images-idx3-ubyte[.gz]", "t10k-labels-idx1-ubyte"]),
        (L.load_fashion_mnist, NO, ["fashion_mnist.npz", "fashion_mnist/"]),
        (L.load_ardis, NO, ["ardis_iv.npz", "ardis/", "ARDIS_train_2828.csv", "ARDIS_test_labels.csv"]),
        (L.load_cifar10, L.CifarParams(), ["cifar-10-batches-py/", "cifar10/cifar-10-batches-py/",
                                           "test_batch"]),
        (L.load_southwest, L.CifarParams(), ["southwest_edgecase.npz", "southwest_images_new_train.pkl"]),
    ],
)
def test_missing_files_name_expected_paths(tmp_path, loader, params, expected):
    with pytest.raises(DataFileError) as e:
        loader(tmp_path, params)
    msg = str(e.value)
    for part in expected:
        assert part in msg
    assert f"{tmp_path}/" in msg


def test_all_loaders_registered():
    for name, params in [("mnist", L.NoParams), ("fashion_mnist", L.NoParams), ("ardis", L.NoParams),
                         ("cifar10", L.CifarParams), ("southwest", L.CifarParams)]:
        entry = DATASETS.get(name)
        assert entry.params is params and entry.summary
