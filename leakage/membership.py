"""Membership inference against the global model (issue #36): is this example one some client
trained on? Two attacks, one calling convention, `scores(query) -> Tensor[N]` (higher: more
likely a member), scored threshold-free by the harness with `membership_metrics` (ROC AUC and the
true-positive rate at a low false-positive rate).

**loss_threshold** — Yeom, Giacomelli, Fredrikson, Jha, "Privacy Risk in Machine Learning:
Analyzing the Connection to Overfitting" (CSF 2018). Training drives a model's loss on its
training examples below its loss on unseen ones, so the per-example cross-entropy

    ℓ(x, y) = −log softmax(f(x))_y,        score(x, y) = −ℓ(x, y)

separates members from non-members exactly as far as the model overfits. The paper's adversary
decides "member" when ℓ(x, y) ≤ τ, with τ the model's expected (average) training loss, which the
adversary is assumed to know. The harness's AUC sweeps every τ; the paper's own decision is
reported beside it (`info["decision_threshold"]` = −τ, in score units, for
`membership_metrics(..., threshold=)`), with τ from `threshold`:

* `shadow` (default): the server does not know the global model's training loss, so fedsim
  estimates it the only way the query allows: it trains one model of the federation's
  architecture centrally on the attacker's whole `population` (the federation's optimizer, lr,
  batch size, `shadow_epochs` epochs) and takes that model's mean loss on its own training data
  (in eval mode, after training). A stand-in for the paper's known training loss, stated as such.
* `none`: no decision, scores only (no training; `info` has no threshold).

**lira_offline** — Carlini, Chien, Nasr, Song, Terzis, Tramèr, "Membership Inference Attacks From
First Principles" (S&P 2022), the offline Likelihood Ratio Attack (its Algorithm 1 without the IN
models). The attacker trains K shadow ("OUT") models of the target's architecture on random
halves of data it owns (`query.population`, disjoint from every target, so every target is OUT
for every shadow), and reads each target's logit-scaled confidence

    φ(x, y) = log( p_y / (1 − p_y) ),   p = softmax(f(x)),

which is close to Gaussian across models. Per target i it fits N(μ_i, σ_i²) to the K shadow
values φ_{k,i} and runs the paper's one-sided test: the evidence of membership is how far the
target model's φ_i lies above the OUT distribution,

    Λ_i = Pr[Z ≤ φ_i] = Φ((φ_i − μ_i)/σ_i),   Z ~ N(μ_i, σ_i²),

and fedsim returns the monotone transform score_i = −log Pr[Z > φ_i] = −log Φ(−(φ_i − μ_i)/σ_i)
(torch.special.log_ndtr, in float64), which ranks exactly as Λ_i but keeps apart the confident
members whose Λ_i would round to 1. With few shadows the paper recommends one global variance
(`fixed_variance`, default true): σ_i = σ for every target.

Official code: `tensorflow/privacy`, `research/mi_lira_2021/` (JAX/objax). What fedsim follows:

* `train.py` `get_data`: with K experiments, a uniform matrix U[K, n] is argsorted along the model
  axis and an example is in model k's training set when its entry is < pkeep·K (pkeep = ½), so every
  population example trains exactly ⌊K/2⌋ of the shadows; fedsim draws the same construction
  from `query.generator`.
* `score.py` `load_one`: φ = log(p_y) − log(Σ_{j≠y} p_j) from a max-subtracted float64 softmax, each
  probability + 1e-45 (so |φ| saturates near 103). fedsim computes the same quantity from the
  logits as φ = z_y − logsumexp_{j≠y} z_j in float64: equal where the official one does not
  saturate, finite and exact beyond (the "numerically stable" computation the paper asks for).
* `plot.py` `generate_ours_offline`: μ_i is the *median* of the OUT φ's (`np.median`, fedsim:
  `torch.quantile(.., 0.5)`, which averages the two middle values as numpy does); σ_i their
  standard deviation (`np.std`, ddof 0); with `fix_variance`, σ = `np.std` of all OUT values at
  once (about the global mean, so it includes the spread between examples; a constant either way,
  which changes no ranking); 1e-30 is added to σ.

Where fedsim differs, and why:

* The decision statistic: `plot.py`'s offline variant scores with the OUT *density*
  (`-norm.logpdf`, two-sided: a φ far *below* the OUT mean also counts as "member"); fedsim
  follows the paper's one-sided test (Λ above), which the paper states for the offline attack.
* Shadow models are trained centrally (`fedsim.training.train`, the clients' own loop: SGD with
  the federation's momentum and weight decay, lr and batch size from the federation or the
  `shadow_lr` / `shadow_batch_size` fields, `shadow_epochs` epochs), not by a simulated
  federation: the global model is a FedAvg of many clients' local SGD, which a central run only
  imitates. The official code trains its shadows exactly as its targets (same script).
* Few shadows (default 8; the paper uses up to 256, its README's demo 16) and no augmentation
  (the official code queries 2 mirrors × shifts and averages φ over them; fedsim's tasks include
  non-image data, and augmentation would multiply the cost).
* Offline only: the online variant needs IN models trained *with* each target, i.e. models per
  game, which costs K trainings per round; the offline one reuses its shadows across rounds
  (cached in the instance by the population's content and the training settings).
* Randomness (halves, initial weights, batch order) is drawn from `query.generator`, so the same
  generator seed gives the same scores.

`membership_metrics` reports what the LiRA paper argues for: the ROC AUC (sklearn) and the TPR at
1% and 0.1% FPR (the largest TPR on the ROC curve whose FPR ≤ the level; `plot.py` takes the last
point with FPR strictly below 0.1%). Below 1000 non-members, 0.1% FPR is not resolvable (no false
positive is possible below it) and is reported as None; below 100, the 1% figure is the TPR at zero
false positives.

Heavy libraries (scikit-learn) are imported inside the functions that use them: this module is
imported by every process that loads the registries, a device's ClientApp included.
"""

from __future__ import annotations

import hashlib
import time
from typing import Literal

import numpy as np
import torch
from pydantic import Field

from fedsim.leakage.base import MembershipQuery, PrivacyAttackParams
from fedsim.registry import PRIVACY_ATTACKS
from fedsim.seeding import TORCH_GLOBAL_RNG
from fedsim.training import TrainConfig, train

# ---------------------------------------------------------------------------------------------
# Parameters


class ShadowTrainingParams(PrivacyAttackParams):
    """How the attacker's own models imitate the federation's training (central SGD)."""

    shadow_epochs: int = Field(
        10, ge=1, le=10_000, description="epochs each shadow model trains on its share of the population (set it near "
        "how many passes the global model has made over a member: rounds × local epochs × participation)")
    shadow_lr: float | None = Field(
        None, gt=0, description="the shadow models' SGD learning rate (default: the federation's lr in the attacked round)")
    shadow_batch_size: int | None = Field(
        None, ge=1, description="the shadow models' batch size (default: federation.batch_size)")
    eval_batch_size: int = Field(512, ge=1, description="examples per forward pass when scoring targets")


class LossThresholdParams(ShadowTrainingParams):
    threshold: Literal["shadow", "none"] = Field(
        "shadow", description="the paper's decision threshold τ (member iff loss ≤ τ, τ = the expected training loss): "
        "`shadow` estimates τ as the training loss of one model trained centrally on the whole population "
        "(shadow_* fields); `none` reports scores only (the AUC needs no threshold)")


class LiraOfflineParams(ShadowTrainingParams):
    shadow_models: int = Field(
        8, ge=2, le=1024, description="OUT models trained on random halves of the population (the paper: up to 256; "
        "its code's demo: 16); each population example trains half of them")
    fixed_variance: bool = Field(
        True, description="one global variance for every target's OUT Gaussian, as the paper recommends with fewer "
        "than 64 shadow models; false: each target's own variance over the shadows")


# ---------------------------------------------------------------------------------------------
# The statistics, as pure tensor functions


def example_losses(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per-example cross-entropy −log softmax(z)_y, in float64."""
    z = logits.double()
    return torch.logsumexp(z, dim=1) - z.gather(1, y.long().view(-1, 1)).squeeze(1)


def logit_confidence(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """LiRA's φ = log(p_y / (1 − p_y)) from logits, stably: z_y − logsumexp_{j≠y} z_j, in float64."""
    z = logits.double()
    idx = y.long().view(-1, 1)
    true = z.gather(1, idx).squeeze(1)
    others = z.scatter(1, idx, float("-inf"))
    return true - torch.logsumexp(others, dim=1)


def lira_offline_scores(phi: torch.Tensor, phi_out: torch.Tensor, fixed_variance: bool = True) -> torch.Tensor:
    """The offline LiRA score of each target: −log Pr[Z > φ_i], Z ~ N(μ_i, σ_i²) fitted to the OUT
    models' φ's (μ_i their median, σ_i their standard deviation, or with `fixed_variance` the
    standard deviation of all OUT values at once), as `plot.py`'s `generate_ours_offline` fits them.

    phi: [N] the target model's φ; phi_out: [K, N] the shadow models'. Returns [N] float64."""
    phi_out = phi_out.double()
    if phi_out.ndim != 2 or phi_out.shape[1] != phi.shape[0] or phi_out.shape[0] < 1:
        raise ValueError(f"phi_out must be [K, N] with N = {phi.shape[0]} targets; got {tuple(phi_out.shape)}")
    mu = torch.quantile(phi_out, 0.5, dim=0)
    sigma = phi_out.std(correction=0) if fixed_variance else phi_out.std(dim=0, correction=0)
    z = (phi.double() - mu) / (sigma + 1e-30)
    return -torch.special.log_ndtr(-z)


def membership_metrics(scores: torch.Tensor, is_member: torch.Tensor, threshold: float | None = None) -> dict:
    """ROC AUC and TPR at 1% / 0.1% FPR of `scores` (higher: member) against the truth.

    `tpr_at_1pct_fpr`: the largest TPR on the ROC curve with FPR ≤ 0.01; `tpr_at_0.1pct_fpr` likewise at
    0.001, None below 1000 non-members (that rate is not resolvable). With `threshold` (in score
    units, e.g. a loss attack's −τ), the decision score ≥ threshold as well: its TPR, FPR, accuracy
    and Yeom et al.'s membership advantage TPR − FPR."""
    from sklearn.metrics import roc_auc_score, roc_curve

    s = scores.detach().double().cpu().numpy()
    truth = is_member.detach().cpu().numpy().astype(bool)
    members, non_members = int(truth.sum()), int((~truth).sum())
    out: dict = {"members": members, "non_members": non_members}
    if members == 0 or non_members == 0 or not np.isfinite(s).all():
        why = "one class is empty" if members == 0 or non_members == 0 else "non-finite scores"
        return {**out, "auc": None, "tpr_at_1pct_fpr": None, "tpr_at_0.1pct_fpr": None, "note": why}
    fpr, tpr, _ = roc_curve(truth, s, drop_intermediate=False)

    def tpr_at(level: float) -> float:
        return float(tpr[fpr <= level + 1e-12].max())

    out["auc"] = float(roc_auc_score(truth, s))
    out["tpr_at_1pct_fpr"] = tpr_at(0.01)
    out["tpr_at_0.1pct_fpr"] = tpr_at(0.001) if non_members >= 1000 else None
    if threshold is not None:
        decided = s >= threshold
        t_rate, f_rate = float(decided[truth].mean()), float(decided[~truth].mean())
        out.update({"threshold": float(threshold), "tpr_at_threshold": t_rate, "fpr_at_threshold": f_rate,
                    "advantage_at_threshold": t_rate - f_rate,
                    "accuracy_at_threshold": float((decided == truth).mean())})
    return out


# ---------------------------------------------------------------------------------------------
# Models: forward passes and shadow training


@torch.no_grad()
def batched_logits(model: torch.nn.Module, x: torch.Tensor, device: torch.device, batch: int) -> torch.Tensor:
    """`model`'s logits on `x` in eval mode, `batch` examples per pass on `device` (where the model
    is); its train/eval mode is restored afterwards."""
    was_training = model.training
    model.eval()
    try:
        outs = [model(x[i : i + batch].to(device)) for i in range(0, len(x), batch)]
    finally:
        model.train(was_training)
    if not outs:
        return torch.empty(0, 0, device=device)
    return torch.cat(outs)


def _draw_seed(gen: torch.Generator) -> int:
    return int(torch.randint(0, 2**62, (1,), generator=gen, device=gen.device).item())


def _fingerprint(*tensors: torch.Tensor) -> str:
    h = hashlib.blake2b(digest_size=16)
    for t in tensors:
        a = t.detach().cpu().contiguous()
        h.update(str((tuple(a.shape), str(a.dtype))).encode())
        h.update(a.numpy().tobytes())
    return h.hexdigest()


def train_shadow(query: MembershipQuery, x: torch.Tensor, y: torch.Tensor, params: ShadowTrainingParams,
                 gen: torch.Generator) -> tuple[torch.nn.Module, dict]:
    """One model of the federation's architecture, initialised and trained on (x, y) centrally with
    the federation's SGD (momentum, weight decay) for `shadow_epochs`; its initial weights and batch
    order are drawn from `gen`. Returns it on `query.device`, in eval mode, and the training stats."""
    init_seed, train_seed = _draw_seed(gen), _draw_seed(gen)
    with TORCH_GLOBAL_RNG, torch.random.fork_rng(devices=[]):  # the init draws from torch's global generator
        torch.manual_seed(init_seed)
        model = query.build_model()
    t = query.training
    cfg = TrainConfig(epochs=params.shadow_epochs, batch_size=params.shadow_batch_size or t.batch_size,
                      lr=params.shadow_lr or t.lr, momentum=t.momentum, weight_decay=t.weight_decay,
                      device=str(query.device))
    xs = np.ascontiguousarray(x.detach().cpu().numpy())
    ys = np.ascontiguousarray(y.detach().cpu().numpy().astype(np.int64))
    stats = train(model, xs, ys, cfg, train_seed)
    return model.to(query.device).eval(), stats


def _shadow_key(query: MembershipQuery, params: ShadowTrainingParams, what: str) -> tuple:
    t = query.training
    return (what, _fingerprint(*query.population), params.shadow_epochs, params.shadow_lr or t.lr,
            params.shadow_batch_size or t.batch_size, t.momentum, t.weight_decay, str(query.device))


def _population(query: MembershipQuery, need: int) -> tuple[torch.Tensor, torch.Tensor]:
    px, py = query.population
    if len(px) < need:
        raise ValueError(f"the attacker's population has {len(px)} examples; shadow training needs at least {need}")
    return px, py


# ---------------------------------------------------------------------------------------------
# The attacks


@PRIVACY_ATTACKS.register("loss_threshold", LossThresholdParams, kind="membership")
class LossThreshold:
    """Yeom et al. (CSF 2018): score = −cross-entropy of the global model; the paper's decision
    at τ = the expected training loss (estimated by a shadow model on the population)."""

    def __init__(self, params: LossThresholdParams) -> None:
        self.params = params
        self.info: dict = {}
        self._tau: tuple[tuple, float, dict] | None = None  # (key, τ, its shadow's stats)

    def scores(self, query: MembershipQuery) -> torch.Tensor:
        started = time.perf_counter()
        logits = batched_logits(query.model, query.x, query.device, self.params.eval_batch_size)
        losses = example_losses(logits, query.y.to(logits.device))
        scores = (-losses).cpu()
        self.info = {"targets": len(scores), "mean_loss": float(losses.mean()) if len(losses) else float("nan")}
        if self.params.threshold == "shadow":
            tau, stats, cached = self.expected_training_loss(query)
            self.info.update({"threshold_loss": tau, "decision_threshold": -tau, "threshold_source": "shadow",
                              "shadow_train_loss": stats.get("loss"), "shadow_cached": cached,
                              "predicted_members": int((losses <= tau).sum())})
        self.info["seconds"] = time.perf_counter() - started
        return scores

    def expected_training_loss(self, query: MembershipQuery) -> tuple[float, dict, bool]:
        """τ: the mean loss, on its own training data, of one model trained on the whole population
        as the federation trains (cached per population and training settings)."""
        key = _shadow_key(query, self.params, "tau")
        if self._tau is not None and self._tau[0] == key:
            return self._tau[1], self._tau[2], True
        px, py = _population(query, 1)
        model, stats = train_shadow(query, px, py, self.params, query.generator)
        logits = batched_logits(model, px, query.device, self.params.eval_batch_size)
        tau = float(example_losses(logits, py.to(logits.device)).mean())
        self._tau = (key, tau, stats)
        return tau, stats, False


@PRIVACY_ATTACKS.register("lira_offline", LiraOfflineParams, kind="membership")
class LiraOffline:
    """Carlini et al. (S&P 2022), offline LiRA: the one-sided test of the target model's logit-scaled
    confidence against Gaussians fitted to shadow OUT models trained on halves of the population."""

    def __init__(self, params: LiraOfflineParams) -> None:
        self.params = params
        self.info: dict = {}
        self._shadows: tuple[tuple, list[torch.nn.Module], dict] | None = None  # (key, models, their cost)

    def shadow_models(self, query: MembershipQuery) -> tuple[list[torch.nn.Module], dict, bool]:
        """The K OUT models, trained once per population and training settings (then cached)."""
        key = _shadow_key(query, self.params, "lira")
        if self._shadows is not None and self._shadows[0] == key:
            return self._shadows[1], self._shadows[2], True
        k = self.params.shadow_models
        px, py = _population(query, 2)
        gen = query.generator
        # train.py's get_data: each example trains exactly floor(K/2) of the K shadows
        u = torch.rand(k, len(px), generator=gen, device=gen.device).cpu()
        keep = u.argsort(dim=0) < k // 2
        started, models, losses = time.perf_counter(), [], []
        for j in range(k):
            idx = keep[j].nonzero().squeeze(1)
            if len(idx) == 0:  # a tiny population: train on one example rather than none
                idx = torch.randint(0, len(px), (1,), generator=gen, device=gen.device).cpu()
            model, stats = train_shadow(query, px[idx], py[idx], self.params, gen)
            models.append(model)
            losses.append(stats.get("loss"))
        cost = {"shadow_train_seconds": time.perf_counter() - started, "shadow_train_loss": losses,
                "shadow_train_size": int(keep.sum(1).float().mean().item())}
        self._shadows = (key, models, cost)
        return models, cost, False

    def scores(self, query: MembershipQuery) -> torch.Tensor:
        started = time.perf_counter()
        models, cost, cached = self.shadow_models(query)
        b = self.params.eval_batch_size
        y = query.y.to(query.device)
        phi = logit_confidence(batched_logits(query.model, query.x, query.device, b), y)
        phi_out = torch.stack([logit_confidence(batched_logits(m, query.x, query.device, b), y) for m in models])
        scores = lira_offline_scores(phi, phi_out, self.params.fixed_variance).cpu()
        self.info = {"targets": len(scores), "shadow_models": len(models), "shadow_cached": cached, **cost,
                     "seconds": time.perf_counter() - started}
        return scores
