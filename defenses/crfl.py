"""CRFL (Xie, Chen, Chen, Li, ICML 2021): clip and perturb the global model's parameters during
training, smooth them at test time, and certify each prediction against bounded backdoors.

Training (`after`, each round t, once the rule has aggregated):

    w_t ← w_t · min(1, ρ_t / ||w_t||),   ρ_t = min(ρ_max, a·t + b)        (clip the *global model*)
    w_t ← w_t + N(0, σ² I)                                              (noise on every parameter)

as in the official code (AI-secure/CRFL `main.py`, `utils/helper.py: clip_weight_norm`): one L2
norm over the whole flat model (not per layer), scaled by ρ_t / (||w_t|| + 1e-6) when ||w_t|| > ρ_t;
noise on every entry of the state dict. fedsim's flat vector is the state dict (the nets here have
no BatchNorm buffers), so clipping and noise cover the same entries as the code. The defense
returns the adjusted aggregate, w_t − w_{t−1}. Defaults are the MNIST row: min(15, 0.1t + 2), σ = 0.01.
List it last among the defenses: a later defense's `after` would move the model off the bound.

One difference of order: the code evaluates and saves the model of round t after clipping and
*before* adding round t's noise (the noise goes into the model the next round starts from). Here
the evaluator sees the global model after the noise, so `certify` smooths w_t + N(0, σ²) with
N(0, σ_T²) more, an effective test noise of sqrt(σ² + σ_T²) around the clipped model. The model
the next round starts from is distributed exactly as in the code.

Test-time parameter smoothing (`certify`, called by the central evaluator on the last round and
every `certify_every` rounds; code: `smooth_mnist.py`, `certify_mnist.py`):

1. N_m noisy copies w + N(0, σ_T² I) (paper and code: N_m = 1000, σ_T = 0.01; the default here is
   100 copies so that a CPU run stays short), each predicting every input of the (subsampled) set;
2. per input, the vote counts: the top class c_A (ties to the smaller class index, like
   np.argmax), its count n_A, the runner-up's count n_B;
3. a lower bound on p_A and an upper bound on p_B at level α = 0.001. The code uses Hoeffding's
   bound, p_A ≥ n_A/N_m − sqrt(ln(1/α) / (2 N_m)) and p_B ≤ n_B/N_m + the same (clamped to
   [1e-8, 1 − 1e-8]); `bound: clopper_pearson` uses exact one-sided binomial (Clopper–Pearson)
   bounds instead, Beta(α; n_A, N_m − n_A + 1) and Beta(1 − α; n_B + 1, N_m − n_B);
4. an input is certified when p_A_lower > p_B_upper (Theorem's condition; the code's `certify`
   computes a radius for every input and leaves this check to the plots), with radius

       RAD = sqrt( −ln(1 − (√p_A − √p_B)²) · σ² /
                   (2 R τ² L_z² Σ_i p_i² γ² η² (q_B/n_B)² · Π_{t=t_adv+1}^{T−1}(2Φ(ρ_t/σ) − 1) · (2Φ(ρ_T/σ_T) − 1)) )

   with L_z = sqrt(2 + 2ρ + ρ²) (the code fixes ρ = 3, i.e. ρ_t at t_adv = 10), R attackers of
   aggregation weight p_i (1/N for FedAvg over N clients), τ local iterations, γ the attackers'
   scale factor, η the local learning rate, q_B of n_B examples per batch poisoned, the attack in
   round t_adv and certification after round T (`cal_prob_bound`). The radius bounds the L2
   magnitude of the backdoor trigger δ under which the smoothed prediction provably does not
   change. The code's σ in the numerator is the training σ; its contraction uses ρ_t = a·t + b
   without the ρ_max cap, here the ρ_t really used in training (the same in all the paper's runs).

The radius constants describe the attack the certificate is about, not this scenario (the
certifier sees only the model and the test sets): set `radius_*` to match the scenario (η =
`federation.lr`, N = `federation.clients_per_round`, ...). Defaults are the code's MNIST config
(`configs/mnist_params.yaml`): η = 0.001, N = 20, R = 2, q_B/n_B = 5/100, γ = 100, τ = 60000/N/n_B
= 30, t_adv = 70; L_z's ρ = 3 as hard-coded in `certify_mnist.py`. The evaluator does not tell
the certifier the round T, so the contraction product is taken as 1 unless `rnd` is passed:
every factor is ≤ 1, so this gives the smallest radius, a valid (conservative) certificate, and
for the paper's constants (ρ_t/σ ≥ 200) every factor is 1.0 in float64 anyway.

Reported per set (`main`; `backdoor` with an attack): the smoothed (majority-vote) accuracy,
the certified accuracy (certified and correct), the share certified and the mean radius over
the certified inputs. The backdoor set carries the attacker's target labels, not the true ones,
so its numbers are the smoothed and certified backdoor success (vote = target) and
`certified_not_target` (certified and vote ≠ target), an upper bound on the paper's certified
accuracy on backdoored inputs.
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np
import torch
from pydantic import Field

from fedsim.defenses.base import Defense
from fedsim.defenses.clipping import gaussian_like
from fedsim.registry import DEFENSES, Params
from fedsim.seeding import derive_seed
from fedsim.updates import RoundContext

CLIP_EPS = 1e-6  # the code's clip coefficient ρ / (||w|| + 1e-6)
PROB_CLAMP = 1e-8  # the code clamps the Hoeffding bounds to [1e-8, 1 - 1e-8]
INPUT_BATCH = 128  # inputs per vectorized forward pass of `model_batch` copies
SUBSET_STREAM = 0xCE75  # seed of the certified subset: the same inputs every round


class CRFLParams(Params):
    rho_max: float = Field(15.0, gt=0, description="cap ρ_max of the global model's norm bound ρ_t = min(ρ_max, a·t + b) (MNIST: 15; EMNIST: 100)")
    rho_slope: float = Field(0.1, ge=0, description="slope a of ρ_t per round (MNIST: 0.1; EMNIST: 0.25; LOAN: 0.025)")
    rho_intercept: float = Field(2.0, gt=0, description="intercept b of ρ_t (MNIST: 2; EMNIST: 4; LOAN: 2)")
    sigma: float = Field(0.01, ge=0, description="std σ of the Gaussian noise added to every parameter of the clipped global model each round (paper: 0.01)")
    num_models: int = Field(100, ge=2, description="noisy copies N_m voting at certification (paper: 1000; 100 keeps CPU runs short)")
    sigma_test: float = Field(0.01, ge=0, description="std σ_T of the test-time parameter noise (paper: 0.01)")
    alpha: float = Field(0.001, gt=0, lt=1, description="error level α of the bounds on p_A and p_B (paper: 0.001)")
    bound: Literal["hoeffding", "clopper_pearson"] = Field("hoeffding", description="how p_A, p_B are bounded: Hoeffding as in the official code, or exact one-sided Clopper–Pearson")
    certify_subset: int | None = Field(500, ge=1, description="test inputs certified per set (a fixed seeded subset, the same every round); None: all")
    certify_every: int | None = Field(None, ge=1, description="also certify every this many rounds; None: the last round only")
    model_batch: int = Field(10, ge=1, description="noisy copies evaluated together in one vectorized forward pass")
    radius_lr: float = Field(0.001, gt=0, description="radius constant η: the clients' learning rate (code's MNIST config: 0.001)")
    radius_clients: int = Field(20, ge=1, description="radius constant N: clients per round (MNIST config: 20)")
    radius_attackers: int = Field(2, ge=1, description="radius constant R: number of attackers (MNIST config: 2)")
    radius_agg_weight: float | None = Field(None, gt=0, le=1, description="radius constant p_i: each attacker's aggregation weight; None: 1/N (FedAvg)")
    radius_poison_ratio: float = Field(0.05, gt=0, le=1, description="radius constant q_B/n_B: poisoned share of an attacker's batch (MNIST config: 5/100)")
    radius_scale: float = Field(100.0, gt=0, description="radius constant γ: the attackers' update scale factor (MNIST config: 100)")
    radius_local_iters: float = Field(30.0, gt=0, description="radius constant τ: local iterations per round (code: 60000/N/n_B = 30)")
    radius_attack_round: int = Field(70, ge=0, description="radius constant t_adv: the round of the attack (MNIST config: 70)")
    radius_lipschitz_rho: float = Field(3.0, ge=0, description="ρ in the Lipschitz constant L_z = sqrt(2 + 2ρ + ρ²) (hard-coded 3 in the code)")


def clip_bound(t: int, rho_max: float, slope: float, intercept: float) -> float:
    """ρ_t = min(ρ_max, a·t + b), the global model's norm bound in round t."""
    return min(float(rho_max), float(slope) * t + float(intercept))


def clip_model(weights: torch.Tensor, rho: float) -> tuple[torch.Tensor, float, float]:
    """The flat model scaled by ρ / (||w|| + 1e-6) when ||w|| > ρ (the code's `clip_weight_norm`):
    (clipped, norm before, factor)."""
    w = weights.to(torch.float64)
    norm = float(torch.linalg.vector_norm(w))
    factor = rho / (norm + CLIP_EPS) if norm > rho else 1.0
    return (w * factor).to(weights.dtype), norm, factor


@DEFENSES.register("crfl", CRFLParams, certify="fedsim.defenses.crfl:certify")
class CRFL(Defense):
    """CRFL: clip the global model to ρ_t, add N(0, σ²) to its parameters; certify by parameter smoothing (Xie et al. 2021)."""

    def after(self, aggregate: torch.Tensor, ctx: RoundContext) -> tuple[torch.Tensor, dict]:
        p = self.params
        rho = clip_bound(ctx.round, p.rho_max, p.rho_slope, p.rho_intercept)
        new_global, norm, factor = clip_model(ctx.global_weights + aggregate, rho)
        if p.sigma > 0:
            new_global = new_global + gaussian_like(new_global, float(p.sigma), ctx.generator)
        info = {"rho": rho, "norm_before_clip": norm, "clip_factor": factor, "noise_std": float(p.sigma)}
        return new_global - ctx.global_weights, info


# ----------------------------------------------------------------------------- parameter smoothing


def noisy_weights(model: torch.nn.Module, sigma: float, seed: int, start: int, stop: int) -> dict[str, torch.Tensor]:
    """Copies start..stop-1 of the model's floating state entries plus N(0, σ²), stacked on a new
    first axis. Copy i's noise comes from its own generator (seed, i), so the copies do not depend
    on how they are batched."""
    state = {n: t.detach() for n, t in model.state_dict().items() if t.is_floating_point()}
    flat = torch.cat([t.reshape(-1).to(torch.float32) for t in state.values()])
    noise = torch.stack([torch.randn(flat.shape, generator=torch.Generator().manual_seed(derive_seed(seed, i)))
                         for i in range(start, stop)])
    copies = flat[None, :] + sigma * noise.to(flat.device)
    out, offset = {}, 0
    for name, t in state.items():
        out[name] = copies[:, offset:offset + t.numel()].reshape(stop - start, *t.shape).to(t.dtype)
        offset += t.numel()
    return out


def copies_forward(model: torch.nn.Module, fixed: dict[str, torch.Tensor]):
    """Two functions (weights of k copies, input batch) -> logits [k, B, C]: one vmapped forward
    pass, and copy by copy for a module torch.func.vmap cannot trace."""
    def forward(w, inputs):
        return torch.func.functional_call(model, {**w, **fixed}, (inputs,))

    def one_by_one(ws, inputs):
        k = next(iter(ws.values())).shape[0]
        return torch.stack([forward({n: w[i] for n, w in ws.items()}, inputs) for i in range(k)])

    return torch.func.vmap(forward, in_dims=(0, None)), one_by_one


@torch.no_grad()
def vote_counts(model: torch.nn.Module, x: np.ndarray, num_models: int, sigma: float, seed: int,
                model_batch: int = 10) -> np.ndarray:
    """[n, C] counts of the classes predicted for each input by `num_models` noisy copies."""
    model.eval()
    fixed = {n: t for n, t in model.state_dict().items() if not t.is_floating_point()}
    xt = torch.from_numpy(np.ascontiguousarray(x))
    counts: torch.Tensor | None = None
    batched, one_by_one = copies_forward(model, fixed)
    run = batched
    for start in range(0, num_models, model_batch):
        weights = noisy_weights(model, sigma, seed, start, min(start + model_batch, num_models))
        for i in range(0, len(xt), INPUT_BATCH):
            try:
                logits = run(weights, xt[i:i + INPUT_BATCH])  # [k, B, C]
            except (RuntimeError, NotImplementedError):  # what vmap raises for an operation it cannot batch
                if run is one_by_one:
                    raise
                run = one_by_one  # decided once: every later batch goes copy by copy
                logits = run(weights, xt[i:i + INPUT_BATCH])
            if counts is None:
                counts = torch.zeros(len(xt), logits.shape[-1], dtype=torch.int64)
            counts[i:i + INPUT_BATCH] += torch.nn.functional.one_hot(logits.argmax(-1), counts.shape[1]).sum(0)
    return counts.numpy() if counts is not None else np.zeros((0, 0), dtype=np.int64)


def top_two(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row: the top class (first on ties, like np.argmax), its count, and the runner-up's count."""
    top = counts.argmax(axis=1)
    rows = np.arange(len(counts))
    n_a = counts[rows, top]
    rest = counts.copy()
    rest[rows, top] = -1
    n_b = rest.max(axis=1) if counts.shape[1] > 1 else np.zeros_like(n_a)
    return top, n_a, n_b


def probability_bounds(n_a: np.ndarray, n_b: np.ndarray, m: int, alpha: float,
                       method: str = "hoeffding") -> tuple[np.ndarray, np.ndarray]:
    """Lower bound on p_A from n_A of m votes and upper bound on p_B from n_B, each at level α."""
    n_a, n_b = np.asarray(n_a, dtype=np.float64), np.asarray(n_b, dtype=np.float64)
    if method == "hoeffding":
        margin = math.sqrt(math.log(1.0 / alpha) / (2.0 * m))
        return (np.maximum(PROB_CLAMP, n_a / m - margin), np.minimum(1.0 - PROB_CLAMP, n_b / m + margin))
    if method == "clopper_pearson":
        from scipy import stats  # imported here, as the other scipy users in fedsim

        with np.errstate(invalid="ignore"):
            lower = np.where(n_a > 0, stats.beta.ppf(alpha, np.maximum(n_a, 1), m - n_a + 1), 0.0)
            upper = np.where(n_b < m, stats.beta.ppf(1.0 - alpha, n_b + 1, np.maximum(m - n_b, 1)), 1.0)
        return lower, upper
    raise ValueError(f"unknown bound {method!r}")


def contraction(params: CRFLParams, rnd: int | None) -> float:
    """Π_{t=t_adv+1}^{T−1} (2Φ(ρ_t/σ) − 1) · (2Φ(ρ_T/σ_T) − 1), or 1 (the conservative value) when T is unknown."""
    if rnd is None:
        return 1.0
    from scipy import stats  # imported here, as the other scipy users in fedsim

    p = params

    def factor(t: int, sigma: float) -> float:
        rho = clip_bound(t, p.rho_max, p.rho_slope, p.rho_intercept)
        return 1.0 if sigma == 0 else 2.0 * float(stats.norm.cdf(rho / sigma)) - 1.0

    out = 1.0
    for t in range(p.radius_attack_round + 1, rnd):
        out *= factor(t, p.sigma)
    return out * factor(rnd, p.sigma_test)


def certified_radius(p_a: np.ndarray, p_b: np.ndarray, params: CRFLParams, contract: float = 1.0) -> np.ndarray:
    """CRFL's radius on the trigger magnitude for bounds p_A, p_B (`cal_prob_bound` in the code)."""
    p = params
    weight = p.radius_agg_weight if p.radius_agg_weight is not None else 1.0 / p.radius_clients
    lipschitz = math.sqrt(2.0 + 2.0 * p.radius_lipschitz_rho + p.radius_lipschitz_rho ** 2)
    denominator = (2.0 * p.radius_attackers * p.radius_local_iters ** 2 * lipschitz ** 2
                   * p.radius_attackers * weight ** 2 * p.radius_scale ** 2 * p.radius_lr ** 2
                   * p.radius_poison_ratio ** 2 * contract)
    gap = (np.sqrt(p_a) - np.sqrt(p_b)) ** 2
    with np.errstate(divide="ignore"):
        numerator = -np.log1p(-gap) * p.sigma ** 2
    return np.sqrt(numerator / denominator)


def certify_counts(counts: np.ndarray, params: CRFLParams, contract: float = 1.0) -> dict[str, np.ndarray]:
    """Per input: the vote, n_A, n_B, the bounds p_A, p_B, whether certified (p_A > p_B) and the
    radius (0 where not certified)."""
    m = int(params.num_models)
    vote, n_a, n_b = top_two(counts)
    p_a, p_b = probability_bounds(n_a, n_b, m, params.alpha, params.bound)
    certified = p_a > p_b
    radius = np.where(certified, certified_radius(p_a, p_b, params, contract), 0.0)
    return {"vote": vote, "certified": certified, "radius": radius, "n_a": n_a, "n_b": n_b, "p_a": p_a, "p_b": p_b}


def _subset(n: int, size: int | None) -> np.ndarray:
    if size is None or size >= n:
        return np.arange(n)
    return np.sort(np.random.default_rng(derive_seed(SUBSET_STREAM, n)).choice(n, size, replace=False))


def _share(hits: np.ndarray) -> float | None:
    return float(hits.mean()) if len(hits) else None


def certify(spec: CRFLParams, model: torch.nn.Module, sets: dict, seed: int, rnd: int | None = None) -> dict:
    """Parameter smoothing and certification of `model` on `sets` ({"main": (x, y), "backdoor": (x, targets)})."""
    contract = contraction(spec, rnd)
    out: dict = {"num_models": int(spec.num_models), "sigma_test": float(spec.sigma_test), "alpha": float(spec.alpha),
                 "bound": spec.bound, "contraction": contract}
    for set_name, (x, y) in sets.items():
        keep = _subset(len(y), spec.certify_subset)
        x, y = x[keep], np.asarray(y)[keep]
        if len(y) == 0:
            continue
        counts = vote_counts(model, x, spec.num_models, spec.sigma_test, seed, spec.model_batch)  # same copies for every set
        res = certify_counts(counts, spec, contract)
        hit, cert = res["vote"] == y, res["certified"]
        radius = res["radius"][cert]
        numbers = {"n": int(len(y)), "certified_share": _share(cert),
                   "mean_radius": float(radius.mean()) if len(radius) else None}
        if set_name == "main":
            numbers |= {"smoothed_accuracy": _share(hit), "certified_accuracy": _share(hit & cert)}
        else:
            numbers |= {"smoothed_success": _share(hit), "certified_success": _share(hit & cert),
                        "certified_not_target": _share(~hit & cert)}
        out[set_name] = numbers
    return out
