"""Deep Leakage from Gradients (DLG, Zhu, Liu & Han, NeurIPS 2019) and its label trick, iDLG (Zhao,
Mopuri & Bilen, arXiv 2001.02610, 2020).

**DLG.** The server observed a client's gradient ∇W = ∂ℓ(F(x, W), y)/∂W. It draws a dummy input
x' ~ N(0, 1) and a dummy label y' ~ N(0, 1) (logits; the soft label is softmax(y')) and solves

    x'*, y'* = argmin_{x', y'} ‖ ∂ℓ(F(x', W), softmax(y'))/∂W − ∇W ‖²

with ℓ the cross-entropy against a soft label, −mean_i Σ_c softmax(y'_i)_c · log softmax(F(x'_i))_c,
by L-BFGS: the official `mit-han-lab/dlg` `main.py` (torch.optim.LBFGS on [dummy_data,
dummy_label], lr 1, torch's 20 inner iterations per step, 300 steps, the squared L2 distance
summed over all parameter tensors). A batch is reconstructed the same way with m dummy inputs and
m soft labels (the paper's batched DLG).

**iDLG.** For one example and cross-entropy, the gradient of the last layer's weight row c is
(p_c − y_c)·a, with a the layer's input: p_c − y_c < 0 only for the true class, so when a ≥ 0
(ReLU, sigmoid) the true label is the row whose gradient is negative. The official
`PatrickZH/Improved-Deep-Leakage-from-Gradients` `iDLG.py` takes argmin_c Σ_j ∇W_last[c, j] and
then runs DLG with that hard label fixed (L-BFGS on the input only, lr 1, 300 iterations, stopping
once the loss falls below 1e-6).

**From an upload to a gradient.** fedsim's server never sees a gradient: it sees the update
Δ = w_local − w_global after the client's `obs.training.steps` SGD steps at lr η. For one step
with weight decay λ (momentum does not act on the first step), Δ = −η (∇W + λ W), so

    ∇W = −Δ / η − λ W                                          (exact for one step)

For several steps DLG and iDLG still take ∇W ≈ −Δ / (η · steps) − λ W, the average gradient, and
match it as if it were one gradient of all the examples: both papers attack a single gradient
(Inverting Gradients, `fedsim.leakage.inverting`, simulates the steps instead). Only the trainable
coordinates are matched (a BatchNorm's running statistics are not gradients).

**Labels of a batch (iDLG for m > 1).** The paper's rule is for one example (and exact there:
tested). For a batch, fedsim counts labels from the last layer's bias gradient, breaching's default
`label_strategy: bias-corrected` (`breaching/attacks/base_attack.py`, `_recover_label_information`):
the bias gradient is (1/m) Σ_i (p_i − y_i), negative at the classes present; each negative class is
taken once, the mean impact of one example μ = (Σ of the negative entries)/m is added back to
them, and the remaining labels are the repeated argmin, adding μ back after each pick. A last layer
without a bias uses its weight rows' sums instead (the iDLG signal), the same count. These labels
are exact for a batch of distinct classes whose softmax is not yet confident; they are a
heuristic otherwise (Wainakh et al., PETS 2022, discuss its error).

**Where fedsim differs and why.**
- The gradient comes from the decoded upload (above), not from the model directly: the server
  only has the upload. For several local steps it is an average gradient, not a gradient.
- The model is evaluated in eval mode (the harness's `Observation.model`): a client that trained
  with dropout computed its gradient under a random mask the server cannot know.
- Each parameter-space gradient is one flat vector: ∂ℓ/∂w of the global vector w (a single leaf,
  unflattened by the layout into the model's tensors through `torch.func.functional_call`), so
  the matching loss is one vectorised sum over the trainable coordinates.
- `restarts` (default 1, as the official scripts) draws a fresh dummy each time and keeps the one
  with the smallest matching loss; a restart whose L-BFGS diverges (a non-finite loss, which the
  official code does not guard against) stops there and counts only if it is the best finite one.
- The returned inputs are clamped to the dataset's bounds (DLG optimises without a box); labels are
  the soft labels' argmax (DLG, as the official `label_DLG`) or the inferred ones (iDLG).
- DLG keeps the 1e-6 convergence stop of iDLG's official code, so the two differ only in the label.
- Randomness (the dummy inputs and labels) is drawn from `obs.generator`: the same observation
  gives the same reconstruction.
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F
from pydantic import Field

from fedsim.leakage.base import InversionParams, Observation, Reconstruction, functional_forward
from fedsim.registry import PRIVACY_ATTACKS


# --------------------------------------------------------------------------- what the server observed
def check_observation(obs: Observation) -> None:
    """A clear error when the upload or the weights do not fit the model's layout."""
    d = obs.layout.dim
    for name, vec in (("update", obs.update), ("weights", obs.weights)):
        if vec.ndim != 1 or vec.numel() != d:
            raise ValueError(f"the observed {name} has shape {tuple(vec.shape)}, which does not fit the model's "
                             f"layout of {d} values ({len(obs.layout.names)} tensors): is it the decoded update of "
                             f"this model?")
    if obs.training.lr <= 0:
        raise ValueError(f"the clients' lr is {obs.training.lr}: an update cannot be turned into a gradient")


def trainable_mask(obs: Observation) -> torch.Tensor:
    """`[d]` boolean on `obs.device`: the coordinates that are parameters (not buffers)."""
    return obs.layout.trainable_mask.to(obs.device)


def observed_gradient(obs: Observation) -> torch.Tensor:
    """The gradient the upload stands for, on the trainable coordinates (`[p]`): −Δ/(η·steps) − λw
    (exact for one SGD step; the average gradient for several)."""
    check_observation(obs)
    t = obs.training
    g = -obs.update.float() / (t.lr * max(t.steps, 1)) - t.weight_decay * obs.weights.float()
    return g[trainable_mask(obs)]


def _head(obs: Observation) -> tuple[slice, slice | None, int]:
    """Where the classification layer sits in the trainable vector: (weight rows, bias or None,
    number of classes). The last trainable tensors must be the head's weight [C, H] (and bias [C])."""
    layout = obs.layout.trainable_only()
    shapes, offsets = layout.shapes, layout.offsets
    c = obs.num_classes
    if len(shapes) >= 2 and shapes[-1] == (c,) and len(shapes[-2]) == 2 and shapes[-2][0] == c:
        return slice(offsets[-2], offsets[-1]), slice(offsets[-1], offsets[-1] + c), shapes[-2][1]
    if shapes and len(shapes[-1]) == 2 and shapes[-1][0] == c:
        return slice(offsets[-1], offsets[-1] + c * shapes[-1][1]), None, shapes[-1][1]
    raise ValueError(f"label inference needs the model's last layer to be a linear map to the {c} classes "
                     f"(weight [{c}, H] and bias [{c}]); the last tensors are {shapes[-2:]}")


def idlg_label(grad: torch.Tensor, obs: Observation) -> int:
    """iDLG (official `iDLG.py`): argmin over classes of the last layer's weight-gradient row sums."""
    w, _, hidden = _head(obs)
    return int(grad[w].view(obs.num_classes, hidden).sum(1).argmin())


def count_labels(grad: torch.Tensor, obs: Observation, m: int) -> torch.Tensor:
    """`m` labels of a batch from the last layer's bias gradient (breaching's `bias-corrected`, see
    the module docstring; the weight rows' sums when the layer has no bias). Sorted."""
    w, b, hidden = _head(obs)
    signal = (grad[b] if b is not None else grad[w].view(obs.num_classes, hidden).sum(1)).detach().double().cpu().clone()
    negative = torch.nonzero(signal < 0).flatten()
    negative = negative[signal[negative].argsort()][:m]  # the most negative first, at most m of them
    picked = negative.tolist()
    impact = float(signal[negative].sum()) / m if len(negative) else -1.0 / m
    signal[negative] -= impact
    while len(picked) < m:
        c = int(signal.argmin())
        picked.append(c)
        signal[c] -= impact
    return torch.tensor(sorted(picked), dtype=torch.int64)


def infer_labels(grad: torch.Tensor, obs: Observation, m: int) -> tuple[torch.Tensor, str]:
    """Labels of the `m` examples behind a (possibly averaged) gradient, and the rule used."""
    if m == 1:
        return torch.tensor([idlg_label(grad, obs)], dtype=torch.int64), "idlg"
    return count_labels(grad, obs, m), "bias-count"


def images_to_reconstruct(obs: Observation, max_images: int) -> int:
    """`obs.images`, else the examples the client's steps touched, capped at `max_images`."""
    m = obs.images if obs.images is not None else obs.training.examples_used
    return max(1, min(int(m), max_images))


def soft_cross_entropy(logits: torch.Tensor, label_logits: torch.Tensor) -> torch.Tensor:
    """DLG's loss against a soft label: −mean_i Σ_c softmax(label)_ic · log softmax(logits)_ic."""
    return -(torch.softmax(label_logits, -1) * F.log_softmax(logits, -1)).sum(-1).mean()


class GradientOf:
    """∂ℓ/∂w at the broadcast weights, as one flat vector over the trainable coordinates."""

    def __init__(self, obs: Observation) -> None:
        self.obs = obs
        self.mask = trainable_mask(obs)
        self.w = obs.weights.detach().float().clone().requires_grad_(True)

    def __call__(self, x: torch.Tensor, labels: torch.Tensor, soft: bool, create_graph: bool = True) -> torch.Tensor:
        out = functional_forward(self.obs, self.w, x)
        loss = soft_cross_entropy(out, labels) if soft else F.cross_entropy(out, labels)
        (g,) = torch.autograd.grad(loss, self.w, create_graph=create_graph)
        return g[self.mask]


def draw(obs: Observation, shape: tuple[int, ...]) -> torch.Tensor:
    """N(0, 1) of `shape` from the observation's generator, on `obs.device`."""
    gen = obs.generator
    return torch.randn(shape, generator=gen, device=gen.device).to(obs.device)


# --------------------------------------------------------------------------- the attacks
class DlgParams(InversionParams):
    iterations: int = Field(300, ge=1, le=100_000, description="L-BFGS steps per restart (official: 300)")
    lr: float = Field(1.0, gt=0, le=100, description="L-BFGS step size (official: 1, torch's default)")
    inner_iterations: int = Field(20, ge=1, le=1000, description="L-BFGS iterations within one step (torch's "
                                  "`max_iter`, 20, which the official code keeps)")
    restarts: int = Field(1, ge=1, le=100, description="fresh dummy inputs tried; the one with the smallest matching "
                          "loss is kept (official: 1)")
    tolerance: float = Field(1e-6, ge=0, description="a restart stops once its matching loss is below this (iDLG's "
                             "official convergence test, 1e-6)")
    max_images: int = Field(8, ge=1, le=1024, description="at most this many inputs are reconstructed (default: the "
                            "examples the client's steps touched; DLG's paper goes up to batches of 8)")


@PRIVACY_ATTACKS.register("dlg", DlgParams, kind="inversion")
class DLG:
    """Deep Leakage from Gradients (Zhu et al. 2019): dummy inputs and soft labels matched to the gradient by L-BFGS."""

    infer = False  # iDLG: the labels come from the last layer's gradient and are fixed

    def __init__(self, params: DlgParams) -> None:
        self.params = params

    def reconstruct(self, obs: Observation) -> Reconstruction:
        started = time.perf_counter()
        target = observed_gradient(obs).detach()
        m = images_to_reconstruct(obs, self.params.max_images)
        fixed, rule = infer_labels(target, obs, m) if self.infer else (None, "dlg-soft")
        gradient_of = GradientOf(obs)
        best, evaluations, steps = None, 0, 0
        for restart in range(self.params.restarts):
            x = draw(obs, (m, *obs.input_shape)).requires_grad_(True)
            soft = fixed is None
            labels = draw(obs, (m, obs.num_classes)).requires_grad_(True) if soft else fixed.to(obs.device)
            opt = torch.optim.LBFGS([x, labels] if soft else [x], lr=self.params.lr,
                                    max_iter=self.params.inner_iterations)

            def closure():
                nonlocal evaluations
                evaluations += 1
                opt.zero_grad()
                loss = (gradient_of(x, labels, soft) - target).pow(2).sum()
                loss.backward()
                return loss

            for _ in range(self.params.iterations):
                loss = float(opt.step(closure).detach())
                steps += 1
                if not math.isfinite(loss) or loss < self.params.tolerance:
                    break
            final = (gradient_of(x, labels, soft, create_graph=False) - target).pow(2).sum().item()
            if math.isfinite(final) and (best is None or final < best[0]):
                best = (final, x.detach().clone(), labels.detach().clone(), restart)
        if best is None:  # every restart diverged: report the last one, scored as such
            best = (float("inf"), x.detach().clone(), labels.detach().clone(), self.params.restarts - 1)
        loss, x, labels, chosen = best
        out = labels.argmax(-1) if fixed is None else labels
        lo, hi = obs.bounds
        return Reconstruction(
            inputs=x.clamp(lo, hi), labels=out.long().cpu() if out is not None else None,
            info={"loss": loss, "restart": chosen, "restarts": self.params.restarts, "lbfgs_steps": steps,
                  "evaluations": evaluations, "images": m, "labels": rule, "local_steps": obs.training.steps,
                  "seconds": time.perf_counter() - started})


class IdlgParams(DlgParams):
    pass


@PRIVACY_ATTACKS.register("idlg", IdlgParams, kind="inversion")
class IDLG(DLG):
    """iDLG (Zhao et al. 2020): the label from the last layer's gradient signs, then DLG with that label fixed."""

    infer = True
