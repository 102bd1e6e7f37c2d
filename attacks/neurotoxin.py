"""Neurotoxin (Zhang et al., ICML 2022, "Neurotoxin: Durable Backdoors in Federated Learning").

The attacker estimates which coordinates the benign clients change most and trains its backdoor
only on the others, so later benign rounds overwrite it less and it lasts longer after the attack
stops. Each attack round:

1. score every trainable coordinate by the magnitude of an estimate of the benign update;
2. keep the `mask_ratio` share with the smallest scores (the bottom-k; the paper excludes the
   top-k% coordinates, the official code's `--gradmask_ratio` is the share kept, 0.95 in its CV
   scripts; 1 = no mask, the baseline);
3. train on the poisoned data with every gradient multiplied by that mask before the optimizer
   step (the official `apply_grad_mask` between `backward()` and `step()`; here a
   `Tensor.register_hook` on each parameter, removed after training);
4. optionally (`pgd_eps`) project the model onto the L2 ball of radius eps around the global model
   after every step, the paper's PGD bound (the official `apply_PGD`, radius `s_norm`).

The estimate (`mask_source`):
* `clean_gradient` (default) follows the official code for the CV tasks (`grad_mask_cv` in
  FL_Backdoor_CV/helper.py, called from `train_cv`): the gradient of the *global* model on clean
  data, summed over batches of mean cross-entropy, in train mode. The code draws that data from 30
  benign participants; a real attacker holds only its own data, so here it is the attacker's own
  clean partition (a deviation, for realism).
* `global_update` follows the paper's Algorithm 1: the last global update, θ_t − θ_prev, where
  θ_prev is the global model of this attacker's previous attack round, kept in the attacker's
  memory (`AttackerRound.memory`). With a sparse schedule it spans several rounds. Before the
  first remembered round the clean gradient is used.

`mask_scope: model` ranks all coordinates together, as every CV script of the official code does
(`--aggregate_all_layer 1`); `layer` keeps the bottom share of each parameter tensor (its default
0). Ties are broken by position (stable sort; the code's `torch.topk` leaves them unspecified).
Weight decay is applied by the optimizer after the hook, so with weight decay the coordinates
outside the mask still shrink, as in the official code; momentum only carries masked gradients.

Neurotoxin takes its poisoned training set and backdoor test set from another client attack,
`poison` (trigger, dba, blended, edge_case, label_flip...), which then only supplies data: who
attacks, when and how (epochs, lr) come from neurotoxin's own fields, and a poison that would
transform the update (`scale`, a PGD `mode`) is refused rather than silently ignored
(`fedsim.attacks.nested`, shared with chameleon).
"""

from __future__ import annotations

import copy
import functools
from typing import Literal

import numpy as np
import torch
from pydantic import Field

from fedsim.attacks.base import AttackerRound, AttackParams, ClientAttack
from fedsim.attacks.edge_case import project_l2
from fedsim.attacks.nested import NestedPoison
from fedsim.registry import ATTACKS

MEMORY_KEY = "previous_global"  # the global model of this attacker's last attack round (mask_source: global_update)


# the nested poison: its spec, validation and dump are fedsim.attacks.nested's, shared with chameleon
POISON = NestedPoison("neurotoxin", instead="attack.pgd_eps for a norm bound")
PoisonSpec = POISON.annotation()


# --------------------------------------------------------------------------- the mask
def bottom_k(score: torch.Tensor, ratio: float) -> torch.Tensor:
    """Boolean mask (score's shape) of the int(ratio * n) entries with the smallest score; ties go to
    the lower flat index (a stable sort)."""
    flat = score.reshape(-1)
    k = int(flat.numel() * ratio)  # the official code's int(len * ratio)
    keep = torch.zeros(flat.numel(), dtype=torch.bool)
    keep[torch.argsort(flat, stable=True)[:k]] = True
    return keep.view(score.shape)


def bottom_k_masks(scores: dict[str, torch.Tensor], ratio: float, scope: str) -> dict[str, torch.Tensor]:
    """Per-parameter masks: the bottom share of all coordinates ranked together (`model`) or of
    each parameter tensor on its own (`layer`)."""
    if scope == "layer":
        return {n: bottom_k(s, ratio) for n, s in scores.items()}
    flat = bottom_k(torch.cat([s.reshape(-1) for s in scores.values()]), ratio)
    parts = torch.split(flat, [s.numel() for s in scores.values()])
    return {n: p.view(s.shape) for (n, s), p in zip(scores.items(), parts)}


def clean_gradient(model: torch.nn.Module, x: np.ndarray, y: np.ndarray, batch_size: int, seed: int) -> dict[str, torch.Tensor]:
    """|∇| of the model's trainable parameters on (x, y): mean cross-entropy per batch, gradients
    summed over the batches, train mode (official `grad_mask_cv`); the model itself is untouched."""
    net = copy.deepcopy(model)
    net.train()
    torch.manual_seed(seed)  # dropout masks, if any
    params = [(n, p) for n, p in net.named_parameters() if p.requires_grad]
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    for i in range(0, len(xt), batch_size):
        torch.nn.functional.cross_entropy(net(xt[i : i + batch_size]), yt[i : i + batch_size]).backward()
    return {n: (p.grad.abs() if p.grad is not None else torch.zeros_like(p)).detach() for n, p in params}


def update_magnitude(model: torch.nn.Module, global_vec: torch.Tensor, previous: np.ndarray, layout) -> dict[str, torch.Tensor]:
    """|θ_t − θ_prev| of the model's trainable parameters (the paper's benign-update estimate)."""
    delta = layout.unflatten((global_vec - torch.from_numpy(np.asarray(previous, dtype=np.float32))).abs())
    return {n: delta[n] for n, p in model.named_parameters() if p.requires_grad}


# --------------------------------------------------------------------------- the attack
class NeurotoxinParams(AttackParams):
    poison: PoisonSpec = Field(
        default_factory=POISON.default_spec,
        description="client attack whose poisoned data and backdoor test set are used: {name: <attack>, <its params>}",
    )
    mask_ratio: float = Field(
        0.95, gt=0, le=1,
        description="share of coordinates the attacker may change, those with the smallest benign magnitude "
                    "(official --gradmask_ratio; 0.95 in its CV scripts; 1 = no mask)",
    )
    mask_source: Literal["clean_gradient", "global_update"] = Field(
        "clean_gradient",
        description="benign estimate: clean_gradient = global model's gradient on the attacker's clean partition "
                    "(official CV code); global_update = last global update (paper's Algorithm 1)",
    )
    mask_scope: Literal["model", "layer"] = Field(
        "model", description="rank coordinates over the whole model (official CV scripts) or within each layer"
    )
    pgd_eps: float | None = Field(
        None, gt=0, description="project onto the L2 ball of this radius around the global model after each step; none: off"
    )
    local_epochs: int | None = Field(None, ge=1, description="attacker's epochs; default: federation.local_epochs")
    lr: float | None = Field(None, gt=0, description="attacker's lr; default: the honest clients' lr")


@ATTACKS.register("neurotoxin", NeurotoxinParams)
class Neurotoxin(ClientAttack):
    """Neurotoxin: a durable backdoor trained only on the coordinates benign clients change least."""

    def __init__(self, params) -> None:
        super().__init__(params)
        self.poison = ATTACKS.get(params.poison.name).obj(params.poison)

    # the nested attack supplies the data and the measurement
    def training_set(self, runtime, partition_id: int) -> tuple[np.ndarray, np.ndarray]:
        return self.poison.training_set(runtime, partition_id)

    def backdoor_test_set(self, runtime, shared=None):
        return self.poison.backdoor_test_set(runtime)

    def honest_extra_data(self, runtime, partition_id: int):
        return self.poison.honest_extra_data(runtime, partition_id)

    def source_class(self) -> int | None:
        return self.poison.source_class()

    def report(self, runtime) -> dict:
        p = self.params
        return {**self.poison.report(runtime), "poison": p.poison.name, "mask_ratio": p.mask_ratio,
                "mask_source": p.mask_source, "mask_scope": p.mask_scope, "pgd_eps": p.pgd_eps}

    def gradient_mask(self, job: AttackerRound) -> dict[str, torch.Tensor] | None:
        """{parameter name: bool mask of the coordinates the attacker may change}, or None for no mask."""
        p = self.params
        if p.mask_ratio == 1.0:
            return None
        previous = job.memory.get(MEMORY_KEY) if p.mask_source == "global_update" else None
        if previous is not None and np.shape(previous) == (job.layout.dim,):
            scores = update_magnitude(job.model, job.global_vec, previous, job.layout)
        else:
            rt, pid = job.runtime, job.partition_id
            idx = rt.partitions[pid]
            if len(idx) == 0:
                raise ValueError(f"neurotoxin: attacker {pid} has an empty partition, no clean data to estimate the "
                                 "benign gradient from (attack.mask_source: clean_gradient)")
            scores = clean_gradient(job.model, rt.data.x_train[idx], rt.data.y_train[idx], job.train.batch_size, job.seed)
        return bottom_k_masks(scores, p.mask_ratio, p.mask_scope)

    def local_train(self, job: AttackerRound) -> tuple[int, dict, dict]:
        from fedsim.training import train

        x, y = self.training_set(job.runtime, job.partition_id)
        info = {"num_examples": len(x), **job.config}
        masks = self.gradient_mask(job) if len(x) else None
        params = dict(job.model.named_parameters())
        handles = [params[n].register_hook(functools.partial(torch.mul, other=m.to(params[n].dtype)))
                   for n, m in (masks or {}).items()]
        eps = self.params.pgd_eps
        after = None if eps is None else (lambda b, last: project_l2(job.model, job.global_vec, job.layout, eps))
        try:
            stats = train(job.model, x, y, job.train, job.seed, after) if len(x) else {"loss": 0.0}
        finally:
            for h in handles:
                h.remove()
        if self.params.mask_source == "global_update":
            job.memory[MEMORY_KEY] = job.global_vec.detach().numpy().copy()
        return len(x), stats, info
