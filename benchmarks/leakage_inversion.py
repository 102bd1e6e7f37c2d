"""DLG, iDLG and Inverting Gradients on uploads made by fedsim's own client loop (docs/leakage.md).

Each upload is what a fedsim client sends: an untrained digits model (seed 0) trained by
`fedsim.training.train` at lr 0.1 on its examples, local − global. Cases: one image and one SGD
step (the first training example of classes 0..k), and four images in batches of two (two steps,
training examples 0-3 and 4-7). Prints a markdown row per (model, case, attack): the mean PSNR,
SSIM and label accuracy over the uploads and the attack's seconds per upload.

    .venv/bin/python benchmarks/leakage_inversion.py
"""

from __future__ import annotations

import copy
import time

import numpy as np
import torch

from fedsim.data.digits import DigitsParams, load_digits
from fedsim.leakage.base import LocalTraining, Observation
from fedsim.leakage.dlg import DLG, IDLG, DlgParams, IdlgParams
from fedsim.leakage.inverting import InvertingGradients, InvertingParams
from fedsim.leakage.metrics import score
from fedsim.models import ModelLayout
from fedsim.registry import MODELS
from fedsim.training import TrainConfig, train

ATTACKS = {"dlg": lambda: DLG(DlgParams()), "idlg": lambda: IDLG(IdlgParams()),
           "inverting_gradients": lambda: InvertingGradients(InvertingParams())}


def model_of(data, name: str, **params) -> torch.nn.Module:
    entry = MODELS.get(name)
    torch.manual_seed(0)
    return entry.obj(tuple(data.x_train.shape[1:]), 10, entry.params(**params))


def upload(data, model, idx: list[int], batch_size: int | None = None, lr: float = 0.1):
    """One client's upload of `idx` and the server's Observation of it, with the true examples."""
    x, y = data.x_train[idx], data.y_train[idx]
    layout = ModelLayout.of(model)
    weights, local = layout.flatten_model(model), copy.deepcopy(model)
    batch = batch_size or len(idx)
    train(local, x, y, TrainConfig(epochs=1, batch_size=batch, lr=lr), seed=0)
    model.eval()
    obs = Observation(round=1, kind="upload", model=model, layout=layout, weights=weights,
                      update=layout.flatten_model(local) - weights,
                      training=LocalTraining(lr, 1, batch, None, 0.0, 0.0, len(idx)), input_shape=tuple(x.shape[1:]),
                      num_classes=10, bounds=(float(data.x_train.min()), float(data.x_train.max())),
                      generator=torch.Generator().manual_seed(0), device=torch.device("cpu"), clients=(0,))
    return obs, torch.from_numpy(x), torch.from_numpy(y)


def main() -> None:
    torch.set_num_threads(1)
    data = load_digits(None, DigitsParams())
    first = [int(np.flatnonzero(data.y_train == c)[0]) for c in range(10)]
    print("| model | upload | attack | uploads | PSNR dB | SSIM | label acc. | seconds |")
    print("|---|---|---|---|---|---|---|---|")
    for name, params, singles, quads, attacks in (
        ("mlp", {}, 5, 2, ATTACKS),
        ("lenet", {"dropout": False}, 3, 1, ATTACKS),
        ("lenet", {}, 3, 0, {k: ATTACKS[k] for k in ("idlg", "inverting_gradients")}),  # dropout on
    ):
        model = model_of(data, name, **params)
        label = name if name == "mlp" else f"lenet, dropout {'off' if params else 'on'}"
        cases = [("1 image, 1 step", [[first[c]] for c in range(singles)], None)]
        if quads:
            cases.append(("4 images, batch 2, 2 steps", [[0, 1, 2, 3], [4, 5, 6, 7]][:quads], 2))
        for case, groups, batch in cases:
            for attack, make in attacks.items():
                rows = []
                for idx in groups:
                    obs, tx, ty = upload(data, model, idx, batch)
                    started = time.perf_counter()
                    got = score(make().reconstruct(obs), tx, ty, obs.bounds)
                    got["seconds"] = time.perf_counter() - started
                    rows.append(got)
                mean = {k: float(np.mean([r[k] for r in rows])) for k in ("psnr_mean", "ssim_mean", "label_accuracy", "seconds")}
                print(f"| {label} | {case} | {attack} | {len(groups)} | {mean['psnr_mean']:.1f} | {mean['ssim_mean']:.3f} | "
                      f"{mean['label_accuracy']:.2f} | {mean['seconds']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
