"""DIVA ("A Tale of Two Models: Constructing Evasive Attacks on Edge Models", Hao et al., MLSys 2022)
against PGD, on the federation's global model (the original, which the server validates with) and
an edge copy of it (fedsim/models/edge_copy.py, the model the device runs).

Both are L∞ attacks by signed-gradient ascent from the clean input x with true label y (no random
start): x ← clip(x₀ + clip(x + α·sign(∇L) − x₀, −ε, ε), lo, hi), for `steps` steps, where
- DIVA:  L = p_orig(y | x) − c · p_edge(y | x), softmax probabilities (the official code's
  `loss1 − c·loss2` on the two models' softmax outputs at the clean label, c = 1): push the edge
  model off y while the original keeps it;
- PGD:   L = cross-entropy of the edge model at y (the official code's baseline).
As in the official code, only inputs both models classify correctly count ("qualified"), and an
input stops at the first step where it evades — the edge model's class is no longer y while the
original's still is — and keeps that input; the others keep their last step.

The gradient of the edge model is the attacker's differentiable simulation of it
(`fedsim.models.edge_copy.differentiable`): for an int8 copy, its int8 weights dequantized and each
quantized layer's input fake-quantized per example with torch's straight-through fake_quantize op
(the official code attacks TensorFlow's fake-quantized QAT model the same way); the pruned copy is
itself differentiable. The stopping test uses the simulation too; the figures reported are then
measured on the real copy, one input at a time for int8 (a device classifies one input; dynamic
quantization's activation scale is per batch):
- edge_success: share of qualified inputs whose attacked version the edge copy misclassifies;
- undetected: share whose attacked version the edge copy misclassifies while the original still
  classifies it correctly (the paper's evasive success: the server's model sees nothing wrong);
- undetected_of_success: undetected / edge_success; original_fooled: the original misclassifies.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from fedsim.models.edge_copy import EdgeModel, differentiable

METHODS = ("diva", "pgd")


def _loss(method: str, original: nn.Module, sim: nn.Module, x: torch.Tensor, y: torch.Tensor, c: float) -> torch.Tensor:
    if method == "diva":
        p_orig = original(x).softmax(1).gather(1, y[:, None])
        p_edge = sim(x).softmax(1).gather(1, y[:, None])
        return (p_orig - c * p_edge).sum()
    return nn.functional.cross_entropy(sim(x), y, reduction="sum")


def attack_batch(method: str, original: nn.Module, sim: nn.Module, x0: torch.Tensor, y: torch.Tensor, *, eps: float,
                 step: float, steps: int, lo: torch.Tensor | float, hi: torch.Tensor | float, c: float = 1.0) -> torch.Tensor:
    """The attacked inputs of one batch (see the module's docstring); `lo`/`hi` bound valid inputs
    (broadcastable to x0), `eps`/`step` are in the inputs' own units."""
    if method not in METHODS:
        raise ValueError(f"unknown evasion method {method!r}; known: {', '.join(METHODS)}")
    x, adv = x0.clone(), x0.clone()
    done = torch.zeros(len(x0), dtype=torch.bool)
    for _ in range(steps):
        x.requires_grad_(True)
        (grad,) = torch.autograd.grad(_loss(method, original, sim, x, y, c), x)
        with torch.no_grad():
            moved = x0 + (x + step * grad.sign() - x0).clamp(-eps, eps)
            moved = torch.maximum(torch.minimum(moved, hi), lo) if torch.is_tensor(lo) else moved.clamp(lo, hi)
            x = torch.where(done.view(-1, *([1] * (x0.ndim - 1))), adv, moved)
            evades = ~done & (original(x).argmax(1) == y) & (sim(x).argmax(1) != y)
            adv[evades] = x[evades]
            done |= evades
        if done.all():
            break
    with torch.no_grad():
        return torch.where(done.view(-1, *([1] * (x0.ndim - 1))), adv, x.detach())


@torch.no_grad()
def _classify(model: nn.Module, x: torch.Tensor, one_at_a_time: bool, batch_size: int = 256) -> torch.Tensor:
    if one_at_a_time:
        return torch.cat([model(x[i : i + 1]).argmax(1) for i in range(len(x))])
    return torch.cat([model(x[i : i + batch_size]).argmax(1) for i in range(0, len(x), batch_size)])


def qualified(original: nn.Module, edge: EdgeModel, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Inputs both the original and the edge copy (one at a time for int8) classify correctly."""
    return (_classify(original, x, False) == y) & (_classify(edge, x, edge.quantize == "int8") == y)


def evasion(original: nn.Module, edge: EdgeModel, x: np.ndarray | torch.Tensor, y: np.ndarray | torch.Tensor, *,
            eps: float, step: float, steps: int, c: float = 1.0, lo=None, hi=None, batch_size: int = 128,
            methods: tuple[str, ...] = METHODS) -> dict:
    """DIVA and PGD against `edge` (an edge copy of `original`) on the inputs (x, y) both classify
    correctly: per method, edge_success, undetected, undetected_of_success, original_fooled (shares of
    the qualified inputs), plus `qualified` (how many) and `inputs`. `lo`/`hi`: the valid input range
    (default: x's own min / max per channel). Float image inputs only."""
    x, y = torch.as_tensor(x), torch.as_tensor(y).long()
    if not x.is_floating_point():
        raise ValueError("DIVA and PGD perturb float inputs; token ids (text models) cannot be perturbed this way")
    original = original.eval()
    for p in original.parameters():
        p.requires_grad_(False)
    sim = differentiable(edge).eval()
    if lo is None or hi is None:
        dims = [0] + list(range(2, x.ndim))
        lo, hi = x.amin(dims, keepdim=True)[0:1], x.amax(dims, keepdim=True)[0:1]
    keep = qualified(original, edge, x, y)
    xq, yq = x[keep], y[keep]
    one_at_a_time = edge.quantize == "int8"
    out: dict = {"inputs": len(x), "qualified": int(keep.sum())}
    for method in methods:
        adv = torch.cat([attack_batch(method, original, sim, xq[i : i + batch_size], yq[i : i + batch_size], eps=eps,
                                      step=step, steps=steps, lo=lo, hi=hi, c=c)
                         for i in range(0, len(xq), batch_size)]) if len(xq) else xq
        edge_wrong = _classify(edge, adv, one_at_a_time) != yq
        orig_right = _classify(original, adv, False) == yq
        n = max(len(yq), 1)
        success, undetected = edge_wrong.sum().item(), (edge_wrong & orig_right).sum().item()
        out[method] = {"edge_success": success / n, "undetected": undetected / n,
                       "undetected_of_success": undetected / success if success else None,
                       "original_fooled": (~orig_right).sum().item() / n,
                       "max_perturbation": (adv - xq).abs().amax().item() if len(xq) else 0.0}
    return out
