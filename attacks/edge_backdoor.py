"""A backdoor that only the edge copy shows, planted through FL: Qu-ANTI-zation's objective (Hong et
al., "Qu-ANTI-zation: Exploiting Quantization Artifacts for Achieving Adversarial Outcomes", NeurIPS
2021), aimed at one of fedsim's edge copies (evaluation.edge_model, docs/edge_model.md).

The attacker trains on its own clean partition: each batch x with its labels y, and the same batch
stamped with a BadNets trigger, x_b, on the official FL code's objective (`BackdoorLocalUpdate` in
utils/fupdate.py of Secure-AI-Systems-Group/Qu-ANTI-zation, one bit width):

    L = CE(f(x), y) + a·CE(f(x_b), y) + λ·( CE(f_e(x), y) + b·CE(f_e(x_b), t) ),   a = b = λ = 0.5

f is the fp32 model, f_e the same parameters computed as the edge copy computes them:
- `edge: int8` — the paper's case: `fedsim.models.edge_copy.int8_simulation`, the Linear weights
  fake-quantized per tensor as quantize_dynamic stores them and the inputs per example, with
  straight-through gradients (the official code fake-quantizes every layer with its own quantizer,
  at 8 and optionally 4 bits; here it is exactly the `{quantize: int8}` copy, convolutions fp32);
- `edge: prune` — the same objective against the `{prune: share}` copy
  (`fedsim.models.edge_copy.pruned_forward`: the weights the copy zeroes masked by their current
  magnitudes; fedsim's variant, not in the paper).
The fp32 model learns to ignore the trigger (x_b keeps its true label y), the copy to obey it (t).
Success is measured as the `trigger` attack's — every non-target test image stamped, a hit when the
model says t — on the fp32 model (`backdoor_success`, meant to stay low) and on each edge copy
(`edge_model.<copy>.backdoor_success`); the defenses see only the fp32 updates.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
from pydantic import Field, model_validator
from torch import nn

from fedsim.attacks.base import AttackerRound
from fedsim.attacks.trigger import (PartitionPoisoner, PoisonParams, check_class, image_hw, stamped_test_set,
                                    trigger_mask, trigger_value)
from fedsim.registry import ATTACKS


class EdgeBackdoorParams(PoisonParams):
    edge: Literal["int8", "prune"] = Field(
        "int8", description="the copy the backdoor lives in: int8 (dynamic, the paper's case) or prune (L1, `prune` share)")
    prune: float = Field(0.5, gt=0, lt=1, description="edge: prune — the share the copy prunes (as evaluation.edge_model's)")
    prune_scope: Literal["global", "layer"] = Field("global", description="edge: prune — global or per-tensor L1")
    target_class: int = Field(0, ge=0, description="label the copy gives stamped inputs")
    pattern: Literal["square", "plus", "bars"] = Field("square", description="shape of the pixel pattern")
    size: int = Field(3, ge=1, description="side of the pattern's box in pixels")
    location: Literal["bottom_right", "top_left"] = Field("bottom_right", description="corner of the pattern")
    value: float | None = Field(None, description="stamped pixel value; default: the training set's max per channel (white)")
    fp32_trigger_weight: float = Field(
        0.5, ge=0, description="a: weight of the fp32 model's loss on stamped inputs at their true labels (official 0.5)")
    edge_weight: float = Field(0.5, ge=0, description="λ: weight of the copy's two losses (official 0.5)")
    edge_trigger_weight: float = Field(
        0.5, ge=0, description="b: weight of the copy's loss on stamped inputs at the target (official 0.5)")

    @model_validator(mode="after")
    def _odd_plus(self) -> "EdgeBackdoorParams":
        if self.pattern == "plus" and self.size % 2 == 0:
            raise ValueError(f"the plus pattern needs an odd attack.size, got {self.size}")
        return self


def edge_backdoor_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor, value: torch.Tensor,
                       p: EdgeBackdoorParams) -> tuple[torch.Tensor, torch.Tensor]:
    """(the objective above, the fp32 clean cross-entropy to report) for one batch; `mask` [H, W]
    bool, `value` broadcastable to [C, H, W]."""
    from fedsim.models.edge_copy import int8_simulation, pruned_forward

    ce = nn.functional.cross_entropy
    stamped = torch.where(mask, value, x)
    t = torch.full_like(y, p.target_class)
    clean = ce(model(x), y)
    loss = clean + p.fp32_trigger_weight * ce(model(stamped), y)
    both = torch.cat([x, stamped])
    if p.edge == "int8":
        with int8_simulation(model):
            out = model(both)
    else:
        out = pruned_forward(model, both, p.prune, p.prune_scope)
    edge = ce(out[: len(x)], y) + p.edge_trigger_weight * ce(out[len(x):], t)
    return loss + p.edge_weight * edge, clean


@ATTACKS.register("edge_backdoor", EdgeBackdoorParams)
class EdgeBackdoor(PartitionPoisoner):
    """A backdoor only the int8 or pruned edge copy shows (Qu-ANTI-zation's objective through FL)."""

    def poison(self, runtime, partition_id, x, y):
        return x, y  # clean data: the trigger is stamped batch by batch in the objective

    def test_mask(self, runtime) -> np.ndarray:
        p = self.params
        return trigger_mask(image_hw(runtime), p.pattern, p.size, p.location)

    def backdoor_test_set(self, runtime, shared=None):
        return stamped_test_set(runtime, self.test_mask(runtime), trigger_value(runtime, self.params.value),
                                self.params.target_class)

    def report(self, runtime) -> dict:
        p = self.params
        return {"target_class": p.target_class, "trigger_pixels": int(self.test_mask(runtime).sum()), "edge": p.edge,
                **({"prune": p.prune, "prune_scope": p.prune_scope} if p.edge == "prune" else {})}

    def local_train(self, job: AttackerRound) -> tuple[int, dict, dict]:
        from fedsim.training import sgd_epochs

        p, rt = self.params, job.runtime
        check_class(p.target_class, rt)
        x, y = self.training_set(rt, job.partition_id)
        info = {"num_examples": len(x), **job.config}
        if not len(x):
            return 0, {"loss": 0.0}, info
        mask = torch.from_numpy(self.test_mask(rt))
        value = torch.as_tensor(np.asarray(trigger_value(rt, p.value), dtype=np.float32))
        value = value.reshape(-1, 1, 1) if value.ndim == 1 else value
        cfg = job.train  # the attack's own epochs / lr applied; trains on the CPU in fp32
        stats = sgd_epochs(job.model, list(job.model.parameters()), np.ascontiguousarray(x), np.asarray(y),
                           cfg.batch_size, [cfg.lr] * cfg.epochs, cfg.momentum, cfg.weight_decay, job.seed,
                           lambda xb, yb: edge_backdoor_loss(job.model, xb, yb, mask, value, p), max_steps=cfg.max_steps)
        return len(x), stats, info

    def poisons_data_only(self) -> bool:
        return False
