"""Local training and evaluation loops, shared by honest clients, attackers and the server."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from torch import nn
from torch.optim.sgd import sgd as torch_sgd  # the functional form torch.optim.SGD.step calls


class SGD:
    """torch's SGD (momentum, weight decay) through its functional form (`torch.optim.sgd.sgd`).

    The same update as `torch.optim.SGD`, bit for bit (tested), without the `Optimizer` class,
    whose first use imports `torch._dynamo` (1.6-2 s of CPU per process, measured): a cost every
    Ray actor and every deployed ClientApp process (one per message) paid before its first step.
    Like `torch.optim.SGD`, a parameter without a gradient (frozen) is skipped.
    """

    def __init__(self, params, lr: float, momentum: float = 0.0, weight_decay: float = 0.0) -> None:
        self.params = [p for p in params]
        self.lr, self.momentum, self.weight_decay = lr, momentum, weight_decay
        self.buffers: list[torch.Tensor | None] = [None] * len(self.params)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        live = [i for i, p in enumerate(self.params) if p.grad is not None]
        buffers = [self.buffers[i] for i in live]
        torch_sgd(
            [self.params[i] for i in live], [self.params[i].grad for i in live], buffers,
            weight_decay=self.weight_decay, momentum=self.momentum, lr=self.lr, dampening=0.0, nesterov=False,
            maximize=False,
        )
        if self.momentum:
            for i, buf in zip(live, buffers):
                self.buffers[i] = buf


@dataclass(frozen=True)
class TrainConfig:
    epochs: int
    batch_size: int
    lr: float
    momentum: float = 0.0
    weight_decay: float = 0.0
    proximal_mu: float = 0.0  # FedProx: + μ/2·‖w − w_start‖² in the loss (Li et al. 2020); 0 = plain SGD
    max_steps: int | None = None  # stop after this many optimizer steps (1 with a full batch: FedSGD)


def train(
    model: nn.Module,
    x: np.ndarray,
    y: np.ndarray,
    cfg: TrainConfig,
    seed: int,
    after_step: Callable[[int, bool], None] | None = None,
) -> dict:
    """Plain SGD epochs over (x, y) on cross-entropy (plus FedProx's term); deterministic for a
    given seed on one thread.

    `after_step(batch_index, last_of_epoch)` runs after each optimizer step (PGD projection uses it).
    Returns the mean training loss (cross-entropy) of the last epoch and the number of steps.
    """
    anchor = [p.detach().clone() for p in model.parameters()] if cfg.proximal_mu > 0 else None

    def loss_fn(xb: torch.Tensor, yb: torch.Tensor):
        loss = nn.functional.cross_entropy(model(xb), yb)
        if anchor is None:
            return loss
        return loss + 0.5 * cfg.proximal_mu * sum(((p - a) ** 2).sum() for p, a in zip(model.parameters(), anchor)), loss

    return sgd_epochs(model, list(model.parameters()), x, y, cfg.batch_size, [cfg.lr] * cfg.epochs, cfg.momentum,
                      cfg.weight_decay, seed, loss_fn, after_step, cfg.max_steps)


def sgd_epochs(
    model: nn.Module, params: list[torch.Tensor], x: np.ndarray, y: np.ndarray, batch_size: int, lrs: list[float],
    momentum: float, weight_decay: float, seed: int, loss_fn: Callable, after_step: Callable[[int, bool], None] | None = None,
    max_steps: int | None = None,
) -> dict:
    """SGD on `params` over shuffled batches of (x, y), one epoch per entry of `lrs` (the lr of
    that epoch), on any loss: `loss_fn(xb, yb)` gives the objective, or (objective, the loss to
    report). The one training loop: honest clients (`train`) and attackers with their own
    objective (Chameleon's contrastive stage) share its seeding, batching and step order."""
    torch.manual_seed(seed)  # dropout masks
    gen = torch.Generator().manual_seed(seed)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    opt = SGD(params, lr=lrs[0] if lrs else 0.0, momentum=momentum, weight_decay=weight_decay)
    model.train()
    steps, last_loss, n = 0, float("nan"), len(xt)
    num_batches = (n + batch_size - 1) // batch_size
    for lr in lrs:
        if max_steps is not None and steps >= max_steps:
            break
        opt.lr = lr
        order = torch.randperm(n, generator=gen)
        total, count = 0.0, 0
        for b in range(num_batches):
            idx = order[b * batch_size : (b + 1) * batch_size]
            if max_steps is not None and steps >= max_steps:
                break
            opt.zero_grad()
            out = loss_fn(xt[idx], yt[idx])
            objective, loss = out if isinstance(out, tuple) else (out, out)
            objective.backward()
            opt.step()
            steps += 1
            if after_step is not None:
                after_step(b, b == num_batches - 1)
            total += loss.item() * len(idx)
            count += len(idx)
        last_loss = total / max(count, 1)
    return {"loss": last_loss, "steps": steps}


@torch.no_grad()
def predict(model: nn.Module, x: np.ndarray, batch_size: int = 64, channels_last: bool = False) -> tuple[np.ndarray, torch.Tensor]:
    """Predicted classes and logits, in eval mode, batch by batch.

    `channels_last` runs image batches ([N, C, H, W]) in NHWC layout; the model must already be in
    that layout (`model.to(memory_format=torch.channels_last)`). On CPU, oneDNN's convolutions are
    about 1.5x faster that way (LeNet on MNIST, measured in benchmarks/overhead.py's setting).
    """
    model.eval()
    outs = []
    for i in range(0, len(x), batch_size):
        chunk = x[i : i + batch_size]
        batch = torch.from_numpy(chunk if chunk.flags.writeable else np.array(chunk))  # a memory-mapped set is read-only
        if channels_last and batch.ndim == 4:
            batch = batch.contiguous(memory_format=torch.channels_last)
        outs.append(model(batch))
    logits = torch.cat(outs) if outs else torch.empty(0)
    return logits.argmax(1).numpy(), logits


@torch.no_grad()
def evaluate(model: nn.Module, x: np.ndarray, y: np.ndarray, batch_size: int = 64) -> dict:
    """Top-1 accuracy and mean cross-entropy of `model` on (x, y)."""
    if len(x) == 0:
        return {"accuracy": float("nan"), "loss": float("nan")}
    pred, logits = predict(model, x, batch_size)
    loss = nn.functional.cross_entropy(logits, torch.from_numpy(y)).item()
    return {"accuracy": float((pred == y).mean()), "loss": float(loss)}
