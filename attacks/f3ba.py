"""F3BA, the Focused-Flip Federated Backdoor Attack (Fang & Chen, AAAI 2023, "On the Vulnerability of
Backdoor Defenses for Federated Learning", arXiv:2301.08170; issue #37).

Before training, the attacker *handcrafts* the global model it received so that a few weights
already carry the backdoor, then optimises its trigger for that model and trains on poisoned data:

1. candidate weights: in every conv and linear layer, the weights whose movement since the previous
   global model it saw points towards zero, s = (θ_t − θ_prev)·θ_t, the `conv_rate` (2%) / `fc_rate`
   (0.1%) share with the smallest s (s < the value at sorted position int(n·rate));
2. focused flip of the first conv layer: each filter's candidate weights take the signs of the
   trigger pattern, resized to the kernel and rescaled to the filter's [min, max] range:
   w ← sign(p̃)·|w| (times `flip_factor` where the sign changed), so the filter fires on the trigger;
3. trigger optimisation for the flipped model: `trigger_epochs` (2) passes of gradient *ascent*
   δ ← clamp(δ + `trigger_lr`·∇δ ‖ā(x ⊕ δ) − ā(x)‖², range), ā the first layer's ReLU activation
   averaged over the batch and the channels; then the weights are restored;
4. the flip is applied for real, layer after layer: the first conv layer from the optimised
   trigger, each later conv layer from the mean activation difference (stamped − clean) of the
   layer before it, resized to its kernels; every `neuron_every` (3) handcraft rounds, the hidden
   linear layers' candidates take the sign of the mean feature difference entering them:
   w ← (1−c)·w + |c·w|·sign(Δa) (the output layer is left alone);
5. training on the handcrafted model with the official blind loss 0.6·CE(x, y) + 0.4·CE(x̃, ỹ), x̃
   the batch with its first `poison_fraction` (0.5) stamped and relabelled to the target.

This follows the authors' code (github.com/jinghuichen/Focused-Flip-Federated-Backdoor-Attack:
`Attacks.py` `search_candidate_weights` (kernel_selection "movement"), `flip_filter_as_trigger`,
`optimize_backdoor_trigger`, `inject_handcrafted_filters`, `inject_handcrafted_neurons`;
`Client.py` `handcraft` / `train`; `losses/loss_functions.py` `trigger_loss`; defaults from
`Params.py` and `configs/cifar_fed.yaml`): the attacker handcrafts on the last 20% of its
partition and trains on the first 80% (`handcraft_share`), keeps θ_prev and its trigger across
rounds (here in `AttackerRound.memory`, the client's own state; θ_prev starts as the initial
model, as the official client is built with it), and the trigger starts as a seeded uniform
pattern (official torch.manual_seed(111), 3x3 at row 3, column 23 of 32x32 images).

Where fedsim differs, and why:
* the official code only knows its SimpleNet and ResNet (conv1 by name, 'fc' layers by name);
  here conv layers are the model's nn.Conv2d modules and linear layers its nn.Linear modules, in
  definition order. A model without a conv layer (the MLP) has no filter to flip: its first linear
  layer is treated as a hidden layer whose input difference is the trigger's (stamped − clean
  inputs), for the trigger search as for the neuron flip, and ā is then averaged over the batch only;
* activations are each layer module's output, the official FeatureExtractor's hook point; the
  resizing is bilinear with antialiasing, torchvision's tensor `Resize` default;
* the trigger is clamped to each channel's data range (the official clamps to the normalised image
  of [0, 1]); its default place is the official (3, 23) where it fits, else the top-right corner;
* the attacker reports its trigger so the server measures the backdoor with it (the official test
  averages the malicious clients' patterns; here the lowest attacker id's report, as for A3FL).
"""

from __future__ import annotations

import copy

import numpy as np
import torch
from pydantic import Field, model_validator
from torch import nn
from torch.nn import functional as F

from fedsim.attacks.base import AttackerRound
from fedsim.attacks.trigger import PartitionPoisoner, PoisonParams, check_class, image_hw, stamped_test_set
from fedsim.registry import ATTACKS
from fedsim.seeding import derive_seed
from fedsim.training import sgd_epochs

HANDCRAFT = 0xF3BA  # purpose key of the trigger search's batch order and dropout


class F3BAParams(PoisonParams):
    target_class: int = Field(8, ge=0, description="label the stamped inputs are given (official backdoor_label: 8)")
    size: int = Field(3, ge=1, description="side of the square trigger in pixels (official CIFAR-10: 3)")
    offset: tuple[int, int] | None = Field(
        None, description="(row, col) of the trigger's top-left pixel; default: the official (3, 23) where it fits, "
        "else the top-right corner")
    init_seed: int = Field(111, description="seed of the initial uniform trigger pattern (official torch.manual_seed(111))")
    conv_rate: float = Field(0.02, gt=0, lt=1, description="share of each conv layer's weights that are candidates (official conv_rate: 0.02)")
    fc_rate: float = Field(0.001, gt=0, lt=1, description="share of each linear layer's weights that are candidates (official fc_rate: 0.001)")
    flip_factor: float = Field(1.0, description="factor on a candidate weight whose sign the flip changes (official flip_factor: 1)")
    trigger_epochs: int = Field(2, ge=0, description="passes of the trigger search over the handcraft split (official: 2)")
    trigger_lr: float = Field(0.1, gt=0, description="step of the gradient ascent on the trigger (official: 0.1)")
    neuron_every: int = Field(3, ge=1, description="the linear layers are flipped in handcraft rounds 1, 1+k, 1+2k... (official: k = 3)")
    handcraft_share: float = Field(0.2, gt=0, lt=1, description="share of the partition (its end) used to handcraft; the rest trains (official: 0.2)")
    poison_fraction: float = Field(0.5, gt=0, le=1, description="share of each batch stamped in the backdoor loss (official poisoning_proportion: 0.5)")
    normal_weight: float = Field(0.6, ge=0, description="weight of the clean loss (official fixed_scales normal: 0.6)")
    backdoor_weight: float = Field(0.4, ge=0, description="weight of the backdoor loss (official fixed_scales backdoor: 0.4)")

    @model_validator(mode="after")
    def _offset(self) -> "F3BAParams":
        if self.offset is not None and min(self.offset) < 0:
            raise ValueError(f"attack.offset must be >= 0, got {list(self.offset)}")
        return self


# --------------------------------------------------------------------------- pure functions
def weight_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(module name, module) of the model's nn.Conv2d and nn.Linear layers, in definition order."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, (nn.Conv2d, nn.Linear))]


def candidate_mask(weight: torch.Tensor, previous: torch.Tensor, rate: float) -> torch.Tensor:
    """Float 0/1 mask of the weights with s = (w − w_prev)·w below the value at sorted position int(n·rate)."""
    s = (weight - previous) * weight
    theta = torch.sort(s.reshape(-1))[0][int(s.numel() * rate)]
    return (s < theta).to(weight.dtype)


def resize(t: torch.Tensor, k: tuple[int, int]) -> torch.Tensor:
    """[C, h, w] to [C, *k], bilinear with antialiasing (torchvision's tensor Resize)."""
    return F.interpolate(t.unsqueeze(0), size=k, mode="bilinear", align_corners=False, antialias=True).squeeze(0)


def flip_filters(weight: torch.Tensor, mask: torch.Tensor, pattern: torch.Tensor, flip_factor: float) -> torch.Tensor:
    """The official `flip_filter_as_trigger` on every filter at once: the pattern [C_in, h, w] resized
    to the kernel, rescaled to each filter's [min, max]; candidates take its sign with their magnitude."""
    p = resize(pattern.to(weight.dtype), tuple(weight.shape[2:]))
    p_min, p_max = p.min(), p.max()
    c_min = weight.amin(dim=(1, 2, 3), keepdim=True)
    c_max = weight.amax(dim=(1, 2, 3), keepdim=True)
    unit = (p - p_min) / (p_max - p_min) if p_max > p_min else torch.full_like(p, 0.5)
    scaled = unit.unsqueeze(0) * (c_max - c_min) + c_min  # [out, C_in, k, k]
    flipped = torch.sign(scaled) * weight.abs()
    flipped = torch.where(torch.sign(scaled) != torch.sign(weight), flipped * flip_factor, flipped)
    return mask * flipped + (1 - mask) * weight


def flip_neurons(weight: torch.Tensor, mask: torch.Tensor, diff: torch.Tensor) -> torch.Tensor:
    """The official `inject_handcrafted_neurons` step: w ← (1−c)·w + |c·w|·(sign(Δa)·c), Δa over the inputs."""
    ideal = torch.sign(diff.reshape(-1)).unsqueeze(0) * mask
    return (1 - mask) * weight + (mask * weight).abs() * ideal


class Taps:
    """Forward hooks recording each weight layer's output and the first linear layer's input."""

    def __init__(self, model: nn.Module) -> None:
        self.out: dict[str, torch.Tensor] = {}
        self.features: torch.Tensor | None = None
        layers = weight_layers(model)
        self.handles = [m.register_forward_hook(self._keep(n)) for n, m in layers]
        first_fc = next((m for _, m in layers if isinstance(m, nn.Linear)), None)
        if first_fc is not None:
            self.handles.append(first_fc.register_forward_pre_hook(self._features))

    def _keep(self, name):
        def hook(_m, _i, out):
            self.out[name] = out
        return hook

    def _features(self, _m, inputs):
        self.features = inputs[0].reshape(len(inputs[0]), -1)

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def mean_difference(model: nn.Module, clean: torch.Tensor, stamped: torch.Tensor) -> tuple[dict, torch.Tensor | None]:
    """({layer: mean over the inputs of its output on stamped − clean}, same for the first linear layer's input)."""
    taps = Taps(model)
    try:
        with torch.no_grad():
            model(stamped)
            out_s, feat_s = {k: v.mean(0) for k, v in taps.out.items()}, taps.features
            model(clean)
            diffs = {k: out_s[k] - v.mean(0) for k, v in taps.out.items()}
            feat = None if feat_s is None else feat_s.mean(0) - taps.features.mean(0)
    finally:
        taps.close()
    return diffs, feat


def first_activation(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """ā: ReLU of the first weight layer's output averaged over the batch (and channels for a conv layer)."""
    name, first = weight_layers(model)[0]
    taps = Taps(model)
    try:
        model(x)
        a = F.relu(taps.out[name])
    finally:
        taps.close()
    return a.mean(dim=(0, 1)) if isinstance(first, nn.Conv2d) else a.mean(dim=0)


# --------------------------------------------------------------------------- the attack
@ATTACKS.register("f3ba", F3BAParams)
class F3BA(PartitionPoisoner):
    """F3BA: flip the signs of a few candidate weights so they respond to the trigger, optimise the trigger for them, then poison."""

    def box(self, runtime) -> tuple[int, int]:
        h, w = image_hw(runtime)
        s = self.params.size
        if self.params.offset is not None:
            r0, c0 = self.params.offset
        elif 3 + s <= h and 23 + s <= w:
            r0, c0 = 3, 23
        else:
            r0, c0 = 0, w - s
        if r0 + s > h or c0 + s > w or r0 < 0 or c0 < 0:
            raise ValueError(f"an F3BA trigger of attack.size={s} at (row, col) ({r0}, {c0}) does not fit {h}x{w} images: "
                             "lower attack.size or set attack.offset")
        return r0, c0

    def mask(self, runtime) -> np.ndarray:
        (h, w), (r0, c0), s = image_hw(runtime), self.box(runtime), self.params.size
        m = np.zeros((h, w), dtype=bool)
        m[r0 : r0 + s, c0 : c0 + s] = True
        return m

    def value_range(self, runtime) -> tuple[np.ndarray, np.ndarray]:
        x = runtime.data.x_train
        return runtime.cached(("f3ba", "range"), lambda: (x.min(axis=(0, 2, 3)).astype(np.float32),
                                                          x.max(axis=(0, 2, 3)).astype(np.float32)))

    def initial_trigger(self, runtime) -> np.ndarray:
        """A uniform pattern, the same draw in every channel, scaled to each channel's range (official: torch.rand(3, 3), seed 111)."""
        lo, hi = self.value_range(runtime)
        (h, w), s, (r0, c0) = image_hw(runtime), self.params.size, self.box(runtime)
        u = torch.rand((s, s), generator=torch.Generator().manual_seed(self.params.init_seed)).numpy()
        t = np.broadcast_to(((lo + hi) / 2)[:, None, None], (len(lo), h, w)).astype(np.float32).copy()
        t[:, r0 : r0 + s, c0 : c0 + s] = lo[:, None, None] + u[None] * (hi - lo)[:, None, None]
        return t

    def checked_trigger(self, runtime, trigger, where: str) -> np.ndarray:
        c, (h, w) = runtime.data.x_train.shape[1], image_hw(runtime)
        t = np.array(trigger, dtype=np.float32) if trigger is not None else None
        if t is None or t.shape != (c, h, w) or not np.isfinite(t).all():
            raise ValueError(f"{where}: an F3BA trigger must be a finite float array of shape {(c, h, w)}")
        return t

    def split(self, runtime, partition_id: int) -> tuple[np.ndarray, np.ndarray]:
        """Indices into the partition: (training part, the handcraft part at its end)."""
        n = len(runtime.partitions[partition_id])
        nt = int((1 - self.params.handcraft_share) * n)
        return np.arange(nt), np.arange(nt, n)

    def poison(self, runtime, partition_id, x, y):
        """What the attacker trains on (its training part); the stamping happens per batch in the loss."""
        check_class(self.params.target_class, runtime)
        keep, _ = self.split(runtime, partition_id)
        return x[keep], y[keep]

    def shared_state(self, job: AttackerRound):
        return {"trigger": np.array(job.memory["trigger"], dtype=np.float32)} if "trigger" in job.memory else None

    def backdoor_test_set(self, runtime, shared=None):
        trigger = self.initial_trigger(runtime) if shared is None else self.checked_trigger(runtime, shared.get("trigger"), "the attacker's backdoor report")
        return stamped_test_set(runtime, self.mask(runtime), trigger, self.params.target_class)

    def poisons_data_only(self) -> bool:
        return False

    def report(self, runtime) -> dict:
        return {"target_class": self.params.target_class, "trigger_pixels": int(self.mask(runtime).sum())}

    # --- handcrafting ----------------------------------------------------------------------------
    def candidates(self, model: nn.Module, previous: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        p = self.params
        out = {}
        for name, mod in weight_layers(model):
            key = f"{name}.weight"
            rate = p.conv_rate if isinstance(mod, nn.Conv2d) else p.fc_rate
            out[name] = candidate_mask(mod.weight.detach(), previous[key], rate)
        return out

    def flip_first(self, model: nn.Module, cand: dict, trigger: torch.Tensor, clean: torch.Tensor, m: torch.Tensor) -> None:
        """The focused flip of the first layer: a conv layer from the trigger pattern in its box, a
        linear one (no conv layer) from the input difference the trigger makes."""
        name, first = weight_layers(model)[0]
        with torch.no_grad():
            if isinstance(first, nn.Conv2d):
                (r0, c0), s = self._box, self.params.size
                first.weight.copy_(flip_filters(first.weight, cand[name], trigger[:, r0 : r0 + s, c0 : c0 + s], self.params.flip_factor))
            else:
                diff = (torch.where(m, trigger, clean) - clean).mean(0)
                first.weight.copy_(flip_neurons(first.weight, cand[name], diff))

    def search_trigger(self, model: nn.Module, cand: dict, trigger: torch.Tensor, x: torch.Tensor, m: torch.Tensor,
                       lo: torch.Tensor, hi: torch.Tensor, batch_size: int, seed: int) -> torch.Tensor:
        """The official `optimize_backdoor_trigger`: gradient ascent on ‖ā(stamped) − ā(clean)‖² for the flipped model."""
        model = copy.deepcopy(model)
        for q in model.parameters():
            q.requires_grad_(False)
        gen = torch.Generator().manual_seed(seed)
        torch.manual_seed(seed)  # dropout: the official search runs in train mode
        model.train()
        t = trigger.clone()
        for _ in range(self.params.trigger_epochs):
            for idx in torch.randperm(len(x), generator=gen).split(batch_size):
                self.flip_first(model, cand, t, x[idx], m)
                t.requires_grad_(True)
                clean = x[idx]
                diff = first_activation(model, torch.where(m, t, clean)) - first_activation(model, clean)
                (grad,) = torch.autograd.grad((diff * diff).sum(), t)
                with torch.no_grad():
                    t = torch.where(m, torch.clamp(t + self.params.trigger_lr * grad, lo, hi), t)
        return t.detach()

    def handcraft(self, model: nn.Module, cand: dict, trigger: torch.Tensor, x: torch.Tensor, m: torch.Tensor,
                  neurons: bool) -> None:
        """The official `inject_handcrafted_filters` (and, when `neurons`, `inject_handcrafted_neurons`) on `model`."""
        layers = weight_layers(model)
        model.eval()
        stamped = torch.where(m, trigger, x)
        convs = [(n, mod) for n, mod in layers if isinstance(mod, nn.Conv2d)]
        diff = None
        for i, (name, mod) in enumerate(convs):
            with torch.no_grad():
                if i == 0:
                    (r0, c0), s = self._box, self.params.size
                    pattern = trigger[:, r0 : r0 + s, c0 : c0 + s]
                else:
                    pattern = diff
                mod.weight.copy_(flip_filters(mod.weight, cand[name], pattern, self.params.flip_factor))
            diff = mean_difference(model, x, stamped)[0][name]
        if convs:
            feat = mean_difference(model, x, stamped)[1]
        else:
            feat = (stamped - x).mean(0)
        if not neurons or feat is None:
            return
        fcs = [(n, mod) for n, mod in layers if isinstance(mod, nn.Linear)][:-1]  # the output layer is left alone
        for name, mod in fcs:
            with torch.no_grad():
                mod.weight.copy_(flip_neurons(mod.weight, cand[name], feat))
            feat = mean_difference(model, x, stamped)[0][name]

    # --- one round -------------------------------------------------------------------------------
    def local_train(self, job: AttackerRound) -> tuple[int, dict, dict]:
        rt, pid, p = job.runtime, job.partition_id, self.params
        check_class(p.target_class, rt)
        self._box = self.box(rt)
        trigger = self.initial_trigger(rt)
        if "trigger" in job.memory:
            trigger = self.checked_trigger(rt, job.memory["trigger"], f"attacker {pid}'s memory")
        previous = job.memory.get("previous_global")
        prev_vec = torch.from_numpy(np.asarray(previous, dtype=np.float32)) if previous is not None and \
            np.shape(previous) == (job.layout.dim,) else rt.initial_weights()
        rounds = int(np.asarray(job.memory.get("handcraft_rounds", 0)).reshape(-1)[0]) + 1  # a 0-d array comes back as [1]
        model = job.model
        cand = self.candidates(model, job.layout.unflatten(prev_vec))
        job.memory["previous_global"] = job.global_vec.detach().numpy().copy()
        idx = rt.partitions[pid]
        train_part, craft_part = self.split(rt, pid)
        m = torch.from_numpy(self.mask(rt))
        t = torch.from_numpy(trigger)
        if len(craft_part):
            xc = torch.from_numpy(np.ascontiguousarray(rt.data.x_train[idx[craft_part]]))
            lo, hi = (torch.from_numpy(v).reshape(-1, 1, 1) for v in self.value_range(rt))
            if p.trigger_epochs:
                t = self.search_trigger(model, cand, t, xc, m, lo, hi, job.train.batch_size, derive_seed(job.seed, HANDCRAFT))
            self.handcraft(model, cand, t, xc, m, neurons=(rounds - 1) % p.neuron_every == 0)
        job.memory["trigger"] = t.numpy().copy()
        job.memory["handcraft_rounds"] = np.array([rounds])
        x, y = self.training_set(rt, pid)
        info = {"num_examples": len(x), **job.config}
        if not len(x):
            return 0, {"loss": 0.0}, info
        stats = self.poisoned_training(model, x, y, t, m, job)
        return len(x), stats, info

    def poisoned_training(self, model: nn.Module, x: np.ndarray, y: np.ndarray, t: torch.Tensor, m: torch.Tensor,
                          job: AttackerRound) -> dict:
        """The official blind loss: normal_weight·CE(batch) + backdoor_weight·CE(batch with its first share stamped)."""
        p, cfg = self.params, job.train

        def loss_fn(xb, yb):
            k = round(len(xb) * p.poison_fraction)
            xp, yp = xb.clone(), yb.clone()
            xp[:k] = torch.where(m, t, xp[:k])
            yp[:k] = p.target_class
            normal = F.cross_entropy(model(xb), yb)
            return p.normal_weight * normal + p.backdoor_weight * F.cross_entropy(model(xp), yp), normal

        return sgd_epochs(model, list(model.parameters()), x, y, cfg.batch_size, [cfg.lr] * cfg.epochs, cfg.momentum,
                          cfg.weight_decay, job.seed, loss_fn, max_steps=cfg.max_steps)

