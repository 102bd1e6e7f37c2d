"""Local training and evaluation loops, shared by honest clients, attackers and the server."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from torch import nn


@dataclass(frozen=True)
class TrainConfig:
    epochs: int
    batch_size: int
    lr: float
    momentum: float = 0.0
    weight_decay: float = 0.0


def train(
    model: nn.Module,
    x: np.ndarray,
    y: np.ndarray,
    cfg: TrainConfig,
    seed: int,
    after_step: Callable[[int, bool], None] | None = None,
) -> dict:
    """Plain SGD epochs over (x, y); deterministic for a given seed on one thread.

    `after_step(batch_index, last_of_epoch)` runs after each optimizer step (PGD projection uses it).
    Returns the mean training loss of the last epoch and the number of steps.
    """
    torch.manual_seed(seed)  # dropout masks
    gen = torch.Generator().manual_seed(seed)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    model.train()
    steps, last_loss = 0, float("nan")
    n = len(xt)
    for _ in range(cfg.epochs):
        order = torch.randperm(n, generator=gen)
        total, count = 0.0, 0
        num_batches = (n + cfg.batch_size - 1) // cfg.batch_size
        for b in range(num_batches):
            idx = order[b * cfg.batch_size : (b + 1) * cfg.batch_size]
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(model(xt[idx]), yt[idx])
            loss.backward()
            opt.step()
            steps += 1
            if after_step is not None:
                after_step(b, b == num_batches - 1)
            total += loss.item() * len(idx)
            count += len(idx)
        last_loss = total / max(count, 1)
    return {"loss": last_loss, "steps": steps}


@torch.no_grad()
@torch.no_grad()
def predict(model: nn.Module, x: np.ndarray, batch_size: int = 256, channels_last: bool = False) -> tuple[np.ndarray, torch.Tensor]:
    """Predicted classes and logits, in eval mode, batch by batch.

    `channels_last` runs image batches ([N, C, H, W]) in NHWC layout; the model must already be in
    that layout (`model.to(memory_format=torch.channels_last)`). On CPU, oneDNN's convolutions are
    about 1.5x faster that way (LeNet on MNIST, measured in benchmarks/overhead.py's setting).
    """
    model.eval()
    outs = []
    for i in range(0, len(x), batch_size):
        batch = torch.from_numpy(x[i : i + batch_size])
        if channels_last and batch.ndim == 4:
            batch = batch.contiguous(memory_format=torch.channels_last)
        outs.append(model(batch))
    logits = torch.cat(outs) if outs else torch.empty(0)
    return logits.argmax(1).numpy(), logits


@torch.no_grad()
def evaluate(model: nn.Module, x: np.ndarray, y: np.ndarray, batch_size: int = 256) -> dict:
    """Top-1 accuracy and mean cross-entropy of `model` on (x, y)."""
    if len(x) == 0:
        return {"accuracy": float("nan"), "loss": float("nan")}
    pred, logits = predict(model, x, batch_size)
    loss = nn.functional.cross_entropy(logits, torch.from_numpy(y)).item()
    return {"accuracy": float((pred == y).mean()), "loss": float(loss)}


def target_rate(model: nn.Module, x: np.ndarray, targets: np.ndarray, batch_size: int = 256) -> float:
    """Share of inputs classified as the attacker's label: the backdoor success rate on an edge/trigger set."""
    if len(x) == 0:
        return float("nan")
    pred, _ = predict(model, x, batch_size)
    return float((pred == targets).mean())
