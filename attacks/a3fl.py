"""A3FL: adversarially adaptive backdoor (Zhang et al., NeurIPS 2023, "A3FL: Adversarially Adaptive
Backdoor Attacks to Federated Learning"; issue #20).

In each attack round the attacker first optimises its trigger δ against the global model θ_t it
received and against adapted copies θ'_t of it, then trains on its partition with a share of the
samples stamped with δ and relabelled to the target (like `trigger`). The paper's objective:

    δ* = argmin_δ  E[ L(x ⊕ δ, ỹ; θ_t) + λ · L(x ⊕ δ, ỹ; θ'_t) ],   θ'_t = argmin_θ E[ L(x ⊕ δ, y; θ) ],
    λ = λ0 · sim(θ'_t, θ_t),

θ'_t being the global model trained to *unlearn* the trigger (stamped inputs, true labels): how the
federation may adapt to the backdoor. The trigger persists across the attacker's attack rounds
(kept in `job.memory`, so in the client's own state).

Where this follows the authors' code (read at github.com/hfzhang31/A3FL, `fl_utils/attacker.py`
`search_trigger` / `get_adv_model`, defaults from `main/configs/config.yaml`):
* the trigger is an image-sized pattern initialised to 0.5 everywhere, applied through a square
  mask of `size` pixels at (2, 2): x ⊕ δ = δ·m + (1 − m)·x (here `torch.where`, the same values);
* `trigger_epochs` (200) passes over the attacker's clean partition in batches of the training
  batch size, all of each batch stamped and labelled with the target, one signed-gradient step per
  batch, δ ← clamp(δ − `trigger_lr`·sign(∇δ), range); the global model is in eval mode;
* every `adapt_every` (1) epochs from epoch `adapt_every` on, `adapt_models` (1) adapted models are
  rebuilt from the global model with the current trigger: `adapt_epochs` (5) epochs of SGD (lr
  0.01, momentum 0.9, weight decay 5e-4, the code's constants) on stamped inputs with their true
  labels; they stay in train mode afterwards, as in the code; the loss adds
  λ0·w_i·L(θ'_i)/`adapt_models` with λ0 = `lambda0` (0.01);
* w_i = sim is the mean, over the conv layers' parameters, of the cosine similarity between the
  adapted model's gradient (its last adaptation batch) and the global model's gradient summed over
  every trigger step so far (the code never zeroes it). The paper writes sim(θ'_t, θ_t), a
  similarity of the models: `similarity: weights` takes the cosine of the same layers' weights
  instead (BackFed's reading). A model without conv layers (mlp) uses all its parameters;
* only the first sampled adversary searches the trigger and every adversary stamps it; the update
  is not scaled (`malicious_update_method: label`), so `scale` defaults to 1.

Where it differs, and why:
* the code clamps δ to [-2, 2], roughly normalised CIFAR-10's range; here the range is each
  channel's min and max over the training set (`bounds` sets it explicitly), for any dataset;
* the code stamps the first 25% of every shuffled batch; here a fixed, seeded 25% of the partition
  is stamped (`poison_fraction`, chosen once like `trigger`/`dba`), so `fedsim.training.train`
  runs unchanged; the code's label smoothing of 0.001 in the attacker's training is not used;
* each attacker keeps its own trigger in its own memory and optimises it on its own partition (a
  client's state is its own); with one attacker (the official config's num_adversaries: 1) this is
  the code's single trigger. With several, each plants its own trigger and the server measures the backdoor
  with the report of the round's attacker with the lowest id (deterministic).
BackFed's port differs from the official code (cosine of weights, adapted models in eval mode,
dm_adv_K = 100 so no adaptation in 100 epochs, early stop at 85% local ASR, clamp to [0, 1]); the
official code is followed here.
"""

from __future__ import annotations

import copy
from typing import Literal

import numpy as np
import torch
from pydantic import Field, model_validator
from torch import nn
from torch.nn import functional as F

from fedsim.attacks.base import AttackerRound
from fedsim.attacks.trigger import (
    PartitionPoisoner, PoisonParams, check_class, choose_poisoned, image_hw, stamp, stamped_test_set,
)
from fedsim.registry import ATTACKS
from fedsim.seeding import derive_seed
from fedsim.training import SGD, train

SEARCH = 0xA3F1  # purpose key of the trigger search's random stream (batch order, dropout)


class A3FLParams(PoisonParams):
    target_class: int = Field(2, ge=0, description="label the stamped inputs are given (official config: 2)")
    size: int = Field(
        5, ge=1, description="side of the square trigger patch in pixels (official trigger_size: 5; 2-3 suit 8x8 digits)"
    )
    offset: tuple[int, int] = Field((2, 2), description="(row, col) of the patch's top-left pixel (official: 2, 2)")
    init_value: float = Field(
        0.5, description="initial value of every trigger pixel, in the model's input space (official: 0.5)"
    )
    bounds: tuple[float, float] | None = Field(
        None,
        description="[low, high] the trigger's values are clamped to; default: each channel's min and max over the "
        "training set (official: [-2, 2], about normalised CIFAR-10's range)",
    )
    poison_fraction: float = Field(
        0.25, gt=0, le=1,
        description="share of the attacker's partition stamped and relabelled, chosen once (official bkd_ratio: 0.25)",
    )
    trigger_epochs: int = Field(
        200, ge=0,
        description="passes over the attacker's partition optimising the trigger, one signed-gradient step per batch "
        "(official trigger_outter_epochs: 200); 0 = plant the trigger as it is",
    )
    trigger_lr: float = Field(
        0.01, gt=0, description="step of the update trigger -= lr * sign(gradient) (official trigger_lr: 0.01)"
    )
    lambda0: float = Field(
        0.01, ge=0,
        description="λ0: weight of the adapted models' backdoor loss, times their similarity to the global model "
        "(official noise_loss_lambda: 0.01); 0 = no adversarial adaptation",
    )
    adapt_every: int = Field(
        1, ge=1, description="the adapted models are rebuilt every K trigger epochs, from epoch K on (official dm_adv_K: 1)"
    )
    adapt_models: int = Field(1, ge=1, description="adapted models built each time (official dm_adv_model_count: 1)")
    adapt_epochs: int = Field(
        5, ge=1,
        description="epochs an adapted model trains on the stamped partition with the true labels, unlearning the trigger "
        "(official dm_adv_epochs: 5)",
    )
    adapt_lr: float = Field(0.01, gt=0, description="SGD lr of the adaptation (official: 0.01)")
    adapt_momentum: float = Field(0.9, ge=0, lt=1, description="SGD momentum of the adaptation (official: 0.9)")
    adapt_weight_decay: float = Field(5e-4, ge=0, description="SGD weight decay of the adaptation (official: 5e-4)")
    similarity: Literal["gradients", "weights"] = Field(
        "gradients",
        description="sim in λ = λ0·sim: mean cosine over the conv layers of the adapted and global models' gradients "
        "(official code) or weights (the paper's sim(θ'_t, θ_t))",
    )

    @model_validator(mode="after")
    def _bounds(self) -> "A3FLParams":
        if self.bounds is not None:
            lo, hi = self.bounds
            if not lo < hi:
                raise ValueError(f"attack.bounds must be [low, high] with low < high, got {list(self.bounds)}")
            if not lo <= self.init_value <= hi:
                raise ValueError(f"attack.init_value={self.init_value} lies outside attack.bounds {list(self.bounds)}")
        if min(self.offset) < 0:
            raise ValueError(f"attack.offset must be >= 0, got {list(self.offset)}")
        return self


# --------------------------------------------------------------------------- pure tensor functions
def patch_mask(shape: tuple[int, int], size: int, offset: tuple[int, int]) -> np.ndarray:
    """Boolean [H, W] mask of the `size` x `size` square whose top-left pixel is `offset`."""
    h, w = shape
    r0, c0 = offset
    if r0 + size > h or c0 + size > w:
        raise ValueError(
            f"an A3FL trigger of attack.size={size} at attack.offset={list(offset)} does not fit {h}x{w} images: "
            f"lower attack.size or attack.offset (offset + size <= {h} rows, {w} columns)"
        )
    mask = np.zeros((h, w), dtype=bool)
    mask[r0 : r0 + size, c0 : c0 + size] = True
    return mask


def similarity_layers(model: nn.Module) -> list[str]:
    """Names of the parameters sim is taken over: those of the conv layers (the official code's
    `'conv' in name` on its ResNet-18), or every parameter of a model without conv layers."""
    conv = [f"{m}.{p}" if m else p for m, mod in model.named_modules() if isinstance(mod, nn.modules.conv._ConvNd)
            for p, _ in mod.named_parameters(recurse=False)]
    return conv or [name for name, _ in model.named_parameters()]


def mean_cosine(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """Mean over layers of the cosine similarity of each pair of flattened tensors."""
    cos = [F.cosine_similarity(u.reshape(-1), v.reshape(-1), dim=0, eps=1e-8) for u, v in zip(a, b)]
    return float(torch.stack(cos).mean())


def batches(n: int, batch_size: int, gen: torch.Generator):
    order = torch.randperm(n, generator=gen)
    return [order[i : i + batch_size] for i in range(0, n, batch_size)]


def adapted_model(model: nn.Module, x: torch.Tensor, y: torch.Tensor, trigger: torch.Tensor, mask: torch.Tensor,
                  p: A3FLParams, batch_size: int, gen: torch.Generator) -> nn.Module:
    """θ'_t: a copy of `model` trained `adapt_epochs` epochs on the stamped inputs with their true
    labels (unlearning the trigger); left in train mode with its last batch's gradients."""
    adv = copy.deepcopy(model)
    adv.train()
    for q in adv.parameters():
        q.requires_grad_(True)
        q.grad = None
    opt = SGD(adv.parameters(), lr=p.adapt_lr, momentum=p.adapt_momentum, weight_decay=p.adapt_weight_decay)
    t = trigger.detach()
    for _ in range(p.adapt_epochs):
        for idx in batches(len(x), batch_size, gen):
            opt.zero_grad()
            F.cross_entropy(adv(torch.where(mask, t, x[idx])), y[idx]).backward()
            opt.step()
    return adv


def search_trigger(model: nn.Module, x: np.ndarray, y: np.ndarray, trigger: np.ndarray, mask: np.ndarray, p: A3FLParams,
                   low: np.ndarray, high: np.ndarray, batch_size: int, seed: int) -> np.ndarray:
    """The trigger after `p.trigger_epochs` epochs of A3FL's search from `trigger` ([C, H, W]) on the
    attacker's clean data (x, y) against `model` (not modified), values clamped per channel to
    [low, high]; deterministic for a seed."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # dropout of the adapted models (in train mode, as in the official code)
    model = copy.deepcopy(model)
    model.eval()
    layers = set(similarity_layers(model))
    track = p.lambda0 > 0 and p.similarity == "gradients"
    named = dict(model.named_parameters())
    for name, q in named.items():  # the global model's gradient is needed only for sim
        q.requires_grad_(track and name in layers)
        q.grad = None
    xt, yt = torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(np.ascontiguousarray(y))
    m = torch.from_numpy(mask)
    lo = torch.as_tensor(low, dtype=xt.dtype).reshape(-1, 1, 1)
    hi = torch.as_tensor(high, dtype=xt.dtype).reshape(-1, 1, 1)
    t = torch.from_numpy(trigger).to(xt.dtype).clone()
    target = torch.full((len(xt),), p.target_class, dtype=torch.int64)
    adapted: list[tuple[nn.Module, float]] = []
    for epoch in range(p.trigger_epochs):
        if p.lambda0 > 0 and epoch and epoch % p.adapt_every == 0:
            adapted = []
            for _ in range(p.adapt_models):
                adv = adapted_model(model, xt, yt, t, m, p, batch_size, gen)
                adv_named = dict(adv.named_parameters())
                names = sorted(layers)
                if p.similarity == "gradients":
                    weight = mean_cosine([adv_named[k].grad for k in names], [named[k].grad for k in names])
                else:
                    weight = mean_cosine([adv_named[k].detach() for k in names], [named[k].detach() for k in names])
                for q in adv.parameters():
                    q.requires_grad_(False)
                adapted.append((adv, weight))
        for idx in batches(len(xt), batch_size, gen):
            t.requires_grad_(True)
            inputs, labels = torch.where(m, t, xt[idx]), target[: len(idx)]
            loss = F.cross_entropy(model(inputs), labels)
            for adv, weight in adapted:
                loss = loss + p.lambda0 * weight * F.cross_entropy(adv(inputs), labels) / p.adapt_models
            loss.backward()  # also sums the global model's gradient (for sim), never zeroed, as in the code
            with torch.no_grad():
                t = torch.clamp(t - p.trigger_lr * t.grad.sign(), lo, hi)
    return t.detach().numpy()


# --------------------------------------------------------------------------- the attack
@ATTACKS.register("a3fl", A3FLParams)
class A3FL(PartitionPoisoner):
    """A3FL: a trigger optimised each attack round against the global model and its adaptation (NeurIPS 2023)."""

    def mask(self, runtime) -> np.ndarray:
        return patch_mask(image_hw(runtime), self.params.size, self.params.offset)

    def value_range(self, runtime) -> tuple[np.ndarray, np.ndarray]:
        """Per-channel [low, high] of the trigger's values: `bounds`, or the training set's range."""
        c = runtime.data.x_train.shape[1]
        if self.params.bounds is not None:
            return np.full(c, self.params.bounds[0], np.float32), np.full(c, self.params.bounds[1], np.float32)
        x = runtime.data.x_train
        lo, hi = runtime.cached(("a3fl", "pixel_range"), lambda: (x.min(axis=(0, 2, 3)).astype(np.float32),
                                                                  x.max(axis=(0, 2, 3)).astype(np.float32)))
        v = self.params.init_value
        if ((v < lo) | (v > hi)).any():
            raise ValueError(
                f"attack.init_value={v} lies outside the data range [{lo.min():.4g}, {hi.max():.4g}] "
                f"(per channel: low {lo.tolist()}, high {hi.tolist()}): choose a value inside it or set attack.bounds"
            )
        return lo, hi

    def initial_trigger(self, runtime) -> np.ndarray:
        self.value_range(runtime)  # checks init_value against the data range
        c, (h, w) = runtime.data.x_train.shape[1], image_hw(runtime)
        return np.full((c, h, w), self.params.init_value, dtype=np.float32)

    def checked_trigger(self, runtime, trigger, where: str) -> np.ndarray:
        """`trigger` as a float32 [C, H, W] array, or a ValueError saying what is wrong with it."""
        c, (h, w) = runtime.data.x_train.shape[1], image_hw(runtime)
        if trigger is None:
            raise ValueError(f"{where} has no 'trigger' array")
        t = np.array(trigger, dtype=np.float32)  # a copy: a stored array may be read-only
        if t.shape != (c, h, w):
            raise ValueError(f"{where}: the A3FL trigger has shape {t.shape}, expected {(c, h, w)} for {runtime.data.name}")
        if not np.isfinite(t).all():
            raise ValueError(f"{where}: the A3FL trigger has non-finite values")
        return t

    def poisoned_rows(self, runtime, partition_id: int) -> np.ndarray:
        return runtime.cached(("a3fl", "poisoned_rows", partition_id), lambda: choose_poisoned(
            len(runtime.partitions[partition_id]), self.params.poison_fraction, runtime.scenario.seed, partition_id))

    def stamped(self, runtime, partition_id: int, trigger: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The attacker's partition with its poisoned rows stamped with `trigger` and relabelled."""
        check_class(self.params.target_class, runtime)
        idx = runtime.partitions[partition_id]
        x, y = runtime.data.x_train[idx].copy(), runtime.data.y_train[idx].copy()
        rows = self.poisoned_rows(runtime, partition_id)
        x[rows] = stamp(x[rows], self.mask(runtime), trigger)
        y[rows] = self.params.target_class
        return x, y

    def poison(self, runtime, partition_id, x, y):
        """The training set's size (what `client_size` asks): stamped with the initial trigger; each
        attack round stamps the trigger it has just optimised instead (`local_train`)."""
        return self.stamped(runtime, partition_id, self.initial_trigger(runtime))

    def local_train(self, job: AttackerRound) -> tuple[int, dict, dict]:
        rt, pid, p = job.runtime, job.partition_id, self.params
        check_class(p.target_class, rt)
        trigger = self.initial_trigger(rt)
        if "trigger" in job.memory:
            trigger = self.checked_trigger(rt, job.memory["trigger"], f"attacker {pid}'s memory")
        idx = rt.partitions[pid]
        if len(idx) and p.trigger_epochs:
            lo, hi = self.value_range(rt)
            trigger = search_trigger(job.model, rt.data.x_train[idx], rt.data.y_train[idx], trigger, self.mask(rt), p,
                                     lo, hi, job.train.batch_size, derive_seed(job.seed, SEARCH))
        job.memory["trigger"] = trigger
        x, y = self.stamped(rt, pid, trigger)
        info = {"num_examples": len(x), **job.config}
        stats = train(job.model, x, y, job.train, job.seed) if len(x) else {"loss": 0.0}
        return len(x), stats, info

    def shared_state(self, job: AttackerRound) -> dict[str, np.ndarray] | None:
        """The trigger this attacker planted this round, so the server measures the backdoor with it."""
        return {"trigger": np.array(job.memory["trigger"], dtype=np.float32)} if "trigger" in job.memory else None

    def backdoor_test_set(self, runtime, shared: dict[str, np.ndarray] | None = None):
        """Every non-target test image stamped with the reported trigger (the initial one before any report)."""
        if shared is None:
            trigger = self.initial_trigger(runtime)
        else:
            trigger = self.checked_trigger(runtime, shared.get("trigger"), "the attacker's backdoor report")
        return stamped_test_set(runtime, self.mask(runtime), trigger, self.params.target_class)

    def poisons_data_only(self) -> bool:
        return False  # the trigger is optimised against the global model each round

    def report(self, runtime) -> dict:
        return {
            "target_class": self.params.target_class,
            "trigger_pixels": int(self.mask(runtime).sum()),
            "poisoned_per_attacker": {pid: len(self.poisoned_rows(runtime, pid)) for pid in runtime.attackers},
        }
