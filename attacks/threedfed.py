"""3DFed: adaptive, extensible covert backdoor (Li et al., IEEE S&P 2023, "3DFed: Adaptive and Extensible
Framework for Covert Backdoor Attack in Federated Learning"; issue #37). Simulation only.

The attacker controls several clients and, each attack round, crafts all their updates together
from one backdoor update, hiding it with three evasion modules, and reads from the next global
model which of them the defence accepted:

1. backdoor training with a constrained loss: from the global model θ_g on the attacker's data,
   L = 0.3·CE(x, y) + 0.3·CE(x ⊕ Δ, y_t) + 0.4·‖θ − θ_g‖₂ for `poison_epochs` (15) epochs; the
   update Δ_b is scaled up to the norm of a benign reference update Δ_n (the same data trained
   honestly): Δ_b ← max(1, min(‖Δ_n‖/‖Δ_b‖, `max_scale`))·Δ_b;
2. indicators: one coordinate per crafted update in the `indicator_layer` (default the last conv
   weight) where both updates are small and the loss is flat: the `num_candidates`·D coordinates
   with the smallest |Δ_b| + |Δ_n|, then the D of them with the smallest |H·1| (the curvature, the
   loss Hessian times a ones vector, summed over the clean and backdoor batches). Each crafted
   update carries its indicator's value multiplied by `indicator_scale` (1e5);
3. noise masks on the output layer: the adversaries form groups of `group_size` (2); each group
   draws `num_neurons` (8) output neurons other than the target and optimises one mask M_i per
   member, 30 SGD steps of [α·Σ_j c_u/UP_j(Δ_b + M_i) + (1−α)·c_n‖M_i‖ + λ·c_l‖Σ_i M_i‖]/(1+λ),
   UP_j the L1 norm of neuron j's incoming update, with dual ascent λ += `lagrange_step`·‖Σ_i M_i‖
   so the masks cancel in the group's sum: they raise the update's low-UP neurons (what DeepSight
   counts) without moving the aggregate;
4. decoy models: k extra updates trained honestly (cross-entropy) but with one coordinate of the
   `decoy_layer` (the k coordinates where Δ_b and Δ_n differ least) pushed away from the benign
   model's value (loss −10·|w − w_n| until it exceeds 10), to attract a clustering defence;
5. adaptive tuning: from the next global update g, each indicator's feedback g[I]/v reads
   rejected (≤ `threshold`), clipped (≤ 0.8·max) or accepted; a feedback above 1 or below
   −threshold means the server adds noise (weak DP), after which α = 0.1 for every group and the
   tuning stops. k drops by the accepted decoys and rises by one when nothing was accepted; the
   groups' α is redrawn uniformly from [`alpha_low`, 1), near the accepted groups' α when some
   were accepted (the official `adaptive_tuning`).

This follows the authors' code (github.com/haoyangliASTAPLE/3DFed: `attacks/thrdfed.py`
`perform_attack`; `attacks/components/indicator.py`, `mask.py`, `decoy.py`, `tuning.py`;
`attacks/loss_functions.py`; the MNIST constants of `configs/mnist_fed.yaml` and the loss
functions, which suit fedsim's small models: mask std 0.05 (0.01 under weak DP), c_u = 0.1,
c_n = 0.08, c_l = 0.1, threshold 1e-4, zero indicator fill 1e-2). Its state across rounds (α per
group, k, the weak-DP flag, the indicators and the global model they were planted in) is the
attack's, checkpointed with the server (`stateful=True`).

Where fedsim differs, and why:
* the official attack runs after every client trained, writes every adversary's update and
  *overwrites* the last k benign participants' updates with the decoys. Here it is a server-side
  attack: it replaces the round's striking attackers' rows, and the decoys take k of those rows
  (at most all but one), since fedsim gives an attacker no honest client's place;
* the backdoor and the benign reference are trained on the lowest-id attacker's partition (the
  official adversary 0's), with the scenario's optimizer settings and this round's lr;
* the official picks indicators, candidates and decoy coordinates with streaming loops that keep a
  running list (the decoy one updates the wrong slot after a replacement); here they are exact
  sorts: the smallest (|Δ_b| + |Δ_n|), then the smallest (|curvature|, |Δ_b| + |Δ_n|), ties by index;
* groups are indexed by mask (the official shuffles the adversaries after grouping the masks and
  then reads the feedback by adversary, mixing groups); rows carry the masks in order;
* layers are named by parameter (`indicator_layer`, `noise_layer`, `decoy_layer`), by default the
  last conv weight (the first linear weight without conv layers), the last linear layer and the
  first linear weight, as the official MNIST choices conv2 / fc2 / fc1;
* the trigger is fedsim's pixel pattern (`pattern`, `size`, `location`, `value`), stamped on the whole
  backdoor batch (official MNIST poisoning_proportion 1.0).
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np
import torch
from pydantic import Field
from torch import nn
from torch.nn import functional as F

from fedsim.attacks.base import AttackParams, Crafted, ServerAttack
from fedsim.attacks.trigger import PixelTrigger, check_class, image_hw, stamped_test_set, trigger_mask, trigger_value
from fedsim.registry import ATTACKS
from fedsim.seeding import derive_seed
from fedsim.training import TrainConfig, sgd_epochs, train
from fedsim.updates import RoundContext

KEY = 0x3DFED  # purpose key of the attack's own training


class ThreeDFedParams(PixelTrigger, AttackParams):  # the trigger: pattern, size, location, value
    num_attackers: int = Field(4, ge=1, description="clients the attacker controls (official fl_number_of_adversaries: 4)")
    target_class: int = Field(8, ge=0, description="label the trigger leads to (official backdoor_label: 8)")
    poison_epochs: int = Field(15, ge=1, description="epochs of the constrained backdoor training (official fl_poison_epochs: 15)")
    normal_weight: float = Field(0.3, ge=0, description="weight of the clean loss (official fixed_scales normal: 0.3)")
    backdoor_weight: float = Field(0.3, ge=0, description="weight of the backdoor loss (official: 0.3)")
    distance_weight: float = Field(0.4, ge=0, description="weight of ‖θ − θ_g‖₂ (official eu_constraint: 0.4)")
    max_scale: float = Field(5.0, ge=1, description="largest factor scaling the backdoor update up to the benign norm (official fl_weight_scale: 5)")
    group_size: int = Field(2, ge=1, description="adversaries sharing a noise-mask group (official fl_adv_group_size: 2)")
    num_neurons: int = Field(8, ge=1, description="output neurons each group's masks perturb (official fl_num_neurons: 8)")
    alpha_low: float = Field(0.0, ge=0, lt=1, description="α is drawn from [alpha_low, 1) (official noise_mask_alpha: 0)")
    lagrange_step: float = Field(0.1, gt=0, description="dual ascent step on λ (official lagrange_step: 0.1)")
    mask_steps: int = Field(30, ge=1, description="SGD steps of the noise masks (official: 30)")
    mask_lr: float = Field(0.1, gt=0, description="lr of the masks' SGD (official: 0.1)")
    mask_momentum: float = Field(0.9, ge=0, lt=1, description="momentum of the masks' SGD (official momentum: 0.9)")
    mask_weight_decay: float = Field(5e-4, ge=0, description="weight decay of the masks' SGD (official decay: 5e-4)")
    mask_std: float = Field(0.05, gt=0, description="std of the masks' initial noise (official MNIST: 0.05; CIFAR: 0.01)")
    mask_std_weak_dp: float = Field(0.01, gt=0, description="the std once weak DP is detected (official MNIST: 0.01)")
    ups_coef: float = Field(0.1, gt=0, description="c_u of the UP loss (official: 1e-1)")
    norm_coef: float = Field(0.08, ge=0, description="c_n of the mask norm loss (official MNIST: 8e-2)")
    lagrange_coef: float = Field(0.1, ge=0, description="c_l of the group-sum loss (official MNIST: 1e-1)")
    num_candidates: int = Field(10, ge=1, description="indicator candidates per crafted update (official MNIST/CIFAR: 10)")
    indicator_scale: float = Field(1e5, gt=1, description="factor on the indicator coordinate (official: 1e5)")
    indicator_fill: float = Field(1e-2, gt=0, description="added to an indicator that is exactly zero (official MNIST: 1e-2)")
    threshold: float = Field(1e-4, gt=0, description="feedback at or below it reads rejected (official MNIST: 1e-4)")
    clip_ratio: float = Field(0.8, gt=0, lt=1, description="feedback at or below this share of the largest reads clipped (official: 0.8)")
    decoy_threshold: float = Field(10.0, gt=0, description="decoy parameter distance beyond which it stops pushing (official: 10)")
    indicator_layer: str | None = Field(None, description="parameter carrying the indicators; default: the last conv weight (first linear weight without conv)")
    noise_layer: str | None = Field(None, description="linear module whose weight and bias carry the noise masks; default: the last nn.Linear")
    decoy_layer: str | None = Field(None, description="parameter with the decoys' pushed coordinate; default: the first linear weight")


# --------------------------------------------------------------------------- pure functions
def read_feedback(global_update: torch.Tensor, index: torch.Tensor, value: torch.Tensor, threshold: float,
                  clip_ratio: float) -> tuple[list[str], bool]:
    """The official `read_indicator`: each indicator's feedback g[I]/v as 'r' (≤ threshold), 'c'
    (≤ clip_ratio·max) or 'a'; (statuses so far, True) when one exceeds 1 or is below −threshold (weak DP)."""
    fb = (global_update[index].double() / value.double()).tolist()
    top = max(fb) if fb else 0.0
    accept = []
    for f in fb:
        if f > 1 or f < -threshold:
            return accept, True
        accept.append("r" if f <= threshold else "c" if f <= top * clip_ratio else "a")
    return accept, False


def adaptive_tuning(accept: list[str], alpha: list[float], k: int, weak_dp: bool, num_adv: int, group_size: int,
                    low: float, uniform) -> tuple[list[float], int]:
    """The official `adaptive_tuning`; `uniform(a, b)` draws one number from [a, b)."""
    alpha = list(alpha)
    if weak_dp:
        return [0.1] * len(alpha), k
    adv, dec = accept[:num_adv], accept[num_adv:]
    k = max(k - dec.count("a"), 0)
    if "a" not in adv and "c" not in adv and dec.count("a") == 0:
        k += 1
    full = num_adv // group_size
    cand = sorted(alpha[i] for i in range(min(full, len(alpha)))
                  if accept[i * group_size:(i + 1) * group_size].count("a") >= group_size * 0.8)
    for i in range(min(full, len(alpha))):
        if full <= 1:
            if not cand:
                alpha = [uniform(low, 1.0) for _ in alpha]
            break
        if len(cand) == full:
            alpha[i] = uniform(cand[0], cand[1])
        elif cand:
            alpha[i] = uniform(cand[0], cand[0] + 0.1)
        else:
            alpha[i] = uniform(low, 1.0)
    return [0.99 if a >= 1 else 0.01 if a <= 0 else a for a in alpha], k


def pick_indicators(analog: torch.Tensor, curvature: torch.Tensor, count: int, per: int) -> torch.Tensor:
    """`count` flat indices: among the count·per smallest `analog`, the smallest (|curvature|, analog)."""
    cand = torch.argsort(analog, stable=True)[: count * per]
    order = np.lexsort((analog[cand].numpy(), curvature[cand].abs().numpy()))
    return cand[torch.from_numpy(order[:count])]


def group_masks(backdoor_w: torch.Tensor, backdoor_b: torch.Tensor, neurons: torch.Tensor, alpha: float, members: int,
                p: ThreeDFedParams, std: float, gen: torch.Generator) -> tuple[list[torch.Tensor], float]:
    """One group's noise masks ([out, in + 1] each: weight and bias columns) by the official
    `noise_mask_design`: centred Gaussian start, `mask_steps` SGD steps of the Lagrangian, dual ascent."""
    bd = torch.cat([backdoor_w, backdoor_b.unsqueeze(1)], dim=1).detach()
    start = torch.randn((members, *bd.shape), generator=gen) * std
    start = start - start.mean(0, keepdim=True)  # the group's masks sum to zero
    masks = [start[i].clone().requires_grad_(True) for i in range(members)]
    opts = [torch.optim.SGD([m], lr=p.mask_lr, momentum=p.mask_momentum, weight_decay=p.mask_weight_decay) for m in masks]
    lam = 1.0
    for _ in range(p.mask_steps):
        for m in masks:
            m.grad = None
        total = torch.stack([m[neurons] for m in masks]).sum(0)
        lag = p.lagrange_coef * torch.linalg.vector_norm(total)
        losses = []
        for m in masks:
            ups = (bd[neurons] + m[neurons]).abs().sum(dim=1)
            loss = alpha * (p.ups_coef / ups).sum() + (1 - alpha) * p.norm_coef * torch.linalg.vector_norm(m[neurons])
            losses.append((loss + lam * lag) / (1 + lam))
        for loss, opt in zip(losses, opts):  # as the official: each backward adds to the others' gradients
            loss.backward(retain_graph=True)
            opt.step()
        with torch.no_grad():
            lam += p.lagrange_step * float(torch.linalg.vector_norm(torch.stack([m[neurons] for m in masks]).sum(0)))
    return [m.detach() for m in masks], lam


def implant(row: torch.Tensor, index: int, scale: float, fill: float) -> float:
    """row[index] ×= scale (+ fill where it is zero); returns the planted value."""
    row[index] = row[index] * scale
    if row[index] == 0:
        row[index] = fill
    return float(row[index])


# --------------------------------------------------------------------------- the attack
@ATTACKS.register("threedfed", ThreeDFedParams, stateful=True)
class ThreeDFed(ServerAttack):
    """3DFed (S&P 2023): a constrained backdoor hidden by noise masks, indicators and decoys, tuned from the attack's feedback (simulation only)."""

    simulation_only = True

    def __init__(self, params) -> None:
        super().__init__(params)
        self.load_state_dict({})

    # --- state across rounds ---------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"alpha": list(self.alpha), "k": self.k, "weak_dp": self.weak_dp, "num_adv": self.num_adv,
                "index": self.index, "value": self.value, "last_global": self.last_global}

    def load_state_dict(self, state: dict) -> None:
        self.alpha = [float(a) for a in state.get("alpha", [])]  # α of each noise-mask group
        self.k = int(state.get("k", 0))  # decoy models
        self.weak_dp = bool(state.get("weak_dp", False))
        self.num_adv = int(state.get("num_adv", 0))  # adversary rows in the last attack round (the rest were decoys)
        self.index = state.get("index")  # [D] flat indices of the planted indicators
        self.value = state.get("value")  # [D] their planted values
        self.last_global = state.get("last_global")  # [d] the global model they were planted in

    # --- measurement -----------------------------------------------------------------------------
    def mask(self, runtime) -> np.ndarray:
        p = self.params
        return trigger_mask(image_hw(runtime), p.pattern, p.size, p.location)

    def backdoor_test_set(self, runtime, shared=None):
        return stamped_test_set(runtime, self.mask(runtime), trigger_value(runtime, self.params.value), self.params.target_class)

    def report(self, runtime) -> dict:
        return {"target_class": self.params.target_class, "trigger_pixels": int(self.mask(runtime).sum())}

    # --- layers ----------------------------------------------------------------------------------
    def layers(self, model: nn.Module) -> tuple[str, str, str]:
        """(indicator parameter, noise-mask linear module, decoy parameter)."""
        p = self.params
        convs = [n for n, m in model.named_modules() if isinstance(m, nn.Conv2d)]
        fcs = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
        if not fcs:
            raise ValueError("threedfed needs a model with nn.Linear layers (output layer for the noise masks)")
        names = dict(model.named_parameters())
        ind = p.indicator_layer or (f"{convs[-1]}.weight" if convs else f"{fcs[0]}.weight")
        noise = p.noise_layer or fcs[-1]
        decoy = p.decoy_layer or f"{fcs[0]}.weight"
        for field, name in (("indicator_layer", ind), ("decoy_layer", decoy), ("noise_layer", f"{noise}.weight")):
            if name not in names:
                raise ValueError(f"attack.{field}: the model has no parameter {name!r} (it has {sorted(names)})")
        return ind, noise, decoy

    # --- one round -------------------------------------------------------------------------------
    def craft(self, honest: torch.Tensor, num_malicious: int, ctx: RoundContext) -> Crafted:
        tools = ctx.tools
        if tools is None or not hasattr(tools, "rt"):
            raise ValueError("threedfed needs the server's runtime (RoundContext.tools) to train on the attackers' data")
        rt, p = tools.rt, self.params
        check_class(p.target_class, rt)
        gen = ctx.generator

        def uniform(a: float, b: float) -> float:
            return a + (b - a) * float(torch.rand((), generator=gen, device=gen.device))

        theta = ctx.global_weights.detach().to("cpu", torch.float32)
        layout = ctx.layout
        log: dict = {}
        if self.last_global is not None and self.index is not None and not self.weak_dp:
            accept, self.weak_dp = read_feedback(theta - self.last_global, self.index, self.value, p.threshold, p.clip_ratio)
            self.alpha, self.k = adaptive_tuning(accept, self.alpha, self.k, self.weak_dp, self.num_adv, p.group_size,
                                                 p.alpha_low, uniform)
            log["acceptance"] = "".join(accept)
        elif self.weak_dp:
            self.alpha = [0.1] * len(self.alpha)
        n_dec = min(self.k, num_malicious - 1)
        n_adv = num_malicious - n_dec
        groups = math.ceil(n_adv / p.group_size)
        while len(self.alpha) < groups:
            self.alpha.append(0.1 if self.weak_dp else uniform(p.alpha_low, 1.0))

        leader = rt.attackers[0]
        x, y = rt.data.x_train[rt.partitions[leader]], rt.data.y_train[rt.partitions[leader]]
        fed = rt.scenario.federation
        cfg = TrainConfig(fed.local_epochs, fed.batch_size, rt.lr(ctx.round), fed.momentum, fed.weight_decay)
        seed = derive_seed(rt.scenario.seed, KEY, ctx.round)
        mask = torch.from_numpy(self.mask(rt))
        value = torch.as_tensor(np.asarray(trigger_value(rt, p.value), dtype=np.float32))
        value = value.reshape(-1, 1, 1) if value.ndim == 1 else value

        benign_model = tools.model_of(theta)
        train(benign_model, x, y, cfg, seed)
        benign = layout.flatten_model(benign_model) - theta
        bd_model = tools.model_of(theta)
        backdoor = self.backdoor_update(bd_model, x, y, theta, layout, cfg, mask, value, derive_seed(seed, 1))
        bd_norm, bn_norm = float(backdoor.norm()), float(benign.norm())
        scale = max(min(bn_norm / bd_norm, p.max_scale), 1.0) if bd_norm > 0 else 1.0
        backdoor = backdoor * scale
        log.update({"scale": scale, "alpha": list(self.alpha[:groups]), "decoys": n_dec, "weak_dp": self.weak_dp})

        ind_name, noise_mod, decoy_name = self.layers(bd_model)
        total = n_adv + n_dec
        ind_slice = layout.slice(ind_name)
        curv = self.curvature(tools.model_of(theta), ind_name, x, y, mask, value, cfg.batch_size)
        local = pick_indicators(backdoor[ind_slice].abs() + benign[ind_slice].abs(), curv, total, p.num_candidates)
        index = local + ind_slice.start

        rows = backdoor.unsqueeze(0).repeat(total, 1)
        w_sl, b_sl = layout.slice(f"{noise_mod}.weight"), layout.slice(f"{noise_mod}.bias")
        w_shape = dict(zip(layout.names, layout.shapes))[f"{noise_mod}.weight"]
        std = p.mask_std_weak_dp if self.weak_dp else p.mask_std
        others = [c for c in range(w_shape[0]) if c != p.target_class]
        for g in range(groups):
            members = list(range(g * p.group_size, min((g + 1) * p.group_size, n_adv)))
            pick = torch.randperm(len(others), generator=gen, device=gen.device).cpu()[: p.num_neurons]
            neurons = torch.tensor(others)[pick]
            masks, _ = group_masks(backdoor[w_sl].view(w_shape), backdoor[b_sl], neurons, self.alpha[g], len(members), p, std, gen)
            for i, mk in zip(members, masks):
                keep = torch.zeros(w_shape[0], 1)
                keep[neurons] = 1.0
                mk = mk * keep
                rows[i, w_sl] += mk[:, :-1].reshape(-1)
                rows[i, b_sl] += mk[:, -1]
        for j in range(n_dec):
            rows[n_adv + j] = self.decoy(tools.model_of(theta), benign_model, decoy_name, backdoor, benign, layout, j,
                                         n_dec, x, y, cfg, derive_seed(seed, 2, j), theta)
        values = [implant(rows[i], int(index[i]), p.indicator_scale, p.indicator_fill) for i in range(total)]
        self.index, self.value = index, torch.tensor(values, dtype=torch.float64)
        self.num_adv, self.last_global = n_adv, theta.clone()
        return Crafted(rows.to(device=honest.device, dtype=honest.dtype), log)

    def backdoor_update(self, model: nn.Module, x, y, theta, layout, cfg: TrainConfig, mask, value, seed: int) -> torch.Tensor:
        """The constrained backdoor training (official eu_constraint blind loss), every input of the backdoor batch stamped."""
        p = self.params
        anchor = [t.detach().clone() for t in layout.unflatten(theta).values()]
        params = [q for _, q in model.named_parameters()]

        def loss_fn(xb, yb):
            normal = F.cross_entropy(model(xb), yb)
            bd = F.cross_entropy(model(torch.where(mask, value, xb)), torch.full_like(yb, p.target_class))
            dist = torch.linalg.vector_norm(torch.cat([(q - a).reshape(-1) for q, a in zip(params, anchor)]))
            return p.normal_weight * normal + p.backdoor_weight * bd + p.distance_weight * dist, normal

        sgd_epochs(model, params, x, y, cfg.batch_size, [cfg.lr] * p.poison_epochs, cfg.momentum, cfg.weight_decay, seed, loss_fn)
        return layout.flatten_model(model) - theta

    def curvature(self, model: nn.Module, name: str, x, y, mask, value, batch_size: int) -> torch.Tensor:
        """Σ over batches of H·1 restricted to `name` (∂/∂W Σ ∂L/∂W), clean and backdoor losses, flattened."""
        model.eval()
        w = dict(model.named_parameters())[name]
        total = torch.zeros_like(w)
        xt, yt = torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(np.ascontiguousarray(y))
        for i in range(0, len(xt), batch_size):
            xb, yb = xt[i : i + batch_size], yt[i : i + batch_size]
            for inp, lab in ((xb, yb), (torch.where(mask, value, xb), torch.full_like(yb, self.params.target_class))):
                (g,) = torch.autograd.grad(F.cross_entropy(model(inp), lab), w, create_graph=True)
                (c,) = torch.autograd.grad(g.sum(), w, allow_unused=True)
                if c is not None:
                    total += c.detach()
        return total.reshape(-1)

    def decoy(self, model: nn.Module, benign_model: nn.Module, name: str, backdoor, benign, layout, j: int, k: int,
              x, y, cfg: TrainConfig, seed: int, theta) -> torch.Tensor:
        """Decoy j: honest training with the coordinate where backdoor and benign updates differ j-th least pushed off the benign value."""
        sl = layout.slice(name)
        coord = int(torch.argsort((backdoor[sl] - benign[sl]).abs(), stable=True)[j])
        target = float(dict(benign_model.named_parameters())[name].detach().reshape(-1)[coord])
        w = dict(model.named_parameters())[name]

        def loss_fn(xb, yb):
            diff = (w.reshape(-1)[coord] - target).abs()
            param_loss = 1e-10 * diff if float(diff) > self.params.decoy_threshold else -10.0 * diff
            acc = F.cross_entropy(model(xb), yb)
            return (param_loss + acc) / 2, acc

        sgd_epochs(model, list(model.parameters()), x, y, cfg.batch_size, [cfg.lr] * cfg.epochs, cfg.momentum,
                   cfg.weight_decay, seed, loss_fn)
        return layout.flatten_model(model) - theta

