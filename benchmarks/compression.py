"""Upload codecs on LeNet (28x28) and VGG-9 (32x32x3): compression ratio and encode+decode cost.

Run: `.venv/bin/python benchmarks/compression.py [--quick] [--accuracy]`. For each model, one local
epoch on 300 random samples (batch 32, one thread) gives a real update and the time it takes; each
codec then encodes that update (second upload, so warm starts and residuals are in play) and decodes
it. Printed per codec: payload bytes (sum of array bytes), the ratio to the float32 update, the ratio
of serialized Flower records (what `bytes_up` counts), the relative error of the decoded first
upload, and encode+decode time as a share of the epoch. `--accuracy` adds the final accuracy of a
5-round quickstart run (digits, in-process grid) per codec. No dataset is read from disk except the
digits set scikit-learn ships. Asserts nothing about time.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import tempfile
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent

import numpy as np  # noqa: E402
import torch  # noqa: E402
from flwr.app import RecordDict  # noqa: E402
from fedsim.flower.compat import recorddict_size  # noqa: E402

from fedsim.models.layout import ModelLayout  # noqa: E402
from fedsim.registry import COMPRESSORS, MODELS  # noqa: E402
from fedsim.training import TrainConfig, train  # noqa: E402
from fedsim.wire import pack_payload  # noqa: E402

CODECS = [
    ("none", {}),
    ("fp16", {}),
    ("topk", {"fraction": 0.01}),
    ("randomk", {"fraction": 0.01}),
    ("qsgd", {"levels": 127}),
    ("qsgd", {"levels": 7}),
    ("sign", {}),
    ("ternary", {}),
    ("powersgd", {"rank": 1}),
    ("powersgd", {"rank": 2}),
    ("accordion", {}),
    ("accordion", {"codec": "topk"}),
]
MODELS_TO_RUN = [("lenet", (1, 28, 28)), ("vgg9", (3, 32, 32))]


def label(name: str, params: dict) -> str:
    return name + ("(" + ",".join(f"{k}={v}" for k, v in params.items()) + ")" if params else "")


def make_codec(name: str, params: dict):
    entry = COMPRESSORS.get(name)
    return entry.obj(entry.params(**params))


def local_epoch(model_name: str, shape: tuple[int, ...]) -> tuple[ModelLayout, torch.Tensor, float]:
    """(layout, update of one epoch on 300 random samples, seconds the epoch took)."""
    entry = MODELS.get(model_name)
    torch.manual_seed(0)
    model = entry.obj(shape, 10, entry.params())
    layout = ModelLayout.of(model)
    before = layout.flatten_model(model)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((300, *shape)).astype(np.float32)
    y = rng.integers(0, 10, size=300).astype(np.int64)
    start = time.perf_counter()
    train(model, x, y, TrainConfig(epochs=1, batch_size=32, lr=0.01, momentum=0.9), seed=0)
    secs = time.perf_counter() - start
    return layout, layout.flatten_model(model) - before, secs


def record_bytes(payload: dict[str, np.ndarray]) -> int:
    return recorddict_size(RecordDict({"update": pack_payload(payload)}))


def measure(codec, layout: ModelLayout, delta: torch.Tensor, repeats: int) -> dict:
    first, state = codec.encode(delta, layout, {})
    err = float(torch.linalg.vector_norm(codec.decode(first, layout) - delta) / torch.linalg.vector_norm(delta))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        payload, _ = codec.encode(delta, layout, state)
        codec.decode(payload, layout)
        times.append(time.perf_counter() - start)
    return {"bytes": sum(a.nbytes for a in payload.values()), "wire": record_bytes(payload), "err": err,
            "secs": statistics.median(times)}


def quickstart_accuracy(name: str, params: dict, rounds: int) -> tuple[float, float | None, int]:
    from fedsim.flower.local_grid import LocalGrid

    from fedsim.client.app import make_client_app
    from fedsim.runs.folder import RunFolder
    from fedsim.runs.results import read_rounds
    from fedsim.scenario import load_scenario
    from fedsim.server.app import run_server

    spec = "{" + ", ".join([f"name: {name}"] + [f"{k}: {v}" for k, v in params.items()]) + "}"
    scenario = load_scenario(_HERE.parent / "scenarios/quickstart.yaml", [f"federation.rounds={rounds}", f"compression={spec}"])
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = RunFolder.create(scenario, tmp).path
        run_server(LocalGrid(make_client_app(scenario), scenario.federation.num_clients), scenario, run_dir)
        rows = read_rounds(run_dir)
    return rows[-1]["main_accuracy"], rows[-1].get("backdoor_success"), sum(r["bytes_up"] for r in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one timing repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--accuracy", action="store_true", help="also run a 5-round quickstart per codec")
    args = parser.parse_args()
    torch.set_num_threads(1)
    repeats = 1 if args.quick else args.repeats
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"torch {torch.__version__}, 1 thread, median of {repeats} encode+decode, load average {load}")

    for model_name, shape in MODELS_TO_RUN:
        layout, delta, epoch_s = local_epoch(model_name, shape)
        print(f"\n{model_name} {shape}: d = {layout.dim}, float32 update {4 * layout.dim} B, "
              f"one local epoch (300 samples, batch 32) {epoch_s:.2f} s")
        print(f"{'codec':<32}{'bytes':>10}{'ratio':>9}{'wire ratio':>11}{'rel err':>9}{'enc+dec ms':>12}{'% epoch':>9}")
        base_wire = None
        for name, params in CODECS:
            m = measure(make_codec(name, params), layout, delta, repeats)
            base_wire = base_wire or m["wire"]
            print(f"{label(name, params):<32}{m['bytes']:>10}{4 * layout.dim / m['bytes']:>9.1f}"
                  f"{base_wire / m['wire']:>11.1f}{m['err']:>9.3f}{m['secs'] * 1e3:>12.1f}{100 * m['secs'] / epoch_s:>9.1f}")

    if args.accuracy:
        logging.getLogger("flwr").setLevel(logging.WARNING)  # Flower prints every round's metrics
        print("\nquickstart (digits MLP, 5 rounds, default min_size keeps the 64x10 layer raw)")
        print(f"{'codec':<32}{'accuracy':>10}{'backdoor':>10}{'bytes up':>12}")
        for name, params in CODECS:
            acc, bd, up = quickstart_accuracy(name, params, 5)
            print(f"{label(name, params):<32}{acc:>10.3f}{(bd if bd is not None else float('nan')):>10.3f}{up:>12}")


if __name__ == "__main__":
    main()
