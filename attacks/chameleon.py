"""Chameleon (Dai & Li, ICML 2023, "Adapting to Peer Images for Planting Durable Backdoors in
Federated Learning"): another attack's poisoned data, learnt through a contrastive encoder stage
so that the backdoor survives the rounds after the attack.

The poisoned data is a client-side attack's, nested as `poison` (`{name: trigger, ...}`,
`{name: edge_case, ...}`): its training set and its backdoor test set are Chameleon's. Every
attack round the attacker trains from the global model in two stages (paper §4, Algorithm 1;
official code `training.py`, `utils/losses.py`):

1. **Encoder** (every layer below the classification head), `contrastive_epochs` epochs of SGD
   on the supervised contrastive loss (Khosla et al. 2020, the code's `SupConLoss`) over the
   L2-normalised penultimate embeddings (the code's `SupConResNet` backbone: the head's input,
   normalised). Poisoned inputs carry the target label, so their positives are the other poisoned
   inputs and the target-class images (the paper's *facilitators*) and every other image, the
   source-class images they were made from included (the *obstructors*), is a negative: the
   embeddings of poisoned images move towards the target class's and away from their own class's.
   For anchor i with positives P(i) (same label, not i) and A(i) = every other row,

       l_i = -(T / T_b) * w_i / |P(i)| * sum_{p in P(i)} log( exp(z_i.z_p / T) / sum_{a in A(i)} exp(z_i.z_a / T) )

   with w_i = `facilitator_weight` for target-class anchors (the code's
   `contrastive_loss_scale_weight`) and 1 otherwise; the loss is the batch mean (rows without
   positives give 0). SGD with the code's own momentum and weight decay for this stage.
2. **Head**: the encoder frozen (the code's `is_frozen_params`: only `linear.*` trains),
   `local_epochs` epochs of cross-entropy at `lr` with the honest clients' momentum and weight
   decay (the code builds this optimizer from `momentum` and `decay`, the honest settings).

Both stages decay their lr like the code's `MultiStepLR`, stepped at the *start* of each epoch:
epoch e (from 1) runs at lr * gamma^(number of milestones <= e). After every step of both stages
the model is projected onto the L2 ball of radius `pgd_norm` around the global model (the code's
`diff_privacy` with `s_norm`; in stage 2 this rescales the whole difference, encoder included, as
there). The finished update is multiplied by `scale` (`scale_weights`) and clipped to `pgd_norm`
once more (the code's final `diff_privacy` clip).

Where fedsim differs from the official code, and why:

* The batches are the nested attack's training set shuffled each epoch (the share it poisons
  chosen once), not the code's re-insertion of `poison_batch_len` poisoned images, each with
  N(0, 0.01) noise, at the head of every clean batch: what is poisoned is the nested attack's
  definition, and with `contrastive_epochs: 0, freeze_encoder: false` and a flat schedule
  Chameleon trains bit for bit like that attack's plain training.
* The code's `contrastive_loss_down_scale_weight` (1 in every released configuration; it scales
  the similarities between a batch's first rows and class 1, hard-coded) is left out, as BackFed's
  re-implementation does.
* The code ends stage 2 early once the loss on the backdoor *test* set falls below 1e-4; the
  attacker here does not read the server's test set.
* The code's one simulated adversary multiplies its update by the number of adversaries; here each
  attacker sends its own.

Defaults are the code's EMNIST pixel-trigger configuration (`params_pixel_trigger_emnist.yaml`),
the closest to fedsim's digit sets; the CIFAR-10 configurations' values are in the descriptions.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from pydantic import Field, field_validator
from torch import nn

from fedsim.attacks.base import AttackerRound, AttackParams, ClientAttack
from fedsim.attacks.edge_case import project_l2
from fedsim.attacks.nested import NestedPoison
from fedsim.attacks.trigger import Scale, update_scale
from fedsim.models.nets import features, head
from fedsim.registry import ATTACKS
from fedsim.seeding import derive_seed
from fedsim.training import sgd_epochs

CONTRASTIVE = 0xC4A3  # seed purpose of the contrastive stage (stage 2 uses the round's own seed)
# the nested attack (fedsim.attacks.nested, shared with neurotoxin): data only; who attacks and when,
# and the stage-2 epochs / lr, are Chameleon's own settings
POISON = NestedPoison("chameleon", instead="attack.pgd_norm and attack.scale to bound and scale the update")
PoisonSpec = POISON.annotation()


# --------------------------------------------------------------------------- the loss
def supcon_loss(
    z: torch.Tensor, labels: torch.Tensor, target: int, temperature: float = 0.07, base_temperature: float = 0.07,
    facilitator_weight: float = 1.0,
) -> torch.Tensor:
    """The official code's supervised contrastive loss of embeddings `z` [n, k] (normalised by the
    caller) with `labels` [n]: positives share the anchor's label, the anchor itself is excluded
    from both sums, target-class anchors weigh their positives by `facilitator_weight`, the mean is
    over all n anchors (rows without positives count as 0). A batch of one has no pairs: 0."""
    n = z.shape[0]
    if n < 2:
        return z.sum() * 0.0
    sim = z @ z.T / temperature
    logits = sim - sim.max(dim=1, keepdim=True).values.detach()  # for numerical stability, as the code
    others = ~torch.eye(n, dtype=torch.bool, device=z.device)
    positive = (labels[:, None] == labels[None, :]) & others
    log_prob = logits - torch.log((torch.exp(logits) * others).sum(dim=1, keepdim=True))
    row_weight = torch.where(labels == target, facilitator_weight, 1.0).to(z.dtype)
    pos_sum = (positive.to(z.dtype) * log_prob).sum(dim=1) * row_weight
    mean_pos = pos_sum / positive.sum(dim=1).clamp(min=1).to(z.dtype)
    return -(temperature / base_temperature) * mean_pos.mean()


# --------------------------------------------------------------------------- the two stages
def epoch_lrs(lr: float, epochs: int, milestones: list[int], gamma: float) -> list[float]:
    """The lr of each epoch under the code's `MultiStepLR`, stepped at the start of every epoch."""
    return [lr * gamma ** sum(m <= e for m in milestones) for e in range(1, epochs + 1)]


def split_parameters(model: nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(encoder parameters, head parameters) of a registered net, in the model's order."""
    in_head = {id(p) for p in head(model).parameters()}
    params = list(model.parameters())
    return [p for p in params if id(p) not in in_head], [p for p in params if id(p) in in_head]


def contrastive_stage(
    model: nn.Module, x: np.ndarray, y: np.ndarray, target: int, p, batch_size: int, seed: int,
    after_step: Callable[[int, bool], None] | None = None,
) -> dict:
    """Stage 1: the encoder trained on the supervised contrastive loss of the normalised
    embeddings (`p`: the ChameleonParams); the head is left as it is."""
    encoder, _ = split_parameters(model)

    def loss_fn(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        z = nn.functional.normalize(features(model, xb), dim=1)
        return supcon_loss(z, yb, target, p.temperature, p.base_temperature, p.facilitator_weight)

    lrs = epoch_lrs(p.contrastive_lr, p.contrastive_epochs, p.contrastive_milestones, p.contrastive_gamma)
    return sgd_epochs(model, encoder, x, y, batch_size, lrs, p.contrastive_momentum, p.contrastive_weight_decay,
                      seed, loss_fn, after_step)


def head_stage(
    model: nn.Module, x: np.ndarray, y: np.ndarray, train_cfg, milestones: list[int], gamma: float,
    freeze_encoder: bool, seed: int, after_step: Callable[[int, bool], None] | None = None,
) -> dict:
    """Stage 2: cross-entropy with the attacker's TrainConfig (epochs, lr, batch size, the honest
    momentum and weight decay), only the head trained when `freeze_encoder`."""
    encoder, head_params = split_parameters(model)
    trained = head_params if freeze_encoder else list(model.parameters())
    frozen = encoder if freeze_encoder else []
    for q in frozen:
        q.requires_grad_(False)
    try:
        lrs = epoch_lrs(train_cfg.lr, train_cfg.epochs, milestones, gamma)
        return sgd_epochs(model, trained, x, y, train_cfg.batch_size, lrs, train_cfg.momentum, train_cfg.weight_decay,
                          seed, lambda xb, yb: nn.functional.cross_entropy(model(xb), yb), after_step,
                          train_cfg.max_steps)
    finally:
        for q in frozen:
            q.requires_grad_(True)


# --------------------------------------------------------------------------- parameters
class ChameleonParams(AttackParams):
    poison: PoisonSpec = Field(
        default_factory=POISON.default_spec,
        description="the client-side attack whose poisoned data and backdoor test set chameleon uses: "
                    "{name: trigger | edge_case | ..., <its params>}, data poisoning only",
    )
    contrastive_epochs: int = Field(
        10, ge=0, description="stage-1 (encoder) epochs (code: retrain_poison_contrastive); 0 skips the stage")
    contrastive_lr: float = Field(
        0.05, gt=0,
        description="stage-1 lr (code: poison_lr_contrastive; EMNIST 0.05, CIFAR-10 trigger 0.005, edge case 0.01)")
    contrastive_momentum: float = Field(0.9, ge=0, lt=1, description="stage-1 momentum (code: momentum_contrastive)")
    contrastive_weight_decay: float = Field(0.0005, ge=0, description="stage-1 weight decay (code: decay_contrastive)")
    contrastive_milestones: list[int] = Field(
        [3, 5, 7, 9],
        description="stage-1 epochs (from 1) from which the lr is multiplied by contrastive_gamma "
                    "(code: milestones_conrtastive)")
    contrastive_gamma: float = Field(
        0.005, gt=0,
        description="stage-1 lr factor per milestone (code: lr_gamma_contrastive; EMNIST 0.005, CIFAR-10 trigger 0.1, "
                    "edge case 0.001)")
    temperature: float = Field(0.07, gt=0, description="supervised contrastive temperature T (code: 0.07)")
    base_temperature: float = Field(0.07, gt=0, description="the loss is scaled by temperature / base_temperature (code: 0.07)")
    facilitator_weight: float = Field(
        6.0, gt=0,
        description="weight of target-class anchors' positive pairs (code: contrastive_loss_scale_weight; "
                    "trigger 6, edge case 4)")
    local_epochs: int | None = Field(
        3, ge=1, description="stage-2 (head) epochs (code: retrain_poison); null: federation.local_epochs")
    lr: float | None = Field(
        0.01, gt=0,
        description="stage-2 lr, decayed like the honest lr (code: poison_lr; EMNIST 0.01, CIFAR-10 trigger 0.001); "
                    "null: the honest lr")
    milestones: list[int] = Field(
        [3, 5], description="stage-2 epochs (from 1) from which the lr is multiplied by gamma (code: milestones)")
    gamma: float = Field(0.005, gt=0, description="stage-2 lr factor per milestone (code: lr_gamma)")
    freeze_encoder: bool = Field(
        True, description="stage 2 trains the head only (code: is_frozen_params); false: the whole model")
    pgd_norm: float | None = Field(
        5.0, gt=0,
        description="after every step and after scaling, project onto this L2 ball around the global model "
                    "(code: s_norm with diff_privacy); null: unbounded")
    scale: Scale = Field(
        1.0,
        description='factor on the finished update before the last projection (code: scale_weights); '
                    '"auto" = round examples / own examples')

    @field_validator("contrastive_milestones", "milestones")
    @classmethod
    def _positive_epochs(cls, value: list[int], info) -> list[int]:
        if any(m < 1 for m in value):
            raise ValueError(f"attack.{info.field_name} are epochs counted from 1, got {value}")
        return value


@ATTACKS.register("chameleon", ChameleonParams)
class Chameleon(ClientAttack):
    """Chameleon: a nested attack's poisoned data planted by a contrastive encoder stage, then the head (durable backdoor)."""

    def __init__(self, params: ChameleonParams) -> None:
        super().__init__(params)
        self.poison = ATTACKS.get(params.poison.name).obj(params.poison)

    def training_set(self, runtime, partition_id: int) -> tuple[np.ndarray, np.ndarray]:
        return self.poison.training_set(runtime, partition_id)

    def backdoor_test_set(self, runtime, shared: dict[str, np.ndarray] | None = None):
        test = self.poison.backdoor_test_set(runtime) if shared is None else self.poison.backdoor_test_set(runtime, shared)
        single_target(test, self.params.poison.name)  # refused before any round (preflight builds this set)
        return test

    def target_class(self, runtime) -> int:
        """The label the nested attack gives its backdoor inputs (the facilitators' class)."""
        return runtime.cached(("chameleon", "target", self.params.poison.model_dump_json()),
                              lambda: single_target(self.poison.backdoor_test_set(runtime), self.params.poison.name))

    def honest_extra_data(self, runtime, partition_id: int):
        return self.poison.honest_extra_data(runtime, partition_id)

    def source_class(self) -> int | None:
        return self.poison.source_class()

    def shared_state(self, job: AttackerRound):
        return self.poison.shared_state(job)

    def report(self, runtime) -> dict:
        return {**self.poison.report(runtime), "poison": self.params.poison.name, "target_class": self.target_class(runtime)}

    def local_train(self, job: AttackerRound) -> tuple[int, dict, dict]:
        p = self.params
        x, y = self.training_set(job.runtime, job.partition_id)
        info = {"num_examples": len(x), **job.config}
        if not len(x):
            return 0, {"loss": 0.0}, info
        encoder, _ = split_parameters(job.model)
        if not encoder:
            raise ValueError("chameleon trains the layers below the model's head, and this model has none "
                             "(model.hidden: [] ?): give the model a hidden layer")
        project = None
        if p.pgd_norm is not None:
            project = lambda b, last: project_l2(job.model, job.global_vec, job.layout, p.pgd_norm)  # noqa: E731
        stats: dict = {}
        if p.contrastive_epochs:
            target = self.target_class(job.runtime)
            seed = derive_seed(job.seed, CONTRASTIVE)
            first = contrastive_stage(job.model, x, y, target, p, job.train.batch_size, seed, project)
            stats = {"contrastive_loss": first["loss"], "contrastive_steps": first["steps"]}
        second = head_stage(job.model, x, y, job.train, p.milestones, p.gamma, p.freeze_encoder, job.seed, project)
        if "samples" in second:  # the work of both stages (the federation clock times it)
            stats["samples"] = second["samples"] + first.get("samples", 0) if p.contrastive_epochs else second["samples"]
        return len(x), {**second, **stats}, info

    def finish_update(self, delta: torch.Tensor, info: dict) -> torch.Tensor:
        delta = delta * update_scale(self.params.scale, info)
        bound = self.params.pgd_norm
        if bound is not None:
            norm = torch.linalg.vector_norm(delta)
            if norm > bound:
                delta = delta * (bound / norm)
        return delta


def single_target(test: tuple[np.ndarray, np.ndarray] | None, name: str) -> int:
    """The one label of a backdoor test set, or a clear refusal (Chameleon needs one target class)."""
    labels = np.unique(test[1]) if test is not None else np.array([])
    if len(labels) != 1:
        raise ValueError(f"chameleon needs a targeted backdoor (one target class), but attack.poison={name} "
                         f"labels its backdoor inputs {labels.tolist()}: choose a targeted poison "
                         "(trigger, edge_case, label_flip with mode: targeted, ...)")
    return int(labels[0])
