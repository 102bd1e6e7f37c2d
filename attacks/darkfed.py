"""DarkFed: a data-free backdoor (Li et al., IJCAI 2024, "DarkFed: A Data-Free Backdoor Attack in
Federated Learning", arXiv:2405.03299; issue #37).

The attackers are emulated ("fake") clients that hold no data of the task. Each attack round an
attacker trains the global model θ_g on a *shadow dataset* of out-of-distribution inputs that the
global model itself labels (knowledge distillation), with a share of them stamped with the trigger
and given a target logit vector, under regularisers that make its update look like a benign one:

    L = MSE(f(x_s), z_s) + MSE(f(x_s ⊕ Δ), z_t) + λ_d·‖θ − θ_g‖₂
        + λ_c·[ Σ_{j<i} cos²(Δθ_L, Δθ_L^(j)) + cos²(Δθ_L, Δθ̂_L) ],

z_s = f_{θ_g}(x_s) the global model's logits on the shadow input, z_t the target vector (10 at the
target class, −10/C elsewhere), Δθ_L the attacker's update of the output layer, Δθ_L^(j) those of
the colluding fake clients before it, and Δθ̂_L the benign update the attacker predicts from the
global models it has seen by Brown's double exponential smoothing (s1 ← αθ + (1−α)s1,
s2 ← αs1 + (1−α)s2, θ̂ = (2−α)/(1−α)·s1 − 1/(1−α)·s2, Δθ̂ = θ̂ − θ_g). Benign updates of a large
model are nearly orthogonal to each other; the cos² terms make the fake clients' updates
orthogonal to each other and to the benign estimate as well (the paper's property mimicry), and
the distance term keeps their norm near the benign ones'.

This follows the authors' code (github.com/hustweiwan/DarkFed: `DataFreeTraining.py`
`datafreeattack_run_fl_round` / `train_with_grad_control` / `compute_cos_sim_loss(_1)` /
`predict_the_global_model` / `update_the_Ss`, and `attacks/datafreenoise.py`, the variant whose
shadow data is noise): the shadow set is `shadow_size` (50 000) inputs drawn N(0.5, 1) in pixel
units and clamped to the pixel range; distilled once with the global model of the first attack
round; *compressed* batch by batch (`batch_size` rows) to a `compress_ratio` (0.4) share by the
greedy walk of `select_img` (from a random row, repeatedly jump to the row least similar to the
current one under the product of the L2-normalised input and logit similarities, never revisiting
a row); each sample is stamped with probability `poison_prob` (0.1, re-drawn every epoch as the
official `__getitem__` does); plain SGD at lr 0.005 with cosine annealing over the `poison_epochs`
(2) epochs, in eval mode; λ_d = λ_c = 0.5; the cos² terms over the output layer's parameters (the
official 'fc'); the update scaled by `weight_scale` (fl_weight_scale: 1); the smoothing α = 0.8.

Where fedsim differs, and why:
* the official `predict_the_global_model` writes `((2-alpha)/1-alpha)` for (2−α)/(1−α), an operator
  precedence slip that makes its "prediction" 0.4·s1 − 5·s2; Brown's forecast as the paper states
  it is used here;
* the shadow noise is drawn in units of each channel's data range (mean lo + 0.5·(hi−lo), std
  hi−lo, clamped to [lo, hi]), the official N(0.5, 1) clamped to [0, 1] in pixel space; the
  official code feeds those [0, 1] images to a model trained on normalised ones, here they are
  in the model's input space. The OOD-dataset variant (GTSRB for CIFAR-10) is not offered: a
  scenario loads one dataset;
* the trigger is a `size`-pixel square at the bottom right, `margin` (2) pixels from the edges
  (the official 25%-of-the-side trigger image at the same place), of value `value` (default the
  data's max, white), the official trigger PNG not being a parameter one can carry to any dataset;
* the fake clients collude: the official code trains them one after another in one process and
  each reads the updates of those before it from disk. Here each colluder (ids sorted) recomputes
  the updates of the pool members before it with their own training seeds (as `alie_colluding`),
  with its own view of the shadow set and smoothed history, which is theirs when they attack in
  the same rounds; `collude: false` leaves the term out;
* the smoothing state is updated in each of the attacker's attack rounds (the official code runs
  every round from the first attack round; with a sparse schedule it spans several rounds);
* the attacker reports its partition's size as its example count (what the server expects of
  that client); the official server averages without weights.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import torch
from pydantic import Field
from torch import nn
from torch.nn import functional as F

from fedsim.attacks.base import AttackerRound, AttackParams, ClientAttack
from fedsim.attacks.trigger import check_class, image_hw, stamp, stamped_test_set, trigger_value
from fedsim.registry import ATTACKS
from fedsim.seeding import derive_seed
from fedsim.training import SGD, sgd_epochs

SHADOW = 0xDA4F  # purpose key of the shadow noise (shared by every colluder)
WALK = 0xDA50  # the compression walk's random starts
TRAIN_KEY = 0xDA51  # a fake client's training (batch order, poisoning draws)


class DarkFedParams(AttackParams):
    num_attackers: int = Field(4, ge=1, description="fake clients the attacker emulates (official fl_number_of_adversaries: 4)")
    target_class: int = Field(8, ge=0, description="label the trigger leads to (official backdoor_label: 8)")
    size: int | None = Field(
        None, ge=1, description="side of the square trigger in pixels; default: 25% of the image side, rounded down to even "
        "(the official trigger's size)")
    margin: int = Field(2, ge=0, description="pixels between the trigger and the bottom and right edges (official: 2)")
    value: float | None = Field(None, description="trigger pixel value; default: the training set's max per channel (white)")
    shadow_size: int = Field(50000, ge=1, description="noise inputs drawn before compression (official datafreenoise: 50000)")
    compress_ratio: float = Field(0.4, gt=0, le=1, description="share of each batch kept by the compression walk (official com_ratio: 0.4)")
    poison_prob: float = Field(0.1, ge=0, le=1, description="probability a shadow sample is stamped, per epoch (official noise variant: 0.1)")
    target_logit: float = Field(10.0, gt=0, description="logit of the target class in z_t; the others get -target_logit/C (official: 10)")
    poison_epochs: int = Field(2, ge=1, description="epochs on the shadow set (official fl_poison_epochs: 2)")
    lr: float = Field(0.005, gt=0, description="SGD lr, annealed by a cosine over the epochs (official: 0.005 for CIFAR-10)")
    distance_weight: float = Field(0.5, ge=0, description="λ_d on ‖θ − θ_g‖₂ (official: 0.5)")
    cosine_weight: float = Field(0.5, ge=0, description="λ_c on the cos² terms (official: 0.5)")
    smoothing: float = Field(0.8, gt=0, lt=1, description="α of the double exponential smoothing of the global models (official: 0.8)")
    weight_scale: float = Field(1.0, gt=0, description="factor on the finished update (official fl_weight_scale: 1)")
    collude: bool = Field(True, description="cos² to the updates of the colluders before this one (official: yes)")


# --------------------------------------------------------------------------- pure functions
def shadow_noise(n: int, lo: np.ndarray, hi: np.ndarray, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """[n, *shape] noise: N(lo + (hi-lo)/2, hi-lo) per channel clamped to [lo, hi] (official N(0.5, 1) in [0, 1])."""
    gen = torch.Generator().manual_seed(seed)
    lo_t = torch.as_tensor(lo, dtype=torch.float32).reshape(-1, *([1] * (len(shape) - 1)))
    hi_t = torch.as_tensor(hi, dtype=torch.float32).reshape(-1, *([1] * (len(shape) - 1)))
    z = torch.randn((n, *shape), generator=gen)
    return torch.clamp(lo_t + (hi_t - lo_t) * (0.5 + z), lo_t, hi_t).numpy()


def compress(x: np.ndarray, logits: np.ndarray, batch_size: int, ratio: float, seed: int) -> np.ndarray:
    """Indices kept by the official `select_img` walk, batch by batch: from a random row, repeatedly
    go to the row with the lowest co-similarity (input cosine times logit cosine) to the current
    one, marking each chosen row's column 1 so it is not chosen again; int(ratio·batch) rows a batch."""
    rng = np.random.default_rng(seed)
    xs = x.reshape(len(x), -1).astype(np.float64)
    xs /= np.maximum(np.linalg.norm(xs, axis=1, keepdims=True), 1e-12)
    zs = logits.astype(np.float64) / np.maximum(np.linalg.norm(logits, axis=1, keepdims=True), 1e-12)
    kept = []
    for start in range(0, len(x), batch_size):
        xb, zb = xs[start : start + batch_size], zs[start : start + batch_size]
        take = int(len(xb) * ratio)
        if take == 0:
            continue
        co = (xb @ xb.T) * (zb @ zb.T)
        i = int(rng.integers(len(xb)))
        for _ in range(take):
            i = int(np.argmin(co[i]))
            kept.append(start + i)
            co[:, i] = 1.0
    return np.asarray(kept, dtype=np.int64)


def target_vector(num_classes: int, target: int, logit: float) -> torch.Tensor:
    """z_t: −logit/C everywhere, +logit at the target (official `target_one_hot`)."""
    z = torch.full((num_classes,), -logit / num_classes)
    z[target] = logit
    return z


def brown_forecast(s1: torch.Tensor, s2: torch.Tensor, alpha: float) -> torch.Tensor:
    """One-step forecast of Brown's double exponential smoothing: (2−α)/(1−α)·s1 − 1/(1−α)·s2."""
    return (2 - alpha) / (1 - alpha) * s1 - s2 / (1 - alpha)


def smooth(s1: torch.Tensor, s2: torch.Tensor, theta: torch.Tensor, alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The official `update_the_Ss`: s1 ← αθ + (1−α)s1, then s2 ← α·s1 + (1−α)s2."""
    s1 = alpha * theta + (1 - alpha) * s1
    return s1, alpha * s1 + (1 - alpha) * s2


def output_layer(model: nn.Module) -> list[str]:
    """Parameter names of the model's last nn.Linear (the official 'fc' layer)."""
    last = [m for m, mod in model.named_modules() if isinstance(mod, nn.Linear)]
    if not last:
        raise ValueError("darkfed: the model has no nn.Linear output layer for the cosine terms")
    mod = dict(model.named_modules())[last[-1]]
    return [f"{last[-1]}.{p}" if last[-1] else p for p, _ in mod.named_parameters(recurse=False)]


def mimicry_loss(update_l: torch.Tensor, others: list[torch.Tensor]) -> torch.Tensor:
    """Σ_j cos²(update_l, other_j) (the official compute_cos_sim_loss(_1))."""
    loss = update_l.new_zeros(())
    for o in others:
        loss = loss + F.cosine_similarity(update_l, o, dim=0, eps=1e-8) ** 2
    return loss


def cosine_lrs(lr: float, epochs: int, eta_min: float = 1e-10) -> list[float]:
    """CosineAnnealingLR(T_max = epochs, eta_min) stepped once per epoch: the lr of each epoch."""
    return [eta_min + (lr - eta_min) * (1 + math.cos(math.pi * e / epochs)) / 2 for e in range(epochs)]


def train_fake_client(model: nn.Module, x: np.ndarray, logits: np.ndarray, global_vec: torch.Tensor, layout,
                      mask: np.ndarray, value, z_target: torch.Tensor, others: list[torch.Tensor], p: DarkFedParams,
                      batch_size: int, seed: int) -> dict:
    """One fake client's training on the shadow set (x, logits) from the global model loaded in `model`."""
    names = output_layer(model)
    params = dict(model.named_parameters())
    g = layout.unflatten(global_vec)
    g_all = [g[n].detach() for n, _ in model.named_parameters()]
    g_out = torch.cat([g[n].reshape(-1) for n in names]).detach()
    xt = torch.from_numpy(np.ascontiguousarray(x))
    zt = torch.from_numpy(np.ascontiguousarray(logits))
    m = torch.from_numpy(mask)
    v = torch.as_tensor(np.asarray(value, dtype=np.float32))
    v = v.reshape(-1, 1, 1) if v.ndim == 1 else v
    gen = torch.Generator().manual_seed(derive_seed(seed, 1))

    def loss_fn(xb_idx, _):
        idx = xb_idx
        xb, zb = xt[idx], zt[idx]
        poison = torch.rand(len(idx), generator=gen) < p.poison_prob
        xb = torch.where(poison.view(-1, 1, 1, 1) & m, v, xb)
        model.eval()  # the official trains in eval mode (batch norm statistics untouched)
        out = model(xb)
        loss = out.new_zeros(())
        if (~poison).any():
            loss = loss + F.mse_loss(out[~poison], zb[~poison])
        if poison.any():
            loss = loss + F.mse_loss(out[poison], z_target.expand(int(poison.sum()), -1))
        dist = torch.linalg.vector_norm(torch.cat([(q - g0).reshape(-1) for q, g0 in zip(params.values(), g_all)]))
        upd = torch.cat([params[n].reshape(-1) for n in names]) - g_out
        return loss + p.distance_weight * dist + p.cosine_weight * mimicry_loss(upd, others), loss

    index = np.arange(len(x), dtype=np.int64)
    return sgd_epochs(model, list(model.parameters()), index, index, batch_size, cosine_lrs(p.lr, p.poison_epochs),
                      0.0, 0.0, seed, lambda i, _: loss_fn(i, _))


# --------------------------------------------------------------------------- the attack
@ATTACKS.register("darkfed", DarkFedParams)
class DarkFed(ClientAttack):
    """DarkFed: fake clients train a backdoor on distilled noise, orthogonal to each other and to the predicted benign update."""

    simulation_only = True  # a colluder recomputes its partners' updates (their training seeds)

    def trigger_size(self, runtime) -> int:
        if self.params.size is not None:
            return self.params.size
        h, _ = image_hw(runtime)
        s = int(h * 0.25)
        return max(s - s % 2, 1)

    def mask(self, runtime) -> np.ndarray:
        h, w = image_hw(runtime)
        s, mg = self.trigger_size(runtime), self.params.margin
        r0, c0 = h - mg - s, w - mg - s
        if r0 < 0 or c0 < 0:
            raise ValueError(f"a darkfed trigger of attack.size={s} with attack.margin={mg} does not fit {h}x{w} images")
        out = np.zeros((h, w), dtype=bool)
        out[r0 : r0 + s, c0 : c0 + s] = True
        return out

    def training_set(self, runtime, partition_id: int) -> tuple[np.ndarray, np.ndarray]:
        """The partition the server believes this client holds (never read: DarkFed is data-free); its size is reported."""
        return runtime.client_data(partition_id)

    def backdoor_test_set(self, runtime, shared=None):
        return stamped_test_set(runtime, self.mask(runtime), trigger_value(runtime, self.params.value), self.params.target_class)

    def poisons_data_only(self) -> bool:
        return False

    def report(self, runtime) -> dict:
        return {"target_class": self.params.target_class, "trigger_pixels": int(self.mask(runtime).sum()),
                "shadow_size": self.params.shadow_size}

    # --- the shadow set --------------------------------------------------------------------------
    def noise(self, runtime) -> np.ndarray:
        x = runtime.data.x_train
        lo, hi = runtime.cached(("darkfed", "range"), lambda: (x.min(axis=(0, 2, 3)), x.max(axis=(0, 2, 3))))
        return runtime.cached(("darkfed", "noise"), lambda: shadow_noise(
            self.params.shadow_size, lo, hi, x.shape[1:], derive_seed(runtime.scenario.seed, SHADOW)))

    def shadow(self, job: AttackerRound) -> tuple[np.ndarray, np.ndarray]:
        """(inputs, distilled logits) of the compressed shadow set; distilled and compressed at this
        attacker's first attack round and kept in its memory."""
        from fedsim.training import predict

        noise = self.noise(job.runtime)
        if "shadow_index" not in job.memory:
            model = copy.deepcopy(job.model)
            job.layout.load_into(model, job.global_vec)
            _, logits = predict(model, noise, batch_size=256)
            logits = logits.numpy().astype(np.float32)
            keep = compress(noise, logits, job.train.batch_size, self.params.compress_ratio,
                            derive_seed(job.runtime.scenario.seed, WALK))
            job.memory["shadow_index"] = keep
            job.memory["shadow_logits"] = logits[keep]
        keep = np.asarray(job.memory["shadow_index"], dtype=np.int64)
        return noise[keep], np.asarray(job.memory["shadow_logits"], dtype=np.float32)

    def benign_estimate(self, job: AttackerRound, names: list[str]) -> torch.Tensor | None:
        """Δθ̂ of the output layer from the smoothed global models (None before two are seen); updates the memory."""
        theta, a = job.global_vec.detach(), self.params.smoothing
        mem = job.memory
        if "s1" not in mem:
            mem["s1"] = theta.numpy().copy()
            return None
        s1 = torch.from_numpy(np.asarray(mem["s1"], dtype=np.float32))
        if "s2" not in mem:
            s2 = theta.clone()
        else:
            s1, s2 = smooth(s1, torch.from_numpy(np.asarray(mem["s2"], dtype=np.float32)), theta, a)
        mem["s1"], mem["s2"] = s1.numpy().copy(), s2.numpy().copy()
        pred = job.layout.unflatten(brown_forecast(s1, s2, a) - theta)
        return torch.cat([pred[n].reshape(-1) for n in names])

    # --- one round -------------------------------------------------------------------------------
    def local_train(self, job: AttackerRound) -> tuple[int, dict, dict]:
        rt, p = job.runtime, self.params
        check_class(p.target_class, rt)
        x, logits = self.shadow(job)
        names = output_layer(job.model)
        benign = self.benign_estimate(job, names)
        mask, value = self.mask(rt), trigger_value(rt, p.value)
        z_t = target_vector(rt.data.num_classes, p.target_class, p.target_logit)
        scenario = rt.scenario
        pool = p.resolve_attackers(scenario.federation.num_clients, scenario.seed) if p.collude else [job.partition_id]
        before = [pid for pid in pool if pid < job.partition_id] if job.partition_id in pool else []
        others: list[torch.Tensor] = []
        for pid in before:  # the colluders' updates, recomputed in id order
            partner = copy.deepcopy(job.model)
            job.layout.load_into(partner, job.global_vec)
            train_fake_client(partner, x, logits, job.global_vec, job.layout, mask, value, z_t,
                              others + ([benign] if benign is not None else []), p, job.train.batch_size,
                              derive_seed(scenario.seed, TRAIN_KEY, job.round, pid))
            upd = job.layout.unflatten(job.layout.flatten_model(partner) - job.global_vec)
            others.append(torch.cat([upd[n].reshape(-1) for n in names]))
        job.layout.load_into(job.model, job.global_vec)
        stats = train_fake_client(job.model, x, logits, job.global_vec, job.layout, mask, value, z_t,
                                  others + ([benign] if benign is not None else []), p, job.train.batch_size,
                                  derive_seed(scenario.seed, TRAIN_KEY, job.round, job.partition_id))
        n = len(rt.client_data(job.partition_id)[1])
        return n, stats, {"num_examples": n, **job.config}

    def finish_update(self, delta: torch.Tensor, info: dict) -> torch.Tensor:
        return delta * self.params.weight_scale
