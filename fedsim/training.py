"""Local training and evaluation loops, shared by honest clients, attackers and the server.

Training runs where `TrainConfig.device` says (CPU by default) at `TrainConfig.precision` (fp32 by
default; bf16 / fp16 through torch.autocast): the model moves there once, each batch on its way in
(pinned memory to CUDA), and the model is back where it came from when training returns, so the
caller's update is computed on CPU, the wire format. Defaults keep CPU fp32 training bit for bit
as it was. docs/gpu.md says which of these paths ran on real GPUs.
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass
from typing import Callable, Protocol

import numpy as np
import torch
from torch import nn
from torch.optim.sgd import sgd as torch_sgd  # the functional form torch.optim.SGD.step calls

from fedsim.devices import deterministic_algorithms, resolve_device
from fedsim.seeding import TORCH_GLOBAL_RNG

PRECISIONS = ("fp32", "bf16", "fp16")
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class _Functional:
    """What fedsim's optimizers share: their parameters, `param_groups` for torch.amp.GradScaler
    (fp16), and which parameters have a gradient this step (a frozen one has none: skipped)."""

    def __init__(self, params) -> None:
        self.params = list(params)
        self.param_groups = [{"params": self.params}]

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def live(self) -> list[int]:
        return [i for i, p in enumerate(self.params) if p.grad is not None]


class SGD(_Functional):
    """torch's SGD (momentum, weight decay) through its functional form (`torch.optim.sgd.sgd`).

    The same update as `torch.optim.SGD`, bit for bit (tested), without the `Optimizer` class,
    whose first use imports `torch._dynamo` (1.6-2 s of CPU per process, measured): a cost every
    Ray actor and every deployed ClientApp process (one per message) paid before its first step.
    Like `torch.optim.SGD`, a parameter without a gradient (frozen) is skipped.
    """

    def __init__(self, params, lr: float, momentum: float = 0.0, weight_decay: float = 0.0) -> None:
        super().__init__(params)
        self.lr, self.momentum, self.weight_decay = lr, momentum, weight_decay
        self.buffers: list[torch.Tensor | None] = [None] * len(self.params)

    @torch.no_grad()
    def step(self) -> None:
        live = self.live()
        buffers = [self.buffers[i] for i in live]
        torch_sgd(
            [self.params[i] for i in live], [self.params[i].grad for i in live], buffers,
            weight_decay=self.weight_decay, momentum=self.momentum, lr=self.lr, dampening=0.0, nesterov=False,
            maximize=False,
        )
        if self.momentum:
            for i, buf in zip(live, buffers):
                self.buffers[i] = buf


class Adam(_Functional):
    """torch's Adam (Kingma & Ba; no weight decay, no amsgrad) with its multi-tensor (`_foreach`)
    ops, the same update as `torch.optim.Adam`, bit for bit (tested), without the `Optimizer` class
    (see `SGD` for why). Like `torch.optim.Adam`, a parameter without a gradient is skipped, and
    each parameter counts its own steps for the bias corrections."""

    def __init__(self, params, lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8) -> None:
        super().__init__(params)
        self.lr, (self.b1, self.b2), self.eps = lr, betas, eps
        self.m = [torch.zeros_like(p) for p in self.params]
        self.v = [torch.zeros_like(p) for p in self.params]
        self.steps = [0] * len(self.params)

    @torch.no_grad()
    def step(self) -> None:
        live = self.live()
        if not live:
            return
        params, grads = [self.params[i] for i in live], [self.params[i].grad for i in live]
        m, v = [self.m[i] for i in live], [self.v[i] for i in live]
        for i in live:
            self.steps[i] += 1
        c1 = [1 - self.b1 ** self.steps[i] for i in live]
        c2 = [1 - self.b2 ** self.steps[i] for i in live]
        torch._foreach_lerp_(m, grads, 1 - self.b1)
        torch._foreach_mul_(v, self.b2)
        torch._foreach_addcmul_(v, grads, grads, 1 - self.b2)
        denom = torch._foreach_sqrt(v)
        torch._foreach_div_(denom, [c**0.5 for c in c2])
        torch._foreach_add_(denom, self.eps)
        torch._foreach_addcdiv_(params, m, denom, [-self.lr / c for c in c1])


class OptimizerLike(Protocol):
    """What the training loop asks of an optimizer (`SGD`, `Adam`): the lr it sets each epoch, and
    a step on the gradients `backward` left in the parameters."""

    lr: float
    param_groups: list[dict]

    def zero_grad(self) -> None: ...

    def step(self) -> None: ...


@dataclass(frozen=True)
class TrainConfig:
    epochs: int
    batch_size: int
    lr: float
    momentum: float = 0.0
    weight_decay: float = 0.0
    proximal_mu: float = 0.0  # FedProx: + μ/2·‖w − w_start‖² in the loss (Li et al. 2020); 0 = plain SGD
    max_steps: int | None = None  # stop after this many optimizer steps (1 with a full batch: FedSGD)
    device: str = "cpu"  # cpu, cuda, cuda:N or auto (fedsim/devices.py resolve_device)
    precision: str = "fp32"  # fp32, or bf16 / fp16 autocast (fp16 with a GradScaler)
    deterministic: bool = False  # PyTorch's reproducibility switches on while training (fedsim/devices.py)


def autocast(device: torch.device, precision: str):
    """The forward pass's precision: fp32 as is, bf16 / fp16 through torch.autocast on `device`."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=AUTOCAST_DTYPES[precision])


def check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}; allowed: {', '.join(PRECISIONS)}")


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A batch onto `device`; from CPU to CUDA through pinned memory, without blocking the host."""
    if t.device == device:
        return t
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


@contextlib.contextmanager
def on_device(model: nn.Module, device: torch.device):
    """`model` on `device` while the block runs, moved back where it was afterwards (once each way)."""
    first = next(itertools.chain(model.parameters(), model.buffers()), None)
    home = first.device if first is not None else device
    if home == device:
        yield
        return
    model.to(device)
    try:
        yield
    finally:
        model.to(home)


class LossSum:
    """An epoch's summed loss: a Python float on CPU (as it always was), a float64 tensor on an
    accelerator, so that no step waits for the device to report its loss. The same IEEE operations
    in the same order either way: the two agree bit for bit (tested)."""

    def __init__(self, on_host: bool) -> None:
        self.on_host, self.total, self.count = on_host, 0.0, 0

    def add(self, loss: torch.Tensor, n: int) -> None:
        if self.on_host:
            self.total += loss.item() * n
        else:
            self.total = self.total + loss.detach().double() * n
        self.count += n

    def mean(self) -> float:
        return float(self.total) / max(self.count, 1)


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
    The model trains on `cfg.device` and is back on its own device (CPU) when this returns.
    """
    check_precision(cfg.precision)
    device = resolve_device(cfg.device, "TrainConfig.device")
    # the switches first: CUBLAS_WORKSPACE_CONFIG must be set before the model's move starts CUDA
    with deterministic_algorithms(cfg.deterministic), on_device(model, device):
        anchor = [p.detach().clone() for p in model.parameters()] if cfg.proximal_mu > 0 else None

        def loss_fn(xb: torch.Tensor, yb: torch.Tensor):
            loss = nn.functional.cross_entropy(model(xb), yb)
            if anchor is None:
                return loss
            return loss + 0.5 * cfg.proximal_mu * sum(((p - a) ** 2).sum() for p, a in zip(model.parameters(), anchor)), loss

        return sgd_epochs(model, list(model.parameters()), x, y, cfg.batch_size, [cfg.lr] * cfg.epochs, cfg.momentum,
                          cfg.weight_decay, seed, loss_fn, after_step, cfg.max_steps, device=device,
                          precision=cfg.precision, deterministic=cfg.deterministic)


def seed_dropout(seed: int, device: torch.device) -> None:
    """Seed the global generator the model's dropout draws from on `device`. On CPU only CPU's:
    `torch.manual_seed` also queues a seeding of every CUDA/XPU/MTIA device, recording the
    caller's stack each time while CUDA is not initialised (~4% of a small client's training,
    profiled); elsewhere `torch.manual_seed` as it is."""
    if device.type == "cpu":
        torch.default_generator.manual_seed(seed)
    else:
        torch.manual_seed(seed)


def sgd_epochs(
    model: nn.Module, params: list[torch.Tensor], x: np.ndarray, y: np.ndarray, batch_size: int, lrs: list[float],
    momentum: float, weight_decay: float, seed: int, loss_fn: Callable, after_step: Callable[[int, bool], None] | None = None,
    max_steps: int | None = None, *, device: torch.device | str | None = None, precision: str = "fp32",
    deterministic: bool = False, make_optimizer: Callable[[list[torch.Tensor]], OptimizerLike] | None = None,
    before_epoch: Callable[[int], None] | None = None, after_epoch: Callable[[int, bool, float], None] | None = None,
) -> dict:
    """SGD (or `make_optimizer`'s) on `params` over shuffled batches of (x, y), one epoch per entry
    of `lrs` (the lr of that epoch), on any loss: `loss_fn(xb, yb)` gives the objective, or (objective, the loss to
    report). The one training loop: honest clients (`train`) and attackers with their own
    objective (Chameleon's contrastive stage, IBA's poisoned batches and its trigger generator)
    share its seeding, batching and step order.

    `make_optimizer(params)` gives another optimizer in place of `SGD(momentum, weight_decay)`
    (IBA's generator trains by `Adam`); its `lr` is set from `lrs` each epoch as SGD's is.
    `before_epoch(epoch)` runs at the start of each epoch that trains (before its shuffle; IBA's
    Neurotoxin mask), `after_epoch(epoch, last, mean_loss)` at its end, `last` when no epoch
    follows (the final one, or `max_steps` reached), and `after_step(batch_index, last_of_epoch)`
    after each optimizer step.

    `device` (default CPU), `precision` and `deterministic` as in TrainConfig. The shuffling
    generator stays on CPU, so every device sees the same batches in the same order; only the
    forward pass runs under autocast, and fp16 scales the loss with torch.amp.GradScaler (a fresh
    scale per call: a step whose gradients overflow is skipped, as GradScaler does)."""
    check_precision(precision)
    device = torch.device("cpu") if device is None else resolve_device(device, "TrainConfig.device")
    with TORCH_GLOBAL_RNG, deterministic_algorithms(deterministic), on_device(model, device):
        seed_dropout(seed, device)
        gen = torch.Generator().manual_seed(seed)
        xt, yt = torch.from_numpy(x), torch.from_numpy(y)
        if make_optimizer is None:
            opt = SGD(params, lr=lrs[0] if lrs else 0.0, momentum=momentum, weight_decay=weight_decay)
        else:
            opt = make_optimizer(params)
        scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None
        model.train()
        steps, samples, last_loss, n = 0, 0, float("nan"), len(xt)
        start_loss = None  # the first batch's loss, at the model training started from
        num_batches = (n + batch_size - 1) // batch_size
        for epoch, lr in enumerate(lrs):
            if max_steps is not None and steps >= max_steps:
                break
            if before_epoch is not None:
                before_epoch(epoch)
            opt.lr = lr
            order = torch.randperm(n, generator=gen)
            losses = LossSum(on_host=device.type == "cpu")
            for b in range(num_batches):
                idx = order[b * batch_size : (b + 1) * batch_size]
                if max_steps is not None and steps >= max_steps:
                    break
                opt.zero_grad()
                with autocast(device, precision):
                    out = loss_fn(to_device(xt[idx], device), to_device(yt[idx], device))
                objective, loss = out if isinstance(out, tuple) else (out, out)
                if scaler is None:
                    objective.backward()
                    opt.step()
                else:
                    scaler.scale(objective).backward()
                    scaler.step(opt)
                    scaler.update()
                if start_loss is None:
                    start_loss = float(loss.detach())
                steps += 1
                samples += len(idx)
                if after_step is not None:
                    after_step(b, b == num_batches - 1)
                losses.add(loss, len(idx))
            last_loss = losses.mean()
            if after_epoch is not None:
                after_epoch(epoch, epoch == len(lrs) - 1 or (max_steps is not None and steps >= max_steps), last_loss)
        stats = {"loss": last_loss, "steps": steps, "samples": samples}
        if start_loss is not None:
            stats["start_loss"] = start_loss
        return stats


@torch.no_grad()
def predict(model: nn.Module, x: np.ndarray, batch_size: int = 64, channels_last: bool = False,
            device: torch.device | None = None) -> tuple[np.ndarray, torch.Tensor]:
    """Predicted classes and logits (on CPU), in eval mode, batch by batch.

    `device`: where `model` already is (default CPU); batches go there, the logits come back once.

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
        if device is not None:
            batch = to_device(batch, device)
        outs.append(model(batch))
    logits = torch.cat(outs) if outs else torch.empty(0)
    if device is not None and device.type != "cpu":
        logits = logits.cpu()
    return logits.argmax(1).numpy(), logits


@torch.no_grad()
def evaluate(model: nn.Module, x: np.ndarray, y: np.ndarray, batch_size: int = 64, device: torch.device | None = None) -> dict:
    """Top-1 accuracy and mean cross-entropy of `model` (already on `device`, default CPU) on (x, y)."""
    if len(x) == 0:
        return {"accuracy": float("nan"), "loss": float("nan")}
    pred, logits = predict(model, x, batch_size, device=device)
    loss = nn.functional.cross_entropy(logits, torch.from_numpy(y)).item()
    return {"accuracy": float((pred == y).mean()), "loss": float(loss)}
