"""A device's own data (node config `local-data`, fedsim/data/local.py) against independent oracles.

Each accepted form is written into tmp_path (PNG folders with Pillow, .npz, .npy pair, CSV) and
must load as the normalisation written out here by hand; the static per-dataset facts must match
what the real loaders produce; the ClientApp must train on a device's own data and keep the
partition of a node without it, and an attacker's behaviour must not change.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from uuid import uuid4

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict

from fedsim.client.app import make_client_app
from fedsim.client.steps import local_update
from fedsim.data.base import DataFileError
from fedsim.data.local import FACTS, dataset_facts, load_local
from fedsim.flower.compat import act_as_superlink, stamp_message_id
from fedsim.flower.local_grid import LocalGrid
from fedsim.registry import DATASETS
from fedsim.runs.folder import RunFolder
from fedsim.runs.results import read_rounds
from fedsim.runtime import Runtime, runtime_for
from fedsim.scenario import load_scenario
from fedsim.server.app import run_server
from fedsim.wire import pack_model

from conftest import data_dir

Image = pytest.importorskip("PIL.Image")
ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = str(ROOT / "scenarios/quickstart.yaml")


def facts(name: str, **params):
    return dataset_facts(DATASETS.get(name).spec_model()(name=name, **params))


def mnist_oracle(raw: np.ndarray) -> np.ndarray:
    """MNIST's normalisation written out: (pixel / 255 - 0.1307) / 0.3081, one channel."""
    return ((raw.astype(np.float64) / 255 - 0.1307) / 0.3081)[:, None].astype(np.float32)


def close(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == np.float32 and np.allclose(a, b, rtol=0, atol=1e-5)


def write_pngs(root: Path, images: np.ndarray, labels: list, mode: str) -> None:
    for i, (img, label) in enumerate(zip(images, labels)):
        folder = root / str(label)
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(img, mode).save(folder / f"{i:03d}.png")


@pytest.fixture
def grey():
    """Twelve 28x28 greyscale images with labels covering several classes."""
    rng = np.random.default_rng(1)
    return rng.integers(0, 256, (12, 28, 28), dtype=np.uint8), np.array([0, 3, 9, 3, 0, 1, 9, 9, 2, 5, 7, 3])


# --------------------------------------------------------------------------- the forms


def test_a_png_folder_of_class_indices_loads_in_class_order_normalised(tmp_path, grey):
    x, y = grey
    write_pngs(tmp_path / "imgs", x, list(y), "L")
    got_x, got_y = load_local(tmp_path / "imgs", facts("mnist"))
    order = np.lexsort((np.arange(len(y)), y))  # class folders in order, files by name within each
    assert got_y.dtype == np.int64 and got_y.tolist() == y[order].tolist()
    assert close(got_x, mnist_oracle(x[order]))


def test_rgb_pngs_become_greyscale_and_grey_pngs_become_rgb(tmp_path, grey):
    x, y = grey
    rgb_of_grey = np.repeat(x[..., None], 3, axis=3)  # R = G = B: luminance is that value exactly
    write_pngs(tmp_path / "rgb", rgb_of_grey, list(y), "RGB")
    got_x, _ = load_local(tmp_path / "rgb", facts("mnist"))
    order = np.lexsort((np.arange(len(y)), y))
    assert close(got_x, mnist_oracle(x[order]))

    small = np.random.default_rng(2).integers(0, 256, (4, 32, 32), dtype=np.uint8)
    write_pngs(tmp_path / "grey32", small, [1, 1, 4, 8], "L")
    got_x, got_y = load_local(tmp_path / "grey32", facts("cifar10"))
    mean, std = np.array([0.4914, 0.4822, 0.4465]), np.array([0.2023, 0.1994, 0.2010])  # pytorch-cifar's
    want = (small[:, None].astype(np.float64) / 255 - mean[None, :, None, None]) / std[None, :, None, None]
    assert got_y.tolist() == [1, 1, 4, 8] and close(got_x, want.astype(np.float32))
    honest = facts("cifar10", normalization="ood_fl_honest")
    mean2, std2 = np.array([125.3, 123.0, 113.9]) / 255, np.array([63.0, 62.1, 66.7]) / 255
    want2 = (small[:, None].astype(np.float64) / 255 - mean2[None, :, None, None]) / std2[None, :, None, None]
    assert close(load_local(tmp_path / "grey32", honest)[0], want2.astype(np.float32))


def test_class_name_folders_are_ranked_only_when_every_class_is_there(tmp_path):
    names = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
    img = np.full((2, 32, 32, 3), 7, dtype=np.uint8)
    for name in ("cat", "truck", "airplane"):
        write_pngs(tmp_path / "some", img, [name, name], "RGB")
    with pytest.raises(DataFileError, match=r"3 sub-folders named by class name.*by class index \(0\.\.9\)"):
        load_local(tmp_path / "some", facts("cifar10"))
    for name in names:
        (tmp_path / "some" / name).mkdir(exist_ok=True)
    _, got_y = load_local(tmp_path / "some", facts("cifar10"))
    assert got_y.tolist() == [0, 0, 3, 3, 9, 9]  # airplane, cat, truck by their sorted rank


def test_npz_npy_pair_and_csv_hold_the_same_examples(tmp_path, grey):
    x, y = grey
    want = mnist_oracle(x)
    np.savez(tmp_path / "a.npz", x=x, y=y)
    np.savez(tmp_path / "b.npz", x_train=x.reshape(12, 784).astype(np.float64), y_train=y.astype(np.int32),
             x_test=x[:2], y_test=y[:2])
    (tmp_path / "pair").mkdir()
    np.save(tmp_path / "pair" / "x.npy", x[:, None])  # NCHW
    np.save(tmp_path / "pair" / "y.npy", y)
    rows = np.column_stack([y, x.reshape(12, 784)])
    np.savetxt(tmp_path / "plain.csv", rows, fmt="%d", delimiter=",")
    header = "label," + ",".join(f"{r}x{c}" for r in range(1, 29) for c in range(1, 29))
    np.savetxt(tmp_path / "kaggle.csv", rows, fmt="%d", delimiter=",", header=header, comments="")
    for path in ("a.npz", "b.npz", "pair", "pair/x.npy", "plain.csv", "kaggle.csv"):
        got_x, got_y = load_local(tmp_path / path, facts("mnist"))
        assert got_y.tolist() == y.tolist() and close(got_x, want), path


def test_channels_last_and_flattened_colour_arrays(tmp_path):
    x = np.random.default_rng(3).integers(0, 256, (5, 3, 32, 32), dtype=np.uint8)
    y = np.arange(5)
    mean, std = np.array([0.4914, 0.4822, 0.4465]), np.array([0.2023, 0.1994, 0.2010])
    want = ((x / 255 - mean[None, :, None, None]) / std[None, :, None, None]).astype(np.float32)
    for name, arr in (("nhwc", x.transpose(0, 2, 3, 1)), ("flat", x.reshape(5, -1)), ("nchw", x)):
        np.savez(tmp_path / f"{name}.npz", x=arr, y=y)
        assert close(load_local(tmp_path / f"{name}.npz", facts("cifar10"))[0], want), name


# --------------------------------------------------------------------------- the errors


def test_a_wrong_image_size_is_an_error_naming_path_found_and_expected(tmp_path):
    write_pngs(tmp_path / "imgs", np.zeros((1, 32, 32, 3), dtype=np.uint8), [4], "RGB")
    with pytest.raises(DataFileError) as e:
        load_local(tmp_path / "imgs", facts("mnist"))
    msg = str(e.value)
    assert str(tmp_path / "imgs" / "4" / "000.png") in msg
    assert "images are 3x32x32, the scenario's model (dataset mnist) takes 1x28x28" in msg
    assert "size is not" in msg  # says no resizing happens

    np.savez(tmp_path / "rgb.npz", x=np.zeros((2, 28, 28, 3), np.uint8), y=np.zeros(2, int))
    with pytest.raises(DataFileError, match=r"rgb\.npz: images are 3x28x28 \(channels last\), .*takes 1x28x28"):
        load_local(tmp_path / "rgb.npz", facts("mnist"))
    np.savetxt(tmp_path / "short.csv", np.zeros((2, 1 + 64)), fmt="%d", delimiter=",")
    with pytest.raises(DataFileError, match=r"short\.csv: rows have 64 pixel values, .*mnist\) takes 1x28x28 = 784"):
        load_local(tmp_path / "short.csv", facts("mnist"))


def test_labels_out_of_range_and_pixels_not_raw_are_errors(tmp_path, grey):
    x, y = grey
    np.savez(tmp_path / "ten.npz", x=x, y=np.where(y == 9, 10, y))
    with pytest.raises(DataFileError, match=r"ten\.npz: labels must be in 0\.\.9 .*found 10 \(3 such labels\)"):
        load_local(tmp_path / "ten.npz", facts("mnist"))
    np.savez(tmp_path / "count.npz", x=x, y=y[:5])
    with pytest.raises(DataFileError, match="5 labels for 12 images"):
        load_local(tmp_path / "count.npz", facts("mnist"))
    np.savez(tmp_path / "normalised.npz", x=mnist_oracle(x), y=y)
    with pytest.raises(DataFileError, match=r"whole numbers in 0\.\.255 .*not normalised"):
        load_local(tmp_path / "normalised.npz", facts("mnist"))
    write_pngs(tmp_path / "bright", np.full((1, 8, 8), 200, np.uint8), [2], "L")
    with pytest.raises(DataFileError, match=r"bright: pixel values must be whole numbers in 0\.\.16 .*digits"):
        load_local(tmp_path / "bright", facts("digits"))
    (tmp_path / "bad" / "12").mkdir(parents=True)
    with pytest.raises(DataFileError, match=r"sub-folder '12' is not a class of dataset mnist \(classes 0\.\.9\)"):
        load_local(tmp_path / "bad", facts("mnist"))


def test_empty_missing_and_unknown_inputs_are_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataFileError, match=r"empty: a folder with neither class sub-folders"):
        load_local(tmp_path / "empty", facts("mnist"))
    for c in "012":
        (tmp_path / "hollow" / c).mkdir(parents=True)
    with pytest.raises(DataFileError, match=r"hollow: holds no examples"):
        load_local(tmp_path / "hollow", facts("mnist"))
    np.savez(tmp_path / "none.npz", x=np.zeros((0, 28, 28), np.uint8), y=np.zeros(0, int))
    with pytest.raises(DataFileError, match=r"none\.npz: holds no examples"):
        load_local(tmp_path / "none.npz", facts("mnist"))
    (tmp_path / "blank.csv").write_text("")
    with pytest.raises(DataFileError, match=r"blank\.csv: holds no examples"):
        load_local(tmp_path / "blank.csv", facts("mnist"))
    (tmp_path / "notes.txt").write_text("1,2,3\n")
    with pytest.raises(DataFileError, match=r"notes\.txt: unknown kind of file"):
        load_local(tmp_path / "notes.txt", facts("mnist"))
    with pytest.raises(DataFileError, match=r"nowhere: no such file or folder"):
        load_local(tmp_path / "nowhere", facts("mnist"))
    np.savez(tmp_path / "keys.npz", images=np.zeros((1, 28, 28)), labels=np.zeros(1))
    with pytest.raises(DataFileError, match=r"arrays x and y \(or x_train and y_train\), found \['images', 'labels'\]"):
        load_local(tmp_path / "keys.npz", facts("mnist"))
    (tmp_path / "stray" / "1").mkdir(parents=True)
    (tmp_path / "stray" / "1" / "readme.md").write_text("hi")
    with pytest.raises(DataFileError, match=r"readme\.md: not an image file"):
        load_local(tmp_path / "stray", facts("mnist"))


def test_an_image_folder_without_pillow_says_what_to_install(tmp_path, monkeypatch):
    write_pngs(tmp_path / "imgs", np.zeros((1, 28, 28), np.uint8), [0], "L")
    monkeypatch.setitem(sys.modules, "PIL", None)  # as on a device without Pillow: importing it fails
    with pytest.raises(ImportError, match=r"needs Pillow \(pip install pillow\), or give the data as \.npz"):
        load_local(tmp_path / "imgs", facts("mnist"))


# --------------------------------------------------------------------------- the facts vs the loaders


def test_every_training_dataset_has_facts():
    # southwest: an unlabelled edge-case pool, never trained on; shakespeare, sentiment140: text, and a
    # device's own data is read as images
    assert set(DATASETS.names()) - set(FACTS) == {"southwest", "shakespeare", "sentiment140"}


def test_digits_facts_match_the_loader():
    entry = DATASETS.get("digits")
    d = entry.obj(None, entry.params())
    f = facts("digits")
    assert (f.input_shape, f.num_classes) == (d.input_shape, d.num_classes)
    raw = np.rint(d.x_train * 16)  # the loader's pixels back on scikit-learn's 0..16 scale
    assert np.array_equal(raw / 16, d.x_train)
    from fedsim.data.local import _arrays, to_inputs

    x, y = _arrays(Path("digits"), raw, d.y_train, f)
    assert np.array_equal(to_inputs(x, f), d.x_train) and np.array_equal(y, d.y_train)


@pytest.mark.parametrize("name,file", [("mnist", "mnist.npz"), ("fashion_mnist", "fashion_mnist.npz"),
                                       ("ardis", "ardis_iv.npz")])
def test_real_dataset_facts_match_the_loader_bit_for_bit(tmp_path, name, file):
    folder = data_dir()
    if folder is None or not (folder / file).is_file():
        pytest.skip(f"{file} not found in ../shared/data or $FEDSIM_DATA_DIR")
    entry = DATASETS.get(name)
    d = entry.obj(folder, entry.params())
    f = facts(name)
    assert (f.input_shape, f.num_classes) == (d.input_shape, d.num_classes)
    with np.load(folder / file, allow_pickle=False) as z:
        raw_x, raw_y = z["x_train"][:3000], z["y_train"][:3000]
    np.savez(tmp_path / "own.npz", x=raw_x, y=raw_y)
    got_x, got_y = load_local(tmp_path / "own.npz", f)
    assert np.array_equal(got_x, d.x_train[:3000]) and np.array_equal(got_y, d.y_train[:3000])


def test_the_model_is_built_from_the_facts_without_loading_the_dataset():
    rt = Runtime(load_scenario(QUICKSTART, ["attack=null"]))
    shape = rt.model_shape
    rt.build_model()
    assert "data" not in rt.__dict__ and not any(k[0] == "dataset" for k in rt.cache)
    assert shape == (rt.data.input_shape, rt.data.num_classes) == ((1, 8, 8), 10)


# --------------------------------------------------------------------------- the ClientApp


def digits_npz(path: Path, n: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A device's own 8x8 digits (raw 0..16 pixels) and, independently, the inputs they must become."""
    rng = np.random.default_rng(seed)
    raw, y = rng.integers(0, 17, (n, 8, 8)), rng.integers(0, 10, n)
    np.savez(path, x=raw, y=y)
    return raw, y, (raw[:, None] / 16.0).astype(np.float32)


def train_message(rt, rnd: int = 1, **config) -> Message:
    act_as_superlink(1)
    content = RecordDict({"arrays": pack_model(rt.initial_weights(), rt.layout),
                          "config": ConfigRecord({"server-round": rnd, "lr": rt.lr(rnd), **config})})
    msg = Message(content, dst_node_id=7, message_type=MessageType.TRAIN)
    stamp_message_id(msg, str(uuid4()))
    return msg


def context(pid: int, **node) -> Context:
    return Context(run_id=1, node_id=7, node_config={"partition-id": pid, "num-partitions": 20, **node},
                   state=RecordDict(), run_config={})


def reply_of(app, msg, ctx) -> tuple[int, np.ndarray]:
    reply = app(msg, ctx)
    assert not reply.has_error(), reply.error
    return int(reply.content["metrics"]["num-examples"]), reply.content["update"]["delta"].numpy()


def test_a_node_with_local_data_trains_on_it_and_a_node_without_keeps_its_partition(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("FEDSIM_CACHE_DIR", str(tmp_path / "cache"))
    scenario = load_scenario(QUICKSTART, ["attack=null", f"name=local-{uuid4().hex[:8]}"])  # a fresh runtime
    rt = runtime_for(scenario)
    msg = train_message(rt)
    _, y, want_x = digits_npz(tmp_path / "own.npz", 37, seed=5)
    app = make_client_app(scenario)
    with caplog.at_level(logging.INFO, logger="fedsim.client"):
        n, delta = reply_of(app, msg, context(4, **{"local-data": str(tmp_path / "own.npz")}))
    assert n == 37
    assert not any(k[0] == "dataset" for k in rt.cache), "the central dataset was loaded for a local-data node"
    oracle = local_update(rt, 4, rt.initial_weights(), 1, msg.content["config"], data=(want_x, y)).delta
    assert np.array_equal(delta, oracle.numpy())
    assert any(r.name == "fedsim.client" and "round 1 partition 4 honest: 37 examples (local data), " in r.getMessage()
               for r in caplog.records)
    assert list((tmp_path / "cache").glob("local-data-*")), "the decoded local data was not cached on disk"

    n, delta = reply_of(app, train_message(rt), context(4))
    partition = rt.partitions[4]
    assert n == len(partition) != 37
    x_part, y_part = rt.data.x_train[partition], rt.data.y_train[partition]
    oracle = local_update(rt, 4, rt.initial_weights(), 1, {"server-round": 1}, data=(x_part, y_part)).delta
    assert np.array_equal(delta, oracle.numpy())


def test_a_changed_file_is_read_again_and_a_fresh_process_reads_the_disk_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDSIM_CACHE_DIR", str(tmp_path / "cache"))
    scenario = load_scenario(QUICKSTART, ["attack=null"])
    path = tmp_path / "own.npz"
    digits_npz(path, 10, seed=1)
    first = Runtime(scenario).local_data(str(path))

    def decode_again(*args):
        raise AssertionError("decoded again although the disk cache holds it")

    with monkeypatch.context() as m:
        m.setattr("fedsim.runtime.load_local", decode_again)
        again = Runtime(scenario).local_data(str(path))  # a fresh runtime, as in a new ClientApp process
    assert np.array_equal(again[0], first[0]) and np.array_equal(again[1], first[1])
    _, y, want = digits_npz(path, 12, seed=2)  # the device's data changes: size and time differ
    x2, y2 = Runtime(scenario).local_data(str(path))
    assert np.array_equal(x2, want) and np.array_equal(y2, y)


def test_an_attacker_ignores_local_data_and_detox_redundancy_refuses_it(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDSIM_CACHE_DIR", str(tmp_path / "cache"))
    scenario = load_scenario(QUICKSTART, [])
    rt = runtime_for(scenario)
    attacker = rt.attackers[0]
    digits_npz(tmp_path / "own.npz", 20, seed=3)
    app = make_client_app(scenario)
    own = {"local-data": str(tmp_path / "own.npz")}
    msg = train_message(rt, rnd=3)
    n_plain, delta_plain = reply_of(app, msg, context(attacker))
    n_local, delta_local = reply_of(app, msg, context(attacker, **own))
    assert n_local == n_plain == rt.client_size(attacker, attacking=True) != 20
    assert np.array_equal(delta_local, delta_plain)

    honest = next(p for p in range(20) if p not in rt.attackers)
    with pytest.raises(ValueError, match=r"local-data .*own\.npz: the server asks this node to train on partition 2's"):
        app(train_message(rt, **{"data-partition": 2}), context(honest, **own))


def test_one_run_mixes_a_local_data_node_with_partition_nodes(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDSIM_CACHE_DIR", str(tmp_path / "cache"))
    scenario = load_scenario(QUICKSTART, ["attack=null", "federation.rounds=2", "federation.num_clients=4",
                                          "federation.clients_per_round=4"])
    digits_npz(tmp_path / "own.npz", 23, seed=4)
    app = make_client_app(scenario)
    reported = {}

    def device(msg, ctx):  # partition 1's device holds its own data
        if int(ctx.node_config["partition-id"]) == 1:
            ctx = Context(run_id=ctx.run_id, node_id=ctx.node_id, state=ctx.state, run_config=ctx.run_config,
                          node_config={**ctx.node_config, "local-data": str(tmp_path / "own.npz")})
        reply = app(msg, ctx)
        if msg.metadata.message_type == MessageType.TRAIN and not reply.has_error():
            reported[int(ctx.node_config["partition-id"])] = int(reply.content["metrics"]["num-examples"])
        return reply

    run = RunFolder.create(scenario, tmp_path / "run")
    run_server(LocalGrid(device, 4), scenario, run)
    rounds = read_rounds(run)
    rt = runtime_for(scenario)
    assert len(rounds) == 2 and not any(r.get("rejected") for r in rounds)
    assert reported == {0: len(rt.partitions[0]), 1: 23, 2: len(rt.partitions[2]), 3: len(rt.partitions[3])}
