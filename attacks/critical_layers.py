"""Backdoor-critical layers (Zhuang, Yu, Wang, Hua, Li & Yuan, ICLR 2024, "Backdoor Federated
Learning by Poisoning Backdoor-Critical Layers").

A backdoor lives in a few layers of the network, the backdoor-critical (BC) layers: planting only
those plants the backdoor nearly as well as the whole malicious model, while the rest of the
upload stays benign and looks benign to distance- and cluster-based defenses. Each attack round
the attacker

1. **Layer Substitution Analysis** (LSA), on its own data split into a training part (3/4) and a
   validation part (1/4):
   * trains a benign model θ_b' from the global model on the clean training part until its
     accuracy there reaches `lsa_min_accuracy`, then a malicious model θ_m' from θ_b' for one
     epoch on every batch plus its stamped copy (relabelled to the target); BSR_m = the backdoor
     success rate of θ_m' on the stamped validation part (its non-target images);
   * *forward substitution*: for each layer l, the malicious model with layer l taken from the
     benign one, θ_m'[l ← θ_b'], scores Δ_l = BSR(θ_m'[l ← θ_b']) − BSR_m (how much of the
     backdoor leaves with layer l);
   * *backward substitution*: the layers sorted by Δ_l, most negative first; for n = 1, 2, ...
     the benign model with the first n layers taken from the malicious one, θ_b'[L_n ← θ_m'],
     until its BSR reaches τ·BSR_m. Those n layers are the BC layers (all of them if τ is never
     reached);
2. trains its local benign model θ_b (clean partition) and local malicious model θ_m (every batch
   plus its stamped copy) from the global model θ_g with the federation's local training;
3. uploads, per `variant`:
   * `lp`, the **Layer-wise Poisoning** attack: on the BC layers
     θ_g + λ·(θ_m − θ_g) + max(0, 1 − λ)·(θ_b − θ_g) (the official `craft_model`), elsewhere θ_b;
     λ = 1 sends the malicious BC layers as they are (`train_malicious_LPA`);
   * `lf`, the **Layer-wise Flipping** attack of the official code (`train_malicious_LFA`): on
     the BC layers θ_g − (θ_m − θ_g), the malicious change reversed, elsewhere θ_b.

A "layer" is one parameter tensor (a weight and its bias are two), as the official code iterates
`named_parameters()`; buffers (BatchNorm statistics) are never substituted and come from the model
the substitution starts from, and from θ_b in the upload.

Where this follows the official code (github.com/zhmzm/Poisoning_Backdoor-critical_Layers_Attack,
`models/AttackerUtils.py` `FLS` / `BLS` / `get_key_value_bsr` / `benign_train` /
`malicious_train` / `split_dataset`, `models/Attacker.py` `craft_model` / `BLS_weight`,
`models/MaliciousUpdate.py` `train_malicious_adaptive` / `_LPA` / `_LFA` / `trigger_data`, its
README's quick start `--attack lp_attack --poison_frac 1.0 --attack_goal -1`):

* the LSA's own training: SGD lr 0.1, momentum 0.5, batch 64 (the code's constants:
  `lsa_lr`, `lsa_momentum`, `lsa_batch_size`), one epoch at a time with the accuracy on the
  training part checked every 4th epoch (`lsa_check_every`), at least 90% (`lsa_min_accuracy`;
  93% for CIFAR in the code); past 30 epochs (`lsa_max_epochs` = 32: the first check after 30) it
  stops and keeps the model if its accuracy is above 80% (`lsa_fallback_accuracy`), else finds no
  BC layers this round and uploads θ_b (the code's `layer_analysis_no_acc` returning []);
* the LSA starts from the global model, as the code's `lp_attack` (`get_malicious_info` on the
  global parameters); its 3:1 split is a seeded permutation of the attacker's partition;
* all-to-one backdoor (`--attack_goal -1`): every non-target image stamped is a test case, and the
  malicious training sees each batch plus its stamped copy labelled `target_class`
  (`--poison_frac 1.0`, the quick start's; `trigger_data`). The trigger is fedsim's pixel pattern
  (`attacks/trigger.py`: `pattern`, `size`, `location`, `value`);
* τ defaults to 0.95 (`--mode10_tau`, what `lp_attack`'s backward substitution uses; the code's
  `LPA`/`LFA` path uses `--tau 0.8`); the ordering of ties in Δ is by layer position
  (`heapq.nsmallest` is stable);
* λ defaults to 1 (`train_malicious_LPA`'s x = 1 and `--cifar_scale 1.0`; `lp_attack` takes
  `--cnn_scale 0.5` on its MNIST-size CNNs).

Where it differs, and why:

* the code's `lp_attack` (its "adaptive" mode) also trains benign models on the other colluding
  attackers' partitions in one process, sends their mean (`center_model`) outside the BC layers
  and drops BC layers one by one until a locally simulated Multi-Krum or FLAME accepts the upload
  (`BLS_adaptive`). A fedsim attacker is one device with its own data and memory, so the upload
  outside the BC layers is its own θ_b (the code's `LPA`/`LFA` path) and the layer count is the
  LSA's; that defense-simulating layer control is not implemented;
* the code's `LPA`/`LFA` path would reuse the previous round's BC layers when they still carry the
  backdoor, but resets them before each attacker call and compares with an undefined variable;
  here the LSA runs afresh every attack round (as `lp_attack` does); the `LFA` path's union with
  earlier rounds' layers is empty for the same reason and is not kept;
* the attacker reports its partition's size as its example count (what a benign client of that
  size reports; the stamped copies are made batch by batch, not held as extra data);
* the LSA's forward passes run on the CPU (small splits; the local training uses the federation's
  device settings).

The BC layers of the last attack round are kept in the attacker's memory (`critical_layers`:
their positions among the model's parameters) and logged.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import Literal

import numpy as np
import torch
from pydantic import Field, model_validator
from torch import nn

from fedsim.attacks.base import AttackerRound, AttackParams, ClientAttack
from fedsim.attacks.trigger import PixelTrigger, check_class, image_hw, stamp, stamped_test_set, trigger_mask, trigger_value
from fedsim.registry import ATTACKS
from fedsim.seeding import derive_seed
from fedsim.training import TrainConfig, evaluate, predict, sgd_epochs, train

log = logging.getLogger("fedsim")

SPLIT, LSA_BENIGN, LSA_MALICIOUS, LOCAL_MALICIOUS = 0x15A0, 0x15A1, 0x15A2, 0x15A3  # purpose keys of the random streams
MEMORY_KEY = "critical_layers"


class CriticalLayersParams(PixelTrigger, AttackParams):  # the trigger: pattern, size, location, value
    variant: Literal["lp", "lf"] = Field(
        "lp", description="lp = Layer-wise Poisoning (BC layers poisoned, the rest benign); lf = Layer-wise Flipping "
        "(BC layers' malicious change reversed, official train_malicious_LFA)"
    )
    tau: float = Field(
        0.95, gt=0, le=1,
        description="τ: backward substitution adds BC layers until the benign model with them reaches τ·BSR of the "
        "malicious model (official lp_attack: --mode10_tau 0.95; LPA/LFA path: --tau 0.8)",
    )
    lambda_value: float = Field(
        1.0, ge=0,
        description="λ of the LP upload on the BC layers: θ_g + λ(θ_m − θ_g) + max(0, 1−λ)(θ_b − θ_g) "
        "(official LPA: 1; lp_attack: --cnn_scale 0.5 / --cifar_scale 1.0); unused by lf",
    )
    target_class: int = Field(0, ge=0, description="label the stamped inputs are given (all-to-one)")
    lsa_min_accuracy: float = Field(
        0.9, gt=0, le=1,
        description="LSA's benign model trains until this accuracy on the attacker's training split "
        "(official: 90%, 93% for CIFAR)",
    )
    lsa_max_epochs: int = Field(
        32, ge=0, description="LSA's benign model trains at most this many epochs (official: the first check past 30, 32)"
    )
    lsa_check_every: int = Field(4, ge=1, description="its accuracy is checked every this many epochs (official: 4)")
    lsa_fallback_accuracy: float = Field(
        0.8, ge=0, le=1,
        description="out of epochs below lsa_min_accuracy: the LSA goes on if the accuracy is above this, else no BC "
        "layers this round and the benign model is sent (official: 80%)",
    )
    lsa_lr: float = Field(0.1, gt=0, description="SGD lr of the LSA's models (official: 0.1)")
    lsa_momentum: float = Field(0.5, ge=0, lt=1, description="SGD momentum of the LSA's models (official: 0.5)")
    lsa_batch_size: int = Field(64, ge=1, description="batch size of the LSA's models (official: 64)")
    local_epochs: int | None = Field(None, ge=1, description="attacker's epochs; default: federation.local_epochs")
    lr: float | None = Field(None, gt=0, description="attacker's lr; default: the honest clients' lr")

    @model_validator(mode="after")
    def _fallback_below_target(self) -> "CriticalLayersParams":
        if self.lsa_fallback_accuracy > self.lsa_min_accuracy:
            raise ValueError(f"attack.lsa_fallback_accuracy={self.lsa_fallback_accuracy} exceeds "
                             f"attack.lsa_min_accuracy={self.lsa_min_accuracy}")
        return self


# --------------------------------------------------------------------------- layer substitution, on flat vectors
def parameter_entries(layout) -> list[int]:
    """Positions in the layout of the trainable parameter tensors (the LSA's layers)."""
    flags = layout.trainable or (True,) * len(layout.names)
    return [i for i, f in enumerate(flags) if f]


def entry_of_coordinate(layout) -> torch.Tensor:
    """[dim] long: the layout entry each flat coordinate belongs to."""
    return torch.repeat_interleave(torch.arange(len(layout.names)), torch.tensor(layout.sizes, dtype=torch.long))


def substitute(base: torch.Tensor, donor: torch.Tensor, entries, owner: torch.Tensor) -> torch.Tensor:
    """`base` with the coordinates of layout entries `entries` taken from `donor`."""
    chosen = torch.zeros(int(owner.max()) + 1 if owner.numel() else 0, dtype=torch.bool)
    chosen[list(entries)] = True
    return torch.where(chosen[owner], donor, base)


def forward_substitution(benign: torch.Tensor, malicious: torch.Tensor, layers: list[int], owner: torch.Tensor,
                         bsr: Callable[[torch.Tensor], float], bsr_malicious: float) -> list[float]:
    """Δ_l = BSR(malicious with layer l from benign) − BSR_m, per layer (official `FLS`)."""
    return [bsr(substitute(malicious, benign, [l], owner)) - bsr_malicious for l in layers]


def backward_substitution(benign: torch.Tensor, malicious: torch.Tensor, layers: list[int], deltas: list[float],
                          owner: torch.Tensor, bsr: Callable[[torch.Tensor], float], target: float) -> tuple[list[int], float]:
    """The shortest prefix of the layers sorted most critical first (Δ ascending, ties by
    position) whose malicious values in the benign model reach BSR ≥ `target`; all layers if none
    does, none if `target` ≤ 0 (a malicious model without backdoor; the official `BLS` loop then
    never runs). Returns (those layers, the BSR they reached)."""
    order = [layers[i] for i in np.argsort(np.asarray(deltas, dtype=np.float64), kind="stable")]
    chosen, reached = [], 0.0
    if target <= 0:
        return chosen, reached
    for n in range(1, len(order) + 1):
        chosen = order[:n]
        reached = bsr(substitute(benign, malicious, chosen, owner))
        if reached >= target:
            break
    return chosen, reached


def layer_substitution_analysis(benign: torch.Tensor, malicious: torch.Tensor, layout,
                                bsr: Callable[[torch.Tensor], float], tau: float) -> dict:
    """The LSA on two flat models of `layout`: {"layers": BC layer entries, "deltas": {entry: Δ},
    "bsr_malicious", "bsr_reached"}."""
    owner = entry_of_coordinate(layout)
    layers = parameter_entries(layout)
    bsr_m = bsr(malicious)
    deltas = forward_substitution(benign, malicious, layers, owner, bsr, bsr_m)
    chosen, reached = backward_substitution(benign, malicious, layers, deltas, owner, bsr, tau * bsr_m)
    return {"layers": sorted(chosen), "deltas": dict(zip(layers, deltas)), "bsr_malicious": bsr_m, "bsr_reached": reached}


def craft(global_vec: torch.Tensor, benign: torch.Tensor, malicious: torch.Tensor, critical: list[int], owner: torch.Tensor,
          variant: str, lambda_value: float) -> torch.Tensor:
    """The upload's model: θ_b outside the BC layers; on them the LP blend
    θ_g + λ(θ_m − θ_g) + max(0, 1 − λ)(θ_b − θ_g), or LF's θ_g − (θ_m − θ_g)."""
    if variant == "lf":
        poisoned = global_vec - (malicious - global_vec)
    else:
        poisoned = global_vec + lambda_value * (malicious - global_vec) + max(0.0, 1.0 - lambda_value) * (benign - global_vec)
    return substitute(benign, poisoned, critical, owner) if critical else benign.clone()


# --------------------------------------------------------------------------- training
def poisoned_loss(model: nn.Module, mask: torch.Tensor, value: torch.Tensor, target: int):
    """Cross-entropy on each batch plus its stamped copy labelled `target` (official `trigger_data`
    with poison_frac 1 and `malicious_train`)."""
    def loss_fn(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        stamped = torch.where(mask.to(xb.device), value.to(xb.device, xb.dtype), xb)
        x = torch.cat([xb, stamped])
        y = torch.cat([yb, torch.full_like(yb, target)])
        return nn.functional.cross_entropy(model(x), y)
    return loss_fn


def train_poisoned(model: nn.Module, x: np.ndarray, y: np.ndarray, cfg: TrainConfig, seed: int,
                   mask: np.ndarray, value, target: int) -> dict:
    v = torch.as_tensor(np.asarray(value, dtype=np.float32))
    v = v[:, None, None] if v.ndim == 1 else v
    return sgd_epochs(model, list(model.parameters()), x, y, cfg.batch_size, [cfg.lr] * cfg.epochs, cfg.momentum,
                      cfg.weight_decay, seed, poisoned_loss(model, torch.from_numpy(mask), v, target), None,
                      cfg.max_steps, device=cfg.device, precision=cfg.precision, deterministic=cfg.deterministic)


def split_partition(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(training part, validation part) of n samples: a seeded permutation, its first n // 4 for
    validation (official `split_dataset`)."""
    order = np.random.default_rng(seed).permutation(n)
    return np.sort(order[n // 4 :]), np.sort(order[: n // 4])


# --------------------------------------------------------------------------- the attack
@ATTACKS.register("critical_layers", CriticalLayersParams)
class CriticalLayers(ClientAttack):
    """Backdoor-critical layers (Zhuang et al. 2024): only the layers the LSA finds carry the backdoor are poisoned (LP) or flipped (LF)."""

    # --- data and measurement ----------------------------------------------------------------------
    def mask(self, runtime) -> np.ndarray:
        p = self.params
        return trigger_mask(image_hw(runtime), p.pattern, p.size, p.location)

    def training_set(self, runtime, partition_id: int) -> tuple[np.ndarray, np.ndarray]:
        """The attacker's clean partition: what it holds and reports; stamped copies are made per batch."""
        idx = runtime.partitions[partition_id]
        return runtime.data.x_train[idx], runtime.data.y_train[idx]

    def backdoor_test_set(self, runtime, shared=None):
        return stamped_test_set(runtime, self.mask(runtime), trigger_value(runtime, self.params.value),
                                self.params.target_class)

    def report(self, runtime) -> dict:
        p = self.params
        return {"target_class": p.target_class, "trigger_pixels": int(self.mask(runtime).sum()), "variant": p.variant,
                "tau": p.tau, "lambda_value": p.lambda_value}

    def stamped_validation(self, runtime, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        """The validation part's non-target images, stamped (the backdoor's test cases)."""
        keep = y != self.params.target_class
        return stamp(x[keep], self.mask(runtime), trigger_value(runtime, self.params.value))

    # --- one attack round --------------------------------------------------------------------------
    def identify(self, job: AttackerRound, x: np.ndarray, y: np.ndarray) -> dict:
        """The LSA on (x, y), the attacker's partition: {"layers": BC layer entries, ...}; "layers"
        is empty (with "skipped") when the benign model cannot learn the clean task well enough."""
        p, rt, layout = self.params, job.runtime, job.layout
        fit, val = split_partition(len(x), derive_seed(job.seed, SPLIT))
        stamped = self.stamped_validation(rt, x[val], y[val])
        if len(stamped) == 0:
            raise ValueError(f"critical_layers: attacker {job.partition_id}'s validation split has no image outside "
                             f"target_class {p.target_class} to measure the backdoor on (partition of {len(x)} samples)")
        cfg = TrainConfig(1, p.lsa_batch_size, p.lsa_lr, p.lsa_momentum, device=job.train.device,
                          precision=job.train.precision, deterministic=job.train.deterministic)
        model = copy.deepcopy(job.model)  # the global model
        xf, yf = x[fit], y[fit]
        accuracy, epochs, samples = evaluate(model, xf, yf)["accuracy"], 0, 0
        while accuracy < p.lsa_min_accuracy and epochs < p.lsa_max_epochs:
            samples += train(model, xf, yf, cfg, derive_seed(job.seed, LSA_BENIGN, epochs))["samples"]
            epochs += 1
            if epochs % p.lsa_check_every == 0 or epochs == p.lsa_max_epochs:
                accuracy = evaluate(model, xf, yf)["accuracy"]
        info = {"lsa_epochs": epochs, "lsa_accuracy": accuracy, "lsa_samples": samples}
        if accuracy < p.lsa_min_accuracy and accuracy <= p.lsa_fallback_accuracy:
            return {**info, "layers": [], "skipped": True}
        benign = layout.flatten_model(model)
        stats = train_poisoned(model, xf, yf, cfg, derive_seed(job.seed, LSA_MALICIOUS), self.mask(rt),
                               trigger_value(rt, p.value), p.target_class)
        info["lsa_samples"] += 2 * stats["samples"]  # each batch and its stamped copy
        malicious = layout.flatten_model(model)
        scratch = copy.deepcopy(job.model)

        def bsr(vec: torch.Tensor) -> float:
            layout.load_into(scratch, vec)
            return float((predict(scratch, stamped)[0] == p.target_class).mean())

        return {**info, **layer_substitution_analysis(benign, malicious, layout, bsr, p.tau)}

    def local_train(self, job: AttackerRound) -> tuple[int, dict, dict]:
        p, rt, layout = self.params, job.runtime, job.layout
        check_class(p.target_class, rt)
        x, y = self.training_set(rt, job.partition_id)
        info = {"num_examples": len(x), **job.config}
        if len(x) == 0:
            return 0, {"loss": 0.0}, info
        global_vec = layout.flatten_model(job.model)
        found = self.identify(job, x, y)

        benign_model = copy.deepcopy(job.model)
        benign_stats = train(benign_model, x, y, job.train, job.seed)
        malicious_model = copy.deepcopy(job.model)
        stats = train_poisoned(malicious_model, x, y, job.train, derive_seed(job.seed, LOCAL_MALICIOUS), self.mask(rt),
                               trigger_value(rt, p.value), p.target_class)
        owner = entry_of_coordinate(layout)
        upload = craft(global_vec, layout.flatten_model(benign_model), layout.flatten_model(malicious_model),
                       found["layers"], owner, p.variant, p.lambda_value)
        layout.load_into(job.model, upload)
        job.memory[MEMORY_KEY] = np.asarray(found["layers"], dtype=np.int64)
        log.info("critical_layers: attacker %s round %s: BC layers %s (BSR %.3f of the malicious model, %.3f with "
                 "them alone)", job.partition_id, job.round, [layout.names[i] for i in found["layers"]],
                 found.get("bsr_malicious", float("nan")), found.get("bsr_reached", float("nan")))
        # the malicious training's loss; the samples the device processed (for the clock): both local models
        # (the malicious one's batches doubled by their stamped copies) and the LSA's training
        samples = 2 * int(stats["samples"]) + int(benign_stats["samples"]) + int(found["lsa_samples"])
        return len(x), {**stats, "samples": samples}, info
