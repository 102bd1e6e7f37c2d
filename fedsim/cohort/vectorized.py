"""A cohort's local training as one vectorised computation over stacked per-client parameters.

Clients of a round start from the same global model and differ only in their data and seed, so
their C trainings can run as one: the parameters are stacked to [C, ...], each step gathers every
client's batch with one indexing op, one `vmap(grad_and_value(...))` gives all C gradients, and one
set of `torch._foreach_*` ops applies torch's SGD to all of them. Python runs once per step, not
once per client per step, and the device sees C times larger kernels. On CPU that pays for small
models (the mlp trains about 2x faster); conv nets are compute- and cache-bound there and gain
little or lose (`chunk_size_for` keeps a chunk's activations in the cache).

Each client gets the update `fedsim.training.train` gives it: the same batches in the same order
(its own `torch.Generator` seeded as `sgd_epochs` seeds it), the same SGD (momentum, weight decay),
FedProx's term, `max_steps`, and the loss it reports. The results agree within fp32 rounding, not
bit for bit: vmap runs other kernels (grouped convolutions, batched GEMMs), and a short last batch
is padded with zero-weight samples, which changes the order of the sums. Measured (tests/
test_vectorized_training.py, 2 epochs, momentum 0.9): max |row - sequential| within 2e-7 to 1.2e-6
of the largest |update| coordinate on mlp, lenet, factorized lenet and vgg9; now and then one client
of a conv net differs by up to 5.5e-4, where a ReLU or max-pool input within rounding of its kink
went the other way (the sequential fp32 path is as far from fp64 there).

The same cohort trained twice gives the same bits. A client trained in another cohort (alone, with
other neighbours, in other chunks) runs kernels of other sizes and agrees within rounding (about
3e-8 absolute), bit for bit only where those kernels happen to be (the mlp on one thread).

Limitations (`vector_refusal` names them, and the caller trains such cohorts sequentially):
- BatchNorm (resnet18/20): running statistics are buffers that training mutates in place, per
  client; torch.func cannot update a captured buffer per client.
- nn.LSTM (lstm, char_lstm): aten::lstm has no vmap batching rule (and the classifiers check their
  token ids with `.item()`, which vmap cannot run).
- fp16: GradScaler skips a step whose gradients overflow, a per-client decision with a per-client
  scale; bf16 (no scaler) is vectorised.
- Dropout draws each client's masks from one global generator (`randomness="different"`): the
  masks differ between clients, and a run is reproducible (the generator is seeded from the seeds),
  but they cannot equal the masks the sequential path draws, so models with dropout train correctly
  in distribution, not identically.
"""

from __future__ import annotations

import math
from math import prod
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap
from torch.nn import functional as F

from fedsim.devices import deterministic_algorithms, resolve_device
from fedsim.models.layout import ModelLayout
from fedsim.seeding import TORCH_GLOBAL_RNG
from fedsim.training import TrainConfig, autocast, check_precision, seed_dropout, to_device


def vector_refusal(model: nn.Module, cfg: TrainConfig) -> str | None:
    """None when this model and config can train vectorised; else why not, in a few words."""
    check_precision(cfg.precision)
    if cfg.precision == "fp16":
        return "fp16 loss scaling skips steps per client"
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            return "BatchNorm keeps per-client running statistics"
        if isinstance(m, nn.RNNBase):
            return f"nn.{type(m).__name__} has no vmap rule"
    if next(model.buffers(), None) is not None:
        return "the model has buffers, which torch.func cannot update per client"
    if list(ModelLayout.of(model).names) != [n for n, _ in model.named_parameters()]:
        return "tied parameters: the flat layout does not map one to one onto the parameters"
    return None


def client_steps(n: int, cfg: TrainConfig) -> int:
    """The optimizer steps `sgd_epochs` takes on n samples."""
    steps = cfg.epochs * math.ceil(n / cfg.batch_size)
    return steps if cfg.max_steps is None else min(steps, cfg.max_steps)


def _idle_loss(n: int, cfg: TrainConfig) -> float:
    """What `sgd_epochs` reports for a client that takes no step: 0.0 when an epoch ran over no data,
    nan when no epoch ran at all (epochs=0 or max_steps=0)."""
    ran = cfg.epochs > 0 and (cfg.max_steps is None or cfg.max_steps > 0)
    return 0.0 if ran and n == 0 else float("nan")


def train_cohort(
    model: nn.Module, layout: ModelLayout, start: torch.Tensor, datasets: list[tuple[np.ndarray, np.ndarray]],
    cfg: TrainConfig, seeds: list[int], chunk: int | None = None,
) -> tuple[torch.Tensor, list[dict]]:
    """Each client's `train(model_i, x_i, y_i, cfg, seed_i)` from `start`, all at once.

    Returns rows [C, layout.dim] float32 on CPU (client i's trained flat model) and per-client
    {"loss": mean CE of its last epoch, "steps": int}, as `train` returns them. `model` is a built
    instance of the architecture: its weights are ignored (`start` is used) and it is left as it
    was. `chunk`: at most this many clients per vectorised computation (None: all at once; see
    `chunk_size_for` on CUDA). A client with no step to take (empty dataset) gets row = start.

    Clients are trained longest first, so that on every step the clients still training are a
    prefix of the stack: a client that has finished is sliced off rather than masked, costs nothing
    more, and its parameters and momentum cannot move.
    """
    reason = vector_refusal(model, cfg)
    if reason is not None:
        raise ValueError(f"this cohort cannot train vectorised: {reason}")
    if len(datasets) != len(seeds):
        raise ValueError(f"{len(datasets)} datasets but {len(seeds)} seeds")
    if chunk is not None and chunk < 1:
        raise ValueError(f"chunk must be at least 1, got {chunk}")
    device = resolve_device(cfg.device, "TrainConfig.device")
    sizes = [len(y) for _, y in datasets]
    steps = [client_steps(n, cfg) for n in sizes]
    start = start.detach().to(torch.float32).cpu()
    stats = [{"loss": _idle_loss(n, cfg), "steps": 0, "samples": 0} for n in sizes]
    order = sorted((i for i in range(len(datasets)) if steps[i] > 0), key=lambda i: -steps[i])
    rows = torch.empty(len(datasets), layout.dim)
    rows[[i for i in range(len(datasets)) if steps[i] == 0], :] = start
    if not order:
        return rows, stats
    size = chunk or len(order)
    modes = [m.training for m in model.modules()]
    try:
        with TORCH_GLOBAL_RNG, deterministic_algorithms(cfg.deterministic):
            model.train()
            for lo in range(0, len(order), size):
                members = order[lo : lo + size]
                trained, losses, firsts = _train_chunk(model, layout, start, [datasets[i] for i in members],
                                                       [seeds[i] for i in members], [steps[i] for i in members], cfg, device)
                rows.index_copy_(0, torch.tensor(members), trained)
                for i, loss, first_loss in zip(members, losses, firsts):
                    stats[i] = {"loss": loss, "steps": steps[i], "samples": samples_of(sizes[i], steps[i], cfg.batch_size),
                                "start_loss": first_loss}
    finally:
        for m, mode in zip(model.modules(), modes):
            m.training = mode
    return rows, stats


def samples_of(n: int, steps: int, batch_size: int) -> int:
    """Samples `sgd_epochs` trains on in `steps` steps over n samples: whole epochs of n, then full batches."""
    per_epoch = math.ceil(n / batch_size)
    return (steps // per_epoch) * n + (steps % per_epoch) * batch_size


def _client_batches(n: int, seed: int, steps: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One client's sample indices [steps, B] and real-sample mask [steps, B], as `sgd_epochs` draws
    them: one `randperm` per epoch from its seeded generator, a short last batch padded with index 0."""
    gen = torch.Generator().manual_seed(seed)
    per_epoch = math.ceil(n / batch_size)
    epochs = math.ceil(steps / per_epoch)
    pad = per_epoch * batch_size - n
    idx = torch.stack([F.pad(torch.randperm(n, generator=gen), (0, pad)) for _ in range(epochs)])
    real = (torch.arange(per_epoch * batch_size) < n).expand(epochs, -1)
    return idx.view(-1, batch_size)[:steps], real.reshape(-1, batch_size)[:steps]


def _train_chunk(
    model: nn.Module, layout: ModelLayout, start: torch.Tensor, datasets: list[tuple[np.ndarray, np.ndarray]],
    seeds: list[int], steps: list[int], cfg: TrainConfig, device: torch.device,
) -> tuple[torch.Tensor, list[float], list[float]]:
    """Clients sorted by `steps`, longest first, trained together; their rows (CPU), losses and
    first batches' losses (at the start model)."""
    k, B, T = len(datasets), cfg.batch_size, steps[0]
    sizes = [len(y) for _, y in datasets]
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    # the batch plan on CPU: global sample indices, weights and labels [T, k, B]; loss weights [T, k]
    idx = torch.zeros(T, k, B, dtype=torch.int64)
    real = torch.zeros(T, k, B, dtype=torch.bool)
    for c, (n, seed, s) in enumerate(zip(sizes, seeds, steps)):
        idx[:s, c], real[:s, c] = _client_batches(n, seed, s, B)
        idx[:s, c] += int(offsets[c])
    counts = real.sum(2)  # real samples per (step, client)
    B = int(counts.max())  # a batch larger than every client's data (FedSGD) is all padding past its largest
    idx, real = idx[:, :, :B].contiguous(), real[:, :, :B]
    per_epoch = torch.tensor([math.ceil(n / B) for n in sizes])
    last_epoch_from = (torch.tensor(steps) - 1) // per_epoch * per_epoch  # first step of each client's last epoch
    report = torch.where(torch.arange(T)[:, None] >= last_epoch_from, counts, 0).double()
    active = (torch.tensor(steps)[None, :] > torch.arange(T)[:, None]).sum(1).tolist()  # a prefix, by sorting
    x = torch.from_numpy(np.concatenate([np.asarray(d[0]) for d in datasets]))
    ys = torch.from_numpy(np.concatenate([np.asarray(d[1]) for d in datasets]))[idx]
    x, ys, idx = to_device(x, device), to_device(ys, device), to_device(idx, device)
    weights, report = to_device(real.to(torch.float32), device), to_device(report, device)
    sample_shape = tuple(x.shape[1:])

    state = layout.unflatten(start)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    frozen = {n: state[n].to(device) for n, p in model.named_parameters() if not p.requires_grad}
    anchor = [state[n].to(device) for n in names]  # the start, FedProx's anchor
    half_mu = 0.5 * cfg.proximal_mu

    def client_loss(ps, xb, yb, wb):
        """One client's objective on its batch: weighted mean CE (zero-weight padding) + FedProx."""
        with autocast(device, cfg.precision):
            logits = functional_call(model, {**frozen, **dict(zip(names, ps))}, (xb,))
            ce = (F.cross_entropy(logits, yb, reduction="none") * wb).sum() / wb.sum()
            if not half_mu:
                return ce, ce
            return ce + half_mu * sum(((p - a) ** 2).sum() for p, a in zip(ps, anchor)), ce

    # step 0 with the shared start (unbatched): no [k, ...] copy of it, plain (not grouped) convolutions
    first = vmap(grad_and_value(client_loss, has_aux=True), in_dims=(None, 0, 0, 0), randomness="different")
    step = vmap(grad_and_value(client_loss, has_aux=True), randomness="different")
    losses = torch.zeros(T, k, device=device)
    seed_dropout(seeds[0], device)
    params: list[torch.Tensor] = []
    buffers: list[torch.Tensor] = []
    for t in range(T):
        a = active[t]
        xb = x.index_select(0, idx[t, :a].reshape(-1)).view(a, B, *sample_shape)
        if t == 0:
            grads, (_, ce) = first(anchor, xb, ys[0], weights[0])
            params, buffers = _first_sgd(anchor, list(grads), cfg)
        else:
            ps = params if a == k else [p[:a] for p in params]
            grads, (_, ce) = step(ps, xb, ys[t, :a], weights[t, :a])
            _sgd(ps, list(grads), buffers if a == k else [b[:a] for b in buffers], cfg)
        losses[t, :a] = ce

    trained = dict(zip(names, params))
    rows = torch.cat([(trained[n] if n in trained else state[n].to(device).expand(k, *state[n].shape)).reshape(k, -1)
                      for n in layout.names], dim=1)
    mean_loss = (losses.double() * report).sum(0) / report.sum(0)
    return rows.cpu(), mean_loss.cpu().tolist(), losses[0].cpu().tolist()


@torch.no_grad()
def _first_sgd(start: list[torch.Tensor], grads: list[torch.Tensor], cfg: TrainConfig) -> tuple[list, list]:
    """torch's first SGD step from the shared start, on the clients' gradients [k, ...]: the
    stacked parameters it creates, and the momentum buffers (torch's `buf = g`: the gradients
    themselves, which no one else holds)."""
    if cfg.weight_decay:
        for g, p in zip(grads, start):
            g.add_(p, alpha=cfg.weight_decay)
    params = [torch.add(p, g, alpha=-cfg.lr) for p, g in zip(start, grads)]
    return params, grads if cfg.momentum else []


@torch.no_grad()
def _sgd(params: list[torch.Tensor], grads: list[torch.Tensor], buffers: list[torch.Tensor], cfg: TrainConfig) -> None:
    """torch.optim.sgd.sgd's update (dampening 0, no nesterov) on stacked tensors, in place: a zero
    momentum buffer on the first step gives torch's `buf = g` exactly."""
    if cfg.weight_decay:  # in place: the gradients are this step's own (a fresh [C, ...] copy costs page faults)
        torch._foreach_add_(grads, params, alpha=cfg.weight_decay)
    if cfg.momentum:
        torch._foreach_mul_(buffers, cfg.momentum)
        torch._foreach_add_(buffers, grads)
        grads = buffers
    torch._foreach_add_(params, grads, alpha=-cfg.lr)


def chunk_size_for(model: nn.Module, layout: ModelLayout, cfg: TrainConfig, sample_shape: tuple[int, ...],
                   device: torch.device | str) -> int | None:
    """Clients per vectorised computation: what fits half the memory of a CUDA device, or on CPU
    what keeps a step's activations in the last-level cache; None where neither is known.

    Coarse bounds, not measurements. A client's activations: 3 x batch x the forward's per-sample
    outputs (its leaf modules' outputs and the input: kept for backward, their gradients, the
    gathered batch), fp32 whatever the precision. On CUDA a client also holds 4 x the parameters
    (weights, gradient, momentum, a transient), and half the device's memory is used: its total, not
    what is free, which varies from run to run and would vary the chunks, and with them the last
    bits of the updates (a conv net's bits depend on how many clients a step computes). On CPU only the
    activations count against the cache: past it every elementwise pass goes to DRAM, and the cohort
    trains slower than one client after another. Measured on 2 EPYC cores (32 MiB L3), one thread,
    batch 10: lenet, 50 clients x 5 steps, all at once 0.56x the sequential loop's speed, in chunks
    of 2-5 0.99-1.04x (this rule: 4); vgg9, 8 clients x 2 steps, all at once 0.65x, one at a time
    1.03x (this rule: 1); the mlp (hidden 100) all at once about 2x (this rule: 157).
    """
    device = resolve_device(str(device), "chunk_size_for's device")
    activations = 4 * 3 * cfg.batch_size * _activations_per_sample(model, sample_shape)
    if device.type == "cuda":
        _, total = torch.cuda.mem_get_info(device)
        return max(1, int(0.5 * total) // (4 * 4 * layout.dim + activations))
    if device.type == "cpu":
        cache = _last_level_cache_bytes()
        return None if cache is None else max(1, cache // activations)
    return None


def _last_level_cache_bytes() -> int | None:
    """The largest CPU cache of this (Linux) machine, from sysfs; None where it is not there."""
    sizes = []
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = entry.read_text().strip().upper()
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes) if sizes else None


@torch.no_grad()
def _activations_per_sample(model: nn.Module, sample_shape: tuple[int, ...]) -> int:
    """Elements the forward pass produces for one sample: the input and every leaf module's output."""
    total = [prod(sample_shape)]

    def count(_module, _inputs, out):
        if isinstance(out, torch.Tensor):
            total[0] += out.numel()

    leaves = [m for m in model.modules() if not any(True for _ in m.children())]
    hooks = [m.register_forward_hook(count) for m in leaves]
    try:
        first = next(model.parameters())
        with torch.random.fork_rng(devices=[]):  # a dropout layer's draw leaves the global generator as it was
            model(torch.zeros(1, *sample_shape, device=first.device, dtype=first.dtype))
    finally:
        for h in hooks:
            h.remove()
    return total[0]
