"""FLIP (Zhang, Cheng, Wang, Ma, Tao, Zhang, ICLR 2023): benign clients invert backdoor triggers
and harden their local models against them; the server rejects low-confidence predictions.

Each honest client, every round it trains (`flip_train`, the defense's client part):

1. **Trigger inversion** (Neural Cleanse's formulation, as the official code's `Trigger.generate`
   in `invert_MNIST.py` / `invert_CIFAR.py`). For each class t, a mask m_t ∈ [0, 1]^{H×W} (shared
   by the channels) and a pattern p_t ∈ [0, 1]^{C×H×W}, parametrised as m = tanh(m')/(2 − ε) + ½,
   minimise on the client's inputs x not of class t

       L_t = CE( f((1 − m_t) ⊙ x + m_t ⊙ p_t), t ) + c_t · ||m_t||_1

   with Adam (lr 0.1, betas (0.5, 0.9)). The cost c_t starts at 10⁻³; after `patience` = 10
   consecutive steps whose stamped inputs reach the target at rate ≥ 0.9 it grows ×1.5, after 10
   that do not it shrinks ÷1.5^1.5. The smallest mask (L1) that reached 0.9 is kept, and each time
   one is kept the search restarts from it plus U(−0.01, 0.01) noise. All classes are inverted in
   one vectorised computation (their losses are independent and Adam is per coordinate, so this
   is the per-class optimisation run side by side).
2. **Hardening.** Local training as usual, except that in each batch a `portion` (0.5) of the
   inputs not of a trigger's target class are stamped with that class's inverted trigger and keep
   their true labels, the classes' triggers taking turns batch by batch. A trigger whose mask
   covers more than 1/8 of the input (official: trigger_size > H·W/8) or that never reached the
   success rate is not used.
3. The inverted masks and patterns are the client's memory (fedsim/client/memory.py): the next
   round's inversion starts from them (official: `local_mat[agent]["mask_dict"]`), with
   `steps` Adam steps instead of the first round's `warmup_steps`; a class whose inversion
   fails in a round keeps its last trigger in memory (not used that round).

At inference (`flip_inference`) the server rejects an input whose top softmax probability is
below the threshold τ: it counts as not correct for the main accuracy and as no hit for the
backdoor success (official `test.py: Mytest / Mytest_poison`: `correct` only when
`probabilities >= confidence_threshold`, over all inputs). τ = 0.4 is the official config for
continuous attacks (0 for single-shot ones, which turns rejection off).

The server aggregates as the scenario says (FLIP's official runs: FedAvg); the defense's
`before`/`after` leave the updates alone. Attackers do not run it: they train as their attack says.

Where fedsim differs from the official code, and why:
- The official client, after a warm-up that inverts one universal trigger per class (what is
  implemented here), goes on to MOTH's pair schedule (Tao et al., S&P 2022): symmetric
  source↔target triggers (`TriggerCombo`) for the pair whose trigger size shrinks fastest
  (`mat_diff`), a random pair 30% of the time, 100 extra steps. fedsim inverts all classes'
  universal (all-to-one) triggers every round, warm-started from the client's memory; the pair
  phase is not implemented (the paper's analysis, Section 4, is about universal triggers).
- The official hardening loop trains with its own Adam (lr 0.01) for up to 10 epochs; here the
  hardened training is the scenario's local training (federation lr, epochs, batch size,
  momentum, weight decay), so FLIP's cost and accuracy compare with plain training. FedProx's
  term is not added.
- Patterns span the client's data range [min x, max x] (the official code's [0, 1], the range of
  its unnormalised images); stamped inputs are clipped to it, as the code clips to [0, 1].
- The inversion set is `samples_per_class` inputs of each class the client holds more than that
  many of (official `size_min` = 1: one per class, `x_extra`); images and flat inputs alike (a
  flat input's mask is per feature).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from pydantic import Field

from fedsim.defenses.base import Defense
from fedsim.registry import DEFENSES, Params
from fedsim.seeding import derive_seed
from fedsim.training import Adam, on_device, sgd_epochs
from fedsim.devices import resolve_device

TANH_EPS = 1e-7  # the code's self.epsilon in tanh(m') / (2 - ε) + ½
RESTART_NOISE = 0.01  # U(-0.01, 0.01) around the best trigger when the search restarts from it
COST_UP, COST_DOWN = 1.5, 1.5 ** 1.5  # the code's cost_multiplier_up / _down
FLIP_STREAM = 0xF11  # seed stream of a client's inversion and stamping draws
MEMORY = ("flip.mask", "flip.pattern", "flip.found")  # the client's memory keys


class FLIPParams(Params):
    confidence_threshold: float = Field(
        0.4, ge=0, lt=1, description="τ: the server rejects an input whose top softmax probability is below it (official: "
        "0.4 for continuous attacks, 0 = no rejection for single-shot ones)")
    portion: float = Field(0.5, gt=0, le=1, description="share of a batch's inputs not of the trigger's target stamped with it (official portion 0.5)")
    warmup_steps: int = Field(400, ge=1, description="Adam steps of a client's first inversion (official warm-up trigger_steps 400)")
    steps: int = Field(200, ge=1, description="Adam steps of later inversions, started from the client's last triggers (official 200)")
    samples_per_class: int = Field(1, ge=1, description="inputs per class the triggers are inverted on (official size_min 1)")
    lr: float = Field(0.1, gt=0, description="Adam learning rate of the inversion (official 0.1, betas (0.5, 0.9))")
    init_cost: float = Field(1e-3, gt=0, description="initial weight c of the mask's L1 norm (official 1e-3)")
    success_threshold: float = Field(0.9, gt=0, le=1, description="stamped inputs' target rate a trigger must reach (official 0.9)")
    patience: int = Field(10, ge=1, description="steps above / below the success rate before the cost grows / shrinks (official 10)")
    max_mask_fraction: float = Field(0.125, gt=0, le=1, description="a trigger whose mask L1 exceeds this share of the input's area is not used (official 1/8)")


# --- trigger inversion ----------------------------------------------------------------------------
def mask_shape(input_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The mask's shape: one value per pixel shared by the channels of an image [C, H, W], else per feature."""
    return (1, *input_shape[1:]) if len(input_shape) == 3 else tuple(input_shape)


def to_param(v: torch.Tensor) -> torch.Tensor:
    """[0, 1] -> the unconstrained parameter (the code's arctanh((v - ½)(2 - ε)))."""
    return torch.atanh((v.clamp(0, 1) - 0.5) * (2 - TANH_EPS))


def from_param(v: torch.Tensor) -> torch.Tensor:
    return torch.tanh(v) / (2 - TANH_EPS) + 0.5


def stamp(x: torch.Tensor, mask: torch.Tensor, pattern: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    """(1 − m) ⊙ x + m ⊙ p, with p ∈ [0, 1] mapped onto the data range [lo, hi] and the result clipped to it."""
    return ((1 - mask) * x + mask * (lo + (hi - lo) * pattern)).clamp(lo, hi)


def inversion_set(y: np.ndarray, per_class: int) -> np.ndarray:
    """Indices of the first `per_class` inputs of each class with more than that many (official x_extra)."""
    classes, counts = np.unique(y, return_counts=True)
    keep = [np.flatnonzero(y == c)[:per_class] for c, n in zip(classes, counts) if n > per_class]
    return np.concatenate(keep) if keep else np.zeros(0, dtype=np.int64)


def invert_triggers(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, num_classes: int, params: FLIPParams,
                    steps: int, generator: torch.Generator, init: tuple[torch.Tensor, torch.Tensor] | None = None,
                    data_range: tuple[float, float] = (0.0, 1.0)) -> dict[str, torch.Tensor]:
    """Every class's universal trigger on inputs (x, y), side by side: {"mask" [K, *mask], "pattern"
    [K, *input] (both in [0, 1]), "found" [K] bool (reached the success rate), "l1" [K] (the kept
    mask's L1; inf where none was found)}. `init`: the (mask, pattern) to start from, else uniform
    random. The model is left as it was (its parameters get no gradient)."""
    k, m = num_classes, len(x)
    shape = tuple(x.shape[1:])
    if init is None:
        m0 = torch.rand((k, *mask_shape(shape)), generator=generator)
        p0 = torch.rand((k, *shape), generator=generator)
    else:
        m0, p0 = init
    mask_p = to_param(m0.to(x.device)).requires_grad_(True)
    pattern_p = to_param(p0.to(x.device)).requires_grad_(True)
    opt = Adam([mask_p, pattern_p], lr=params.lr, betas=(0.5, 0.9))
    valid = (y[None, :] != torch.arange(k, device=x.device)[:, None]).to(x.dtype)  # [K, M]: inputs not of class t
    n_valid = valid.sum(1).clamp_min(1)
    targets = torch.arange(k, device=x.device).repeat_interleave(m)
    cost = torch.full((k,), float(params.init_cost), device=x.device)
    up = torch.zeros(k, dtype=torch.int64, device=x.device)
    down = torch.zeros_like(up)
    best_reg = torch.full((k,), math.inf, device=x.device)
    best_m, best_p = torch.zeros_like(m0, device=x.device), torch.zeros_like(p0, device=x.device)
    lo, hi = data_range
    was_training = model.training
    frozen = [(p, p.requires_grad) for p in model.parameters()]
    model.eval()
    for p, _ in frozen:
        p.requires_grad_(False)
    try:
        for _ in range(steps):
            mask, pattern = from_param(mask_p), from_param(pattern_p)
            adv = stamp(x[None], mask[:, None], pattern[:, None], lo, hi)  # [K, M, *input]
            logits = model(adv.reshape(k * m, *shape))
            ce = torch.nn.functional.cross_entropy(logits, targets, reduction="none").view(k, m)
            hit = (logits.argmax(1) == targets).view(k, m).to(x.dtype)
            acc = (hit * valid).sum(1) / n_valid
            reg = mask.abs().flatten(1).sum(1)  # the code's sum(|mask repeated over channels|) / channels
            loss = ((ce * valid).sum(1) / n_valid + cost * reg).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad():
                ok = acc >= params.success_threshold
                better = ok & (reg < best_reg)
                if better.any():
                    best_m[better], best_p[better], best_reg[better] = mask[better], pattern[better], reg[better]
                    noise_m = torch.rand(best_m[better].shape, generator=generator).to(x.device)
                    noise_p = torch.rand(best_p[better].shape, generator=generator).to(x.device)
                    mask_p[better] = to_param(best_m[better] + (2 * noise_m - 1) * RESTART_NOISE)
                    pattern_p[better] = to_param(best_p[better] + (2 * noise_p - 1) * RESTART_NOISE)
                up, down = torch.where(ok, up + 1, 0), torch.where(ok, 0, down + 1)
                grow, shrink = up >= params.patience, (up < params.patience) & (down >= params.patience)
                cost = torch.where(grow, torch.where(cost == 0, params.init_cost, cost * COST_UP), cost)
                cost = torch.where(shrink, cost / COST_DOWN, cost)
                up, down = torch.where(grow, 0, up), torch.where(shrink, 0, down)
    finally:
        for p, flag in frozen:
            p.requires_grad_(flag)
        model.train(was_training)
    return {"mask": best_m.detach(), "pattern": best_p.detach(), "found": torch.isfinite(best_reg), "l1": best_reg}


# --- the client part -----------------------------------------------------------------------------
def flip_train(spec: FLIPParams, job) -> tuple[torch.Tensor, dict]:
    """An honest client's round under FLIP (fedsim/client/steps.py HonestTraining `job`): invert
    every class's trigger, then train with a portion of each batch stamped and correctly labelled."""
    rt = job.rt
    num_classes = int(rt.data.num_classes)
    device = resolve_device(job.cfg.device, "TrainConfig.device")
    gen = torch.Generator().manual_seed(derive_seed(job.seed, FLIP_STREAM))
    x_all = torch.from_numpy(np.asarray(job.x, dtype=np.float32))
    lo, hi = float(x_all.min()), float(x_all.max())
    pick = inversion_set(np.asarray(job.y), spec.samples_per_class)
    memory = job.memory
    init = None
    if all(key in memory for key in MEMORY) and memory["flip.mask"].shape[0] == num_classes:
        init = (torch.from_numpy(np.array(memory["flip.mask"])), torch.from_numpy(np.array(memory["flip.pattern"])))
    found = torch.zeros(num_classes, dtype=torch.bool)
    mask = pattern = None
    inversion_samples = 0
    if len(pick):
        steps = spec.steps if init is not None else spec.warmup_steps
        x_inv = x_all[torch.from_numpy(pick)].to(device)
        y_inv = torch.from_numpy(np.asarray(job.y)[pick].astype(np.int64)).to(device)
        with on_device(job.model, device):
            out = invert_triggers(job.model, x_inv, y_inv, num_classes, spec, steps, gen, init, (lo, hi))
        mask, pattern = out["mask"].cpu(), out["pattern"].cpu()
        area = math.prod(mask.shape[1:])
        found = out["found"].cpu() & (out["l1"].cpu() <= spec.max_mask_fraction * area)
        keep_found = out["found"].cpu()
        if init is not None:  # a class not found this round keeps the trigger it had
            mask = torch.where(keep_found.view(-1, *[1] * (mask.ndim - 1)), mask, init[0])
            pattern = torch.where(keep_found.view(-1, *[1] * (pattern.ndim - 1)), pattern, init[1])
            keep_found = keep_found | torch.from_numpy(np.array(memory["flip.found"]).astype(bool))
        memory["flip.mask"], memory["flip.pattern"] = mask.numpy(), pattern.numpy()
        memory["flip.found"] = keep_found.numpy().astype(np.uint8)
        inversion_samples = steps * num_classes * len(pick)
    used = torch.nonzero(found).flatten().tolist()
    step = [0]

    def loss_fn(xb: torch.Tensor, yb: torch.Tensor):
        if used:
            t = used[step[0] % len(used)]
            step[0] += 1
            others = torch.nonzero(yb != t).flatten()
            count = int(len(others) * spec.portion)
            if count:
                chosen = others[torch.randperm(len(others), generator=gen)[:count].to(others.device)]
                xb = xb.clone()
                xb[chosen] = stamp(xb[chosen], mask[t].to(xb.device), pattern[t].to(xb.device), lo, hi)
        return torch.nn.functional.cross_entropy(job.model(xb), yb)

    cfg = job.cfg
    stats = sgd_epochs(job.model, list(job.model.parameters()), np.asarray(job.x), np.asarray(job.y), cfg.batch_size,
                       [cfg.lr] * cfg.epochs, cfg.momentum, cfg.weight_decay, job.seed, loss_fn, None, cfg.max_steps,
                       device=device, precision=cfg.precision, deterministic=cfg.deterministic)
    stats = dict(stats, samples=stats["samples"] + inversion_samples, triggers_used=len(used))
    return job.layout.flatten_model(job.model) - job.global_vec, stats


# --- the server's inference -------------------------------------------------------------------------
def confidence_accept(threshold: float):
    """logits [n, K] -> bool [n]: the top softmax probability is at least `threshold`."""
    def accept(logits: torch.Tensor) -> torch.Tensor:
        return torch.softmax(logits.float(), dim=1).amax(dim=1) >= threshold
    return accept


def flip_inference(spec: FLIPParams, model: torch.nn.Module, runtime: Any, rnd: int | None, state: Any = None):
    """The model as it is, with FLIP's rejection of low-confidence inputs (none at τ = 0)."""
    return model, (confidence_accept(spec.confidence_threshold) if spec.confidence_threshold > 0 else None)


def client_side_problems(sc, index: int) -> list[tuple[str, str, Any]]:
    """What a defense with a client part cannot run with, refused at validation: a second such
    defense (each trains the honest clients its own way) and DETOX's redundancy (a group's honest
    members must compute bit-identical updates; their own memories make them differ)."""
    out = []
    name = sc.defenses[index].name
    others = [d.name for j, d in enumerate(sc.defenses) if j != index and DEFENSES.get(d.name).traits.client_training]
    if others and index > min(j for j, d in enumerate(sc.defenses) if DEFENSES.get(d.name).traits.client_training):
        out.append((f"defenses.{index}", f"defense {name} trains the honest clients its own way, and so does "
                    f"{others[0]}: keep one of them", name))
    if getattr(sc.aggregator, "redundancy", False):
        out.append(("aggregator.redundancy", f"defense {name} trains each honest client from its own memory, so the members "
                    f"of a redundant group would not compute identical updates; drop one of the two", True))
    return out


@DEFENSES.register("flip", FLIPParams, client_training="fedsim.defenses.flip:flip_train",
                   inference="fedsim.defenses.flip:flip_inference", scenario_check=client_side_problems,
                   reads_updates=False)
class FLIP(Defense):
    """FLIP: honest clients invert triggers and train on them correctly labelled; low-confidence predictions are rejected (Zhang et al. 2023)."""
