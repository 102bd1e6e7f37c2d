"""IBA: irreversible backdoor attack (Nguyen et al., NeurIPS 2023, "IBA: Towards Irreversible
Backdoor Attacks in Federated Learning"; official code github.com/sail-research/iba).

The trigger is input-specific and imperceptible: a generator network T_ξ gives every input x its
own additive pattern, x̃ = clip(x + ε·T_ξ(x)) with T_ξ ending in tanh, so ‖x̃ − x‖∞ ≤ ε, and the
backdoor sends x̃ to the target class. Each attack round of one attacker, as in the official
code's `_train_attacker` (fl_trainer.py):

1. Local training of the global model on the attacker's partition. Before the backdoor phase it is
   clean (α = 1); in the backdoor phase every batch B gives the loss
   α·CE(f(B), y) + (1 − α)·CE(f(x̃ of B's first ⌊portion·|B|⌋), target) (official `attack_alpha`
   0.5, `attack_portion` 1.0), with the generator fixed (eval mode, as `tgtmodel.eval()`).
   Model-level constraint (`constraint`): `pgd` projects the model onto the L2 ball of radius
   `pgd_eps` around the global model at the end of every `project_every`-th epoch (the official
   L2 PGD of the backdoor branch, `--eps 2 --project_frequency 1`) and after the last; `neurotoxin`
   instead masks the gradient to the `mask_ratio` share of coordinates where the clean gradient is
   smallest (the official `get_grad_mask`, ratio 0.30): the paper's "parameters least likely
   updated by the main task". The official code offers them as exclusive `--attack_method`s.
2. Generator training against the model just trained (the official order: local training, then
   `_retrain_attack_model` on `net`, classifier in eval mode): `generator_epochs` epochs over the
   partition minimising CE(f(x̃), target) over ξ, all inputs triggered (`attack_portion` 1.0 there).
   Before the backdoor phase it runs every attack round at ε = `eps`; in the backdoor phase every
   other attack round (the official `alternative_training` toggle, against catastrophic forgetting).
3. The attacker measures its local backdoor success on its partition; once it reaches
   `switch_asr` (official 0.85) the backdoor phase starts with the next attack round, at round s,
   and ε decays: ε_t = max(`test_eps`, `eps`·(1 − `eps_decay`)^(t − s)) (official
   `exponential_decay`, `atk_eps` 0.3 → `atk_test_eps` 0.05, decay 0.001).

The generator persists across the attacker's rounds in `job.memory` (its state dict, BatchNorm
statistics included, plus the phase); `shared_state` reports it with this round's ε, and the
backdoor test set is every non-target test image passed through that generator at that ε,
labelled target (the official "External" test uses the current ε too). With several attackers in
a round, the simulated server measures the report of the one with the lowest id.

Generators: the official `MNISTAutoencoder` for 1x28x28 inputs (`generator: auto` picks it there,
as the official code does for MNIST), else the official U-Net (double 3x3 conv + BatchNorm blocks,
average pooling, bilinear upsampling with skip connections, 1x1 conv + BatchNorm + tanh) with
`generator_width` channels at the first level (official 64) and any input size (upsampling to the
skip's size instead of x2, so 28x28 and 8x8 work). Its report must fit the server's bound on a
reply (4x the model + 1 MiB): for the 8x8 digits' MLP, `generator_width: 8`.

Where this follows the official code rather than the paper, and deviations:
* ε is in the model's input units and x̃ is clipped to the training set's per-channel range, as the
  official code adds ε·T(x) to the tensors the model sees (it clips to [-1, 1] for MNIST, the
  ImageNet-normalised range for CIFAR); on fedsim's normalised MNIST the official pixel-unit 0.3
  is about 0.97 (0.3 / 0.3081).
* The generator's optimiser is Adam (`atk_lr`; the first release and LIRA, which IBA builds on, use
  Adam; the refactored release a fresh SGD per round), fresh each round as in the refactored
  release and BackFed, so only the generator's weights are kept between rounds.
* The attacker trains on its own partition (the official attacker samples `num_dps_attacker`
  images of the whole training set) and measures its local success there (the official code uses
  the test set, which a client does not have).
* PGD is on throughout the backdoor phase; the official code turns it on once ε has started to
  decay (from the second backdoor round), which couples it to `eps_decay > 0`. The official
  Krum-specific radius decay is not reproduced.
* Neurotoxin's mask comes from the clean gradient over the whole partition at the start of each
  epoch (the official code keeps only the last batch's gradient, and its running average over
  rounds fails after the first call, so it is left out).
* Model replacement (`scale`) applies in backdoor rounds only (official: in the backdoor phase from
  round 400 on MNIST, 500 on CIFAR-10; off in every shipped script).
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field, model_validator
from torch import nn

from fedsim.attacks.base import AttackerRound, AttackParams, ClientAttack
from fedsim.attacks.edge_case import project_l2
from fedsim.attacks.trigger import Scale, check_class, image_hw, update_scale
from fedsim.registry import ATTACKS
from fedsim.seeding import TORCH_GLOBAL_RNG, derive_seed
from fedsim.training import SGD, Adam, sgd_epochs

GEN = "generator."  # memory / report key prefix of the generator's state dict
PHASE = "phase"  # memory: [backdoor phase started (0/1), its first round, generator retrained last round (0/1)]
LOCAL_ASR = "local_asr"  # memory: the attacker's local backdoor success last round
EPS = "eps"  # memory and report: the ε of the attacker's latest round
IBA_STREAM = 0x1BA  # seed purpose of the generator's initial weights and its batch order


class IBAParams(AttackParams):
    target_class: int = Field(0, ge=0, description="label triggered inputs are sent to (official scripts: 0 MNIST, 1 CIFAR-10)")
    eps: float = Field(
        0.3, ge=0, description="L-inf bound of the trigger while the generator is learned (official atk_eps), in input units"
    )
    test_eps: float = Field(0.05, ge=0, description="floor the bound decays to in the backdoor phase (official atk_test_eps)")
    eps_decay: float = Field(
        0.001, ge=0, lt=1, description="backdoor phase: eps_t = max(test_eps, eps * (1 - eps_decay)^(t - start)) (official)"
    )
    generator: Literal["auto", "unet", "mnist_autoencoder"] = Field(
        "auto", description="trigger generator: auto = the official MNIST autoencoder on 1x28x28 inputs, else the U-Net"
    )
    generator_width: int = Field(
        64, ge=1,
        description="U-Net channels at its first level, x2 per level (official 64; 8 fits the digits MLP's reply bound)",
    )
    generator_lr: float = Field(
        1e-4, gt=0, description="generator's Adam learning rate (official atk_lr: 1e-4; 1e-3 in the MNIST FedAvg script)"
    )
    generator_epochs: int = Field(
        3, ge=1,
        description="generator epochs over the partition per retraining (official atk_model_train_epoch: 3 MNIST, 10 CIFAR-10)",
    )
    alpha: float = Field(0.5, ge=0, le=1, description="weight of the clean loss in backdoor training (official attack_alpha)")
    poison_portion: float = Field(
        1.0, gt=0, le=1, description="share of each batch also fed triggered and relabelled (official attack_portion)"
    )
    switch_asr: float = Field(
        0.85, ge=0, le=1, description="local backdoor success that starts the backdoor phase (official threshold 0.85)"
    )
    constraint: Literal["pgd", "neurotoxin", "none"] = Field(
        "pgd", description="model-level constraint in the backdoor phase (official --attack_method pgd | neurotoxin | blackbox)"
    )
    pgd_eps: float = Field(2.0, gt=0, description="PGD: L2 radius around the global model (official --eps 2)")
    project_every: int = Field(
        1, ge=1, description="PGD: project every k epochs and after the last (official project_frequency 1)"
    )
    mask_ratio: float = Field(
        0.3, gt=0, le=1, description="neurotoxin: share of coordinates trained, those of smallest clean gradient (official 0.30)"
    )
    scale: Scale = Field(
        1.0, description='factor on backdoor-phase updates; "auto" = round examples / own examples (model replacement)'
    )
    local_epochs: int | None = Field(None, ge=1, description="attacker's epochs; default: federation.local_epochs")
    lr: float | None = Field(None, gt=0, description="attacker's lr; default: the honest clients' lr")

    @model_validator(mode="after")
    def _bounds(self) -> "IBAParams":
        if self.test_eps > self.eps:
            raise ValueError(f"attack.test_eps={self.test_eps} must not exceed attack.eps={self.eps}: the bound decays to it")
        return self


# --------------------------------------------------------------------------- generators
def double_conv(cin: int, cout: int) -> nn.Sequential:
    """The official U-Net block: (3x3 conv, BatchNorm, ReLU) twice."""
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
        nn.Conv2d(cout, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
    )


class UNetGenerator(nn.Module):
    """The official trigger U-Net (attack_models/unet.py) with widths w, 2w, 4w, 8w (official w = 64)
    and `channels` in and out; upsampling goes to the skip's size, so any H x W works."""

    def __init__(self, channels: int, width: int) -> None:
        super().__init__()
        w = width
        self.down1, self.down2 = double_conv(channels, w), double_conv(w, 2 * w)
        self.down3, self.down4 = double_conv(2 * w, 4 * w), double_conv(4 * w, 8 * w)
        self.up3, self.up2, self.up1 = double_conv(12 * w, 4 * w), double_conv(6 * w, 2 * w), double_conv(3 * w, w)
        self.last = nn.Sequential(nn.Conv2d(w, channels, 1), nn.BatchNorm2d(channels))

    @staticmethod
    def _up(x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        x = F.interpolate(x, size=skip.shape[-2:], mode="bilinear", align_corners=True)
        return torch.cat([x, skip], dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c1 = self.down1(x)
        c2 = self.down2(F.avg_pool2d(c1, 2))
        c3 = self.down3(F.avg_pool2d(c2, 2))
        x = self.down4(F.avg_pool2d(c3, 2))
        x = self.up3(self._up(x, c3))
        x = self.up2(self._up(x, c2))
        x = self.up1(self._up(x, c1))
        return torch.tanh(self.last(x))


class MNISTAutoencoder(nn.Module):
    """The official MNIST trigger generator (attack_models/autoencoders.py), 1x28x28 -> 1x28x28."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(
            nn.Conv2d(1, 16, 3, stride=3, padding=1), nn.BatchNorm2d(16), nn.ReLU(True), nn.MaxPool2d(2, stride=2),
            nn.Conv2d(16, 64, 3, stride=2, padding=1), nn.BatchNorm2d(64), nn.ReLU(True), nn.MaxPool2d(2, stride=1),
        )
        self.decoder = nn.Sequential(
            nn.ConvTranspose2d(64, 128, 3, stride=2), nn.BatchNorm2d(128), nn.ReLU(True),
            nn.ConvTranspose2d(128, 64, 5, stride=3, padding=1), nn.BatchNorm2d(64), nn.ReLU(True),
            nn.ConvTranspose2d(64, 1, 2, stride=2, padding=1), nn.BatchNorm2d(1), nn.Tanh(),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(x))


def generator_kind(kind: str, input_shape: tuple[int, ...]) -> str:
    """The generator built for `input_shape` ([C, H, W]); an error names attack.generator if it does not fit."""
    if kind == "auto":
        return "mnist_autoencoder" if tuple(input_shape) == (1, 28, 28) else "unet"
    if kind == "mnist_autoencoder" and tuple(input_shape) != (1, 28, 28):
        raise ValueError(f"attack.generator='mnist_autoencoder' needs 1x28x28 inputs, got {input_shape}: use 'unet' or 'auto'")
    return kind


def build_generator(kind: str, input_shape: tuple[int, ...], width: int, seed: int) -> nn.Module:
    """The generator with seeded initial weights: torch's default init draws from the global generator,
    seeded here under its lock and put back as it was afterwards."""
    kind = generator_kind(kind, input_shape)
    with TORCH_GLOBAL_RNG, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return MNISTAutoencoder() if kind == "mnist_autoencoder" else UNetGenerator(input_shape[0], width)


def generator_arrays(gen: nn.Module) -> dict[str, np.ndarray]:
    """The generator's state dict (weights and BatchNorm statistics) as prefixed numpy arrays."""
    return {GEN + k: v.detach().cpu().numpy().copy() for k, v in gen.state_dict().items()}


def load_generator(gen: nn.Module, arrays: dict[str, np.ndarray]) -> bool:
    """Load prefixed arrays into `gen`; False (gen untouched) when `arrays` holds no generator."""
    state = {k[len(GEN):]: torch.from_numpy(np.asarray(v)) for k, v in arrays.items() if k.startswith(GEN)}
    if not state:
        return False
    expected = set(gen.state_dict())
    if set(state) != expected:
        missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
        raise ValueError(f"the saved IBA generator does not match attack.generator / generator_width (missing {missing[:3]}, "
                         f"unexpected {extra[:3]})")
    gen.load_state_dict(state)
    return True


# --------------------------------------------------------------------------- trigger and training
def apply_trigger(gen: nn.Module, x: torch.Tensor, eps: float, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """x̃ = clip(x + ε·T(x), lo, hi): within ε of x (L-inf) for x inside [lo, hi], and inside the data range."""
    return torch.clamp(x + eps * gen(x), lo, hi)


@torch.no_grad()
def triggered(gen: nn.Module, x: np.ndarray, eps: float, lo: torch.Tensor, hi: torch.Tensor, batch: int = 256) -> np.ndarray:
    """The triggered copy of images `x` with the generator in eval mode (fixed BatchNorm statistics)."""
    gen.eval()
    xt = torch.from_numpy(np.ascontiguousarray(x))
    out = [apply_trigger(gen, xt[i : i + batch], eps, lo, hi) for i in range(0, len(xt), batch)]
    return torch.cat(out).numpy() if out else x.copy()


def train_generator(
    gen: nn.Module, model: nn.Module, x: np.ndarray, target: int, eps: float, lo: torch.Tensor, hi: torch.Tensor,
    lr: float, epochs: int, batch_size: int, seed: int,
) -> list[float]:
    """min_ξ CE(f(clip(x + ε·T_ξ(x))), target) by Adam over shuffled batches of `x` (the one training
    loop, `fedsim.training.sgd_epochs`), the classifier fixed in eval mode (official
    `_train_attack_model`); returns each epoch's mean loss."""
    model.eval()
    trainable = [q.requires_grad for q in model.parameters()]
    model.requires_grad_(False)  # only read: no gradient is kept for it
    losses: list[float] = []

    def loss_fn(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(apply_trigger(gen, xb, eps, lo, hi)), yb)

    try:
        sgd_epochs(gen, list(gen.parameters()), np.ascontiguousarray(x), np.full(len(x), target, dtype=np.int64),
                   batch_size, [lr] * epochs, 0.0, 0.0, seed, loss_fn, make_optimizer=lambda params: Adam(params, lr),
                   after_epoch=lambda epoch, last, loss: losses.append(loss))
    finally:
        for q, flag in zip(model.parameters(), trainable):
            q.requires_grad_(flag)
    return losses


def neurotoxin_mask(model: nn.Module, x: np.ndarray, y: np.ndarray, ratio: float, batch_size: int) -> list[torch.Tensor]:
    """Per-parameter 0/1 masks keeping the ⌊ratio·d⌋ coordinates with the smallest |gradient| of
    the clean loss summed over (x, y) (official `get_grad_mask`, Neurotoxin)."""
    params = [p for p in model.parameters() if p.requires_grad]
    grads = [torch.zeros_like(p) for p in params]
    xt, yt = torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(y)
    for i in range(0, len(xt), batch_size):
        loss = F.cross_entropy(model(xt[i : i + batch_size]), yt[i : i + batch_size], reduction="sum")
        torch._foreach_add_(grads, torch.autograd.grad(loss, params))
    flat = torch.cat([g.abs().reshape(-1) for g in grads])
    keep = torch.zeros_like(flat)
    keep[torch.topk(-flat, int(len(flat) * ratio)).indices] = 1.0
    return [m.view_as(p) for m, p in zip(torch.split(keep, [p.numel() for p in params]), params)]


class MaskedSGD(SGD):
    """SGD whose step first multiplies each gradient by its 0/1 mask (`masks`; None: no mask): Neurotoxin."""

    masks: list[torch.Tensor] | None = None

    @torch.no_grad()
    def step(self) -> None:
        if self.masks is not None:
            for p, m in zip(self.params, self.masks):
                if p.grad is not None:
                    p.grad.mul_(m)
        super().step()


def train_backdoor(
    model: nn.Module, x: np.ndarray, y: np.ndarray, x_trig: np.ndarray | None, target: int, alpha: float,
    portion: float, cfg, seed: int, end_of_epoch=None, mask_for_epoch=None,
) -> dict:
    """Local SGD with loss α·CE(f(B), y_B) + (1 − α)·CE(f(x̃ of B's first ⌊portion·|B|⌋), target) per
    batch B (official `_train_main_model`) through the one training loop (`fedsim.training.sgd_epochs`);
    α = 1 or `x_trig` None is plain clean training.

    `mask_for_epoch(model)` -> gradient masks applied before each step of that epoch (Neurotoxin);
    `end_of_epoch(epoch, last)` runs after each epoch (PGD projection). Deterministic for a seed.
    """
    yt = torch.from_numpy(y)
    xp = torch.from_numpy(np.ascontiguousarray(x_trig)) if x_trig is not None and alpha < 1 else None
    params = list(model.parameters())
    opt = MaskedSGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)

    def loss_fn(xb: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        # the loop's labels are the examples' indices: the loss looks up their labels and triggered copies
        loss = F.cross_entropy(model(xb), yt[idx])
        k = int(portion * len(idx)) if xp is not None else 0
        if k > 0:
            poison = F.cross_entropy(model(xp[idx[:k]]), torch.full((k,), target, dtype=torch.int64))
            loss = alpha * loss + (1 - alpha) * poison
        return loss

    def before_epoch(epoch: int) -> None:
        opt.masks = mask_for_epoch(model)
        model.train()

    return sgd_epochs(
        model, params, np.ascontiguousarray(x), np.arange(len(x), dtype=np.int64), cfg.batch_size, [cfg.lr] * cfg.epochs,
        cfg.momentum, cfg.weight_decay, seed, loss_fn, max_steps=cfg.max_steps, make_optimizer=lambda _: opt,
        before_epoch=before_epoch if mask_for_epoch is not None else None,
        after_epoch=None if end_of_epoch is None else lambda epoch, last, loss: end_of_epoch(epoch, last),
    )


@torch.no_grad()
def success_rate(model: nn.Module, x_trig: np.ndarray, target: int, batch: int = 256) -> float:
    """Share of triggered inputs the model (eval mode) assigns the target class."""
    if len(x_trig) == 0:
        return 0.0
    model.eval()
    xt = torch.from_numpy(np.ascontiguousarray(x_trig))
    pred = torch.cat([model(xt[i : i + batch]).argmax(1) for i in range(0, len(xt), batch)])
    return float((pred == target).float().mean())


def decayed_eps(eps: float, test_eps: float, decay: float, rounds_since_start: int) -> float:
    """max(test_eps, eps·(1 − decay)^t): the official `exponential_decay` floored at the test bound."""
    return max(test_eps, eps * (1.0 - decay) ** rounds_since_start)


# --------------------------------------------------------------------------- the attack
@ATTACKS.register("iba", IBAParams)
class IrreversibleBackdoor(ClientAttack):
    """IBA: a learned, input-specific, imperceptible trigger (generator network) and a constrained poisoned update."""

    # --- what the attacker knows -------------------------------------------------------
    def training_set(self, runtime, partition_id: int) -> tuple[np.ndarray, np.ndarray]:
        idx = runtime.partitions[partition_id]
        return runtime.data.x_train[idx], runtime.data.y_train[idx]

    def data_range(self, runtime) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-channel [min, max] of the training inputs, shaped [1, C, 1, 1]: where x̃ is clipped."""
        def build() -> tuple[torch.Tensor, torch.Tensor]:
            x = runtime.data.x_train
            lo, hi = x.min(axis=(0, 2, 3)), x.max(axis=(0, 2, 3))
            return torch.from_numpy(lo).view(1, -1, 1, 1), torch.from_numpy(hi).view(1, -1, 1, 1)

        return runtime.cached(("iba", "data_range"), build)

    def initial_generator(self, runtime) -> nn.Module:
        """Every attacker's generator before its first round: seeded by the scenario seed only."""
        image_hw(runtime)  # clear error for non-image data
        p = self.params
        return build_generator(p.generator, runtime.data.input_shape, p.generator_width,
                               derive_seed(runtime.scenario.seed, IBA_STREAM))

    def generator_from(self, runtime, arrays: dict[str, np.ndarray] | None) -> nn.Module:
        gen = self.initial_generator(runtime)
        if arrays:
            load_generator(gen, arrays)
        return gen

    # --- one attack round --------------------------------------------------------------
    def local_train(self, job: AttackerRound) -> tuple[int, dict, dict]:
        p, rt, mem = self.params, job.runtime, job.memory
        check_class(p.target_class, rt)
        x, y = self.training_set(rt, job.partition_id)
        lo, hi = self.data_range(rt)
        gen = self.generator_from(rt, mem)
        poisoning, start, retrained = (int(v) for v in mem.get(PHASE, np.array([0, 0, 0])))
        if not poisoning and LOCAL_ASR in mem and float(mem[LOCAL_ASR][0]) >= p.switch_asr:
            poisoning, start, retrained = 1, job.round, 0  # official: checked at the start of a later round
        eps = decayed_eps(p.eps, p.test_eps, p.eps_decay, job.round - start) if poisoning else p.eps
        retrain = not poisoning or not retrained  # backdoor phase: every other attack round
        info = {"num_examples": len(x), "iba_backdoor_round": bool(poisoning), **job.config}
        if len(x) == 0:
            stats = {"loss": 0.0}
        else:
            x_trig = triggered(gen, x, eps, lo, hi) if poisoning else None
            end_of_epoch = mask_for_epoch = None
            if poisoning and p.constraint == "pgd":
                def end_of_epoch(epoch: int, last: bool) -> None:
                    if last or (epoch + 1) % p.project_every == 0:
                        project_l2(job.model, job.global_vec, job.layout, p.pgd_eps)
            elif poisoning and p.constraint == "neurotoxin":
                def mask_for_epoch(model):
                    return neurotoxin_mask(model, x, y, p.mask_ratio, job.train.batch_size)
            alpha = p.alpha if poisoning else 1.0
            stats = train_backdoor(job.model, x, y, x_trig, p.target_class, alpha, p.poison_portion, job.train,
                                   job.seed, end_of_epoch, mask_for_epoch)
            if retrain:
                losses = train_generator(gen, job.model, x, p.target_class, eps, lo, hi, p.generator_lr,
                                         p.generator_epochs, job.train.batch_size, derive_seed(job.seed, IBA_STREAM))
                stats = {**stats, "generator_loss": losses[-1]}
            stats["local_backdoor_success"] = success_rate(job.model, triggered(gen, x, eps, lo, hi), p.target_class)
        mem.update(generator_arrays(gen))
        mem[PHASE] = np.array([poisoning, start, int(poisoning and retrain)], dtype=np.int64)
        mem[LOCAL_ASR] = np.array([stats.get("local_backdoor_success", 0.0)], dtype=np.float64)
        mem[EPS] = np.array([eps], dtype=np.float64)
        return len(x), stats, info

    def shared_state(self, job: AttackerRound) -> dict[str, np.ndarray]:
        """The generator this attacker holds after its round and the ε it used."""
        return {k: v for k, v in job.memory.items() if k.startswith(GEN) or k == EPS}

    def finish_update(self, delta: torch.Tensor, info: dict) -> torch.Tensor:
        return delta * update_scale(self.params.scale, info) if info.get("iba_backdoor_round") else delta

    # --- measurement -------------------------------------------------------------------
    def backdoor_test_set(self, runtime, shared: dict[str, np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Every non-target test image through the reported generator at the reported ε (before any
        report: the seeded initial generator at `eps`), labelled target."""
        p = self.params
        check_class(p.target_class, runtime)

        def build() -> tuple[np.ndarray, np.ndarray]:
            gen = self.initial_generator(runtime)
            self.check_report_size(runtime, gen)
            eps = p.eps
            if shared is not None:
                load_generator(gen, shared)
                eps = float(np.asarray(shared.get(EPS, [p.eps])).reshape(-1)[0])
            lo, hi = self.data_range(runtime)
            keep = runtime.data.y_test != p.target_class
            labels = np.full(int(keep.sum()), p.target_class, dtype=np.int64)
            return triggered(gen, runtime.data.x_test[keep], eps, lo, hi), labels

        # before any report the set is the same every round; a report's set is built each time
        return build() if shared is not None else runtime.cached(("iba", "initial_test_set"), build)

    def check_report_size(self, runtime, gen: nn.Module) -> None:
        """The report must fit the server's bound on a reply (fedsim.wire): an error names generator_width."""
        from fedsim.wire import MAX_PAYLOAD_FACTOR, max_payload_bytes  # imports Flower: only when measured

        size = sum(v.numel() * v.element_size() for v in gen.state_dict().values()) + 8
        limit = max_payload_bytes(runtime.layout)
        if size > limit:
            raise ValueError(
                f"the IBA generator ({size} bytes) exceeds the {limit} bytes the server accepts in a reply for this "
                f"model ({MAX_PAYLOAD_FACTOR}x the model + 1 MiB): lower attack.generator_width "
                f"(now {self.params.generator_width}) or use attack.generator='mnist_autoencoder' on 1x28x28 data"
            )

    def report(self, runtime) -> dict:
        gen = self.initial_generator(runtime)
        return {
            "target_class": self.params.target_class,
            "generator": generator_kind(self.params.generator, runtime.data.input_shape),
            "generator_parameters": int(sum(q.numel() for q in gen.parameters())),
        }
