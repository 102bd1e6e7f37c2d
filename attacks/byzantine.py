"""Omniscient Byzantine model poisoning, crafted by the simulated server (simulation only).

The server sees the round's honest updates `[h, d]` and writes the `m` malicious ones. A real
attacker would have to collude and see the benign updates (or estimate them from its own data);
here every attack uses all honest updates of the round. Statistics are taken in float64 and the
result is cast back to the honest dtype. No attack learns the attacker's own honest update (the
server never trains it), so those that need "the" honest update use the honest mean.

`craft` returns the malicious rows with the scalars the attack chose (γ, z, noise std) for the round log.
"""

from __future__ import annotations

import math
from abc import abstractmethod
from typing import Callable, Literal

import torch
from pydantic import Field

from fedsim.attacks.base import AttackParams, Crafted, ServerAttack
from fedsim.registry import ATTACKS, Params
from fedsim.updates import RoundContext


class _Byzantine(ServerAttack):
    simulation_only = True


def _need_honest(honest: torch.Tensor, name: str) -> torch.Tensor:
    if honest.ndim != 2 or honest.shape[0] == 0:
        raise ValueError(f"{name} needs at least one honest update [h, d], got shape {tuple(honest.shape)}")
    return honest.to(torch.float64)


def _repeat(vec: torch.Tensor, m: int, like: torch.Tensor) -> torch.Tensor:
    """`m` copies of `vec` in the honest dtype: colluding attackers all send the same update."""
    return vec.to(like.dtype)[None, :].expand(m, -1).clone()


def _std(x: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Per-coordinate std over rows; with a single row the (unbiased) std is undefined, so 0."""
    return x.std(dim=0, correction=1 if unbiased and x.shape[0] > 1 else 0)


# --------------------------------------------------------------------------------------------------


class GaussianParams(AttackParams):
    sigma: float = Field(1.0, gt=0, description="noise std; with relative=True, in units of the mean honest norm / sqrt(d)")
    relative: bool = Field(True, description="scale σ by mean honest ||Δ|| / sqrt(d), so E||noise|| ≈ σ · mean honest norm")


@ATTACKS.register("gaussian", GaussianParams)
class GaussianAttack(_Byzantine):
    """Gaussian noise updates N(0, σ²I) (simulation only).

    An absolute σ means little across models of different size and training stage, so by default
    σ is relative: std = σ · mean_i ||Δ_i|| / sqrt(d), which gives each malicious update an expected
    norm of about σ times the typical honest norm.
    """

    def craft(self, honest: torch.Tensor, num_malicious: int, ctx: RoundContext) -> Crafted:
        d = honest.shape[1]
        std = float(self.params.sigma)
        if self.params.relative:
            std *= float(torch.linalg.vector_norm(_need_honest(honest, "gaussian"), dim=1).mean()) / math.sqrt(d)
        g = ctx.generator
        noise = torch.randn((num_malicious, d), generator=g, device=g.device, dtype=torch.float32)
        return Crafted((noise * std).to(device=honest.device, dtype=honest.dtype), {"noise_std": std})


class SignFlipParams(AttackParams):
    scale: float = Field(1.0, gt=0, description="k in -k · mean(honest); DETOX's rev_grad uses 100")


@ATTACKS.register("sign_flip", SignFlipParams)
class SignFlip(_Byzantine):
    """Sign flip: every attacker sends -k · mean(honest) (simulation only).

    The textbook attack flips the attacker's own update; the server never computes that, so the
    honest mean stands in for it (all attackers then send the same vector).
    """

    def craft(self, honest: torch.Tensor, num_malicious: int, ctx: RoundContext) -> Crafted:
        mu = _need_honest(honest, "sign_flip").mean(dim=0)
        return Crafted(_repeat(-float(self.params.scale) * mu, num_malicious, honest))


class FactorSearch(Params):
    """Best-effort search of the attack's factor (z, ε) against the configured rule (ByzFL's "optimal" variants).

    Allouah et al. (2023) and the ByzFL library tune ALIE's z and IPM's ε per round by exploring a
    line: the factor whose crafted updates move the rule's aggregate farthest from the honest mean.
    `rule` = the scenario's own aggregation rule (with its parameters, groups and wrappers), run on
    the honest rows plus the candidate malicious rows; defenses around the rule are not simulated.
    """

    evals: int = Field(16, ge=2, description="how many factors are tried (each runs the rule once)")
    start: float = Field(0.0, ge=0, description="first factor tried")
    delta: float = Field(1.0, gt=0, description="first step; doubled while the aggregate keeps moving away, then shrunk")
    ratio: float = Field(0.8, gt=0.5, lt=1.0, description="step contraction per try after the first miss")


def line_maximize(objective: Callable[[float], float], search: FactorSearch) -> tuple[float, float]:
    """argmax of `objective` over factors >= 0 by exploration: expand (double the step while it improves),
    then contract (step back and forth around the best, shrinking the step). Returns (factor, value)."""
    budget, step = search.evals, search.delta
    best_x, best_y = search.start, objective(search.start)
    budget -= 1
    x = best_x
    while budget > 0:  # expansion
        x = best_x + step
        y = objective(x)
        budget -= 1
        if y > best_y:
            best_x, best_y, step = x, y, step * 2
        else:
            step *= search.ratio
            break
    while budget > 0:  # contraction around the best factor seen
        if x < best_x:
            x += step
        else:
            nxt = x - step
            while nxt < 0:  # factors stay non-negative: halve towards the current point
                nxt = (nxt + x) / 2
            x = nxt
        y = objective(x)
        budget -= 1
        if y > best_y:
            best_x, best_y = x, y
        step *= search.ratio
    return best_x, best_y


def _search_factor(honest: torch.Tensor, num_malicious: int, rule: Callable[[torch.Tensor], torch.Tensor] | None,
                   search: FactorSearch | None, fixed: float, crafted: Callable[[float], torch.Tensor],
                   log: dict, name: str) -> float:
    """The fixed factor, or (with `search`) the one whose m copies of `crafted(factor)` push `rule`'s output
    farthest from the honest mean; `log` gets the chosen factor's distance."""
    if search is None:
        return fixed
    if rule is None:
        raise ValueError(f"{name}: search needs the server's rule; it runs only in the round pipeline")
    mu = honest.to(torch.float64).mean(dim=0)

    def moved(factor: float) -> float:
        agg = rule(_repeat(crafted(factor), num_malicious, honest))
        return float(torch.linalg.vector_norm(agg.to(torch.float64) - mu))

    factor, distance = line_maximize(moved, search)
    log["distance_from_honest_mean"] = distance
    return factor


class IPMParams(AttackParams):
    epsilon: float = Field(0.1, gt=0, description="ε in -ε · mean(honest); small (0.1) beats median/Krum, large (100) beats the mean")
    search: FactorSearch | None = Field(
        None, description="tune ε each round against the configured rule (ByzFL's optimal IPM); None = the fixed ε")


@ATTACKS.register("ipm", IPMParams, with_rule=True)
class IPM(_Byzantine):
    """Inner-product manipulation: every attacker sends -ε · mean(honest) (Xie et al. 2019, simulation only).

    With `search`, ε adapts to the rule each round: the paper shows a small ε passes median and
    Krum and a large one breaks the mean; the search finds the rule's own sweet spot."""

    def craft(self, honest: torch.Tensor, num_malicious: int, ctx: RoundContext,
              rule: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Crafted:
        mu = _need_honest(honest, "ipm").mean(dim=0)
        log: dict = {}
        eps = _search_factor(honest, num_malicious, rule, self.params.search, float(self.params.epsilon),
                             lambda e: -e * mu, log, "ipm")
        log["epsilon"] = float(eps)
        return Crafted(_repeat(-eps * mu, num_malicious, honest), log)


# --------------------------------------------------------------------------------------------------


def alie_z_max(n: int, f: int) -> float:
    """ALIE's z_max = Φ⁻¹((n - s) / n) with s = ⌊n/2 + 1⌋ - f (Baruch et al. 2019).

    s is how many honest clients the attackers need on their side for a majority; when f alone
    is already a majority (s <= 0) the formula gives z = ∞, so an explicit z must be set.
    """
    s = math.floor(n / 2 + 1) - f
    if s <= 0:
        raise ValueError(f"alie: f={f} attackers of n={n} already form a majority (s={s}); set z explicitly")
    from scipy.stats import norm  # imported here: scipy.stats costs ~1 s at start-up

    return float(norm.ppf((n - s) / n))


class ALIEParams(AttackParams):
    z: float | None = Field(None, description="deviation in honest stds; None = z_max from n = honest + malicious, f = malicious")
    unbiased: bool = Field(True, description="unbiased std (NDSS'21 code, torch.std) or population std (DETOX, np.std)")
    search: FactorSearch | None = Field(
        None, description="tune z each round against the configured rule (ByzFL's optimal ALIE); None = z or z_max")


@ATTACKS.register("alie", ALIEParams, with_rule=True)
class ALIE(_Byzantine):
    """A little is enough: every attacker sends μ + z·σ per coordinate (Baruch et al. 2019, simulation only).

    μ, σ are the per-coordinate mean and std of the honest updates. Default std is unbiased as in the
    NDSS'21 code; DETOX uses the population std over all received gradients and fixes z = 1.
    z_max is the paper's rule-agnostic choice; with `search`, z is tuned against the configured rule.
    """

    def craft(self, honest: torch.Tensor, num_malicious: int, ctx: RoundContext,
              rule: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Crafted:
        x = _need_honest(honest, "alie")
        mu, sigma = x.mean(dim=0), _std(x, self.params.unbiased)
        log: dict = {}
        fixed = self.params.z
        if fixed is None and self.params.search is None:
            fixed = alie_z_max(x.shape[0] + num_malicious, num_malicious)
        z = _search_factor(honest, num_malicious, rule, self.params.search, fixed if fixed is not None else 0.0,
                           lambda f: mu + f * sigma, log, "alie")
        log["z"] = float(z)
        return Crafted(_repeat(mu + z * sigma, num_malicious, honest), log)


# --------------------------------------------------------------------------------------------------


class AGRAgnosticParams(AttackParams):
    perturbation: Literal["unit_vec", "sign", "std"] = Field(
        "std", description="∇p: -μ/||μ|| (unit_vec), -sign(μ) (sign) or -std (std, the NDSS'21 default)"
    )
    gamma_init: float = Field(10.0, gt=0, description="first γ tried and first search step (NDSS'21: 10)")
    tolerance: float = Field(1e-5, gt=0, description="stop when successive γ differ by at most this")


def perturbation(x: torch.Tensor, kind: str) -> torch.Tensor:
    """∇p for honest rows `x` (float64): the direction that moves m away from the benign mean."""
    mu = x.mean(dim=0)
    if kind == "unit_vec":
        n = torch.linalg.vector_norm(mu)
        return -mu / n if n > 0 else torch.zeros_like(mu)
    if kind == "sign":
        return -torch.sign(mu)
    if kind == "std":
        return -_std(x)
    raise ValueError(f"unknown perturbation {kind!r}")


def halving_search(ok, gamma_init: float, tolerance: float) -> float:
    """Largest γ with ok(γ) by the NDSS'21 halving search (γ ∈ [0, 2·gamma_init)).

    Try γ = γ₀ with step γ₀; after each try move γ up (success, remembered as γ_succ) or down by
    half the step, halve the step, stop once |γ_succ - γ| <= tolerance. When ok(·) holds exactly
    on [0, γ*], the result is within 2·tolerance below γ*.
    """
    gamma, step, succ = float(gamma_init), float(gamma_init), 0.0
    while abs(succ - gamma) > tolerance:
        if ok(gamma):
            succ = gamma
            gamma += step / 2
        else:
            gamma -= step / 2
        step /= 2
    return succ


class _AGRAgnostic(_Byzantine):
    """Shared part of Min-Max / Min-Sum: m = μ + γ·∇p with the largest γ passing `_ok`.

    Distances are computed once from the centred Gram matrix: with Y = Δ - μ,
    ||μ + γp - Δ_i||² = γ²||p||² - 2γ p·Y_i + ||Y_i||², so each γ tried costs O(h).
    """

    @abstractmethod
    def _ok(self, dist_to_m: torch.Tensor, pair_d2: torch.Tensor) -> bool:
        """Whether squared distances `dist_to_m` [h] from m pass the bound set by `pair_d2` [h, h]."""

    def craft(self, honest: torch.Tensor, num_malicious: int, ctx: RoundContext) -> Crafted:
        x = _need_honest(honest, type(self).__name__)
        mu = x.mean(dim=0)
        y = x - mu
        gram = y @ y.T
        sq = gram.diagonal()
        pair_d2 = (sq[:, None] + sq[None, :] - 2.0 * gram).clamp_(min=0.0)
        p = perturbation(x, self.params.perturbation)
        a, b = float(p @ p), y @ p

        def ok(gamma: float) -> bool:
            return self._ok((gamma * gamma * a - 2.0 * gamma * b + sq).clamp(min=0.0), pair_d2)

        gamma = halving_search(ok, self.params.gamma_init, self.params.tolerance)
        return Crafted(_repeat(mu + gamma * p, num_malicious, honest), {"gamma": gamma})


@ATTACKS.register("min_max", AGRAgnosticParams)
class MinMax(_AGRAgnostic):
    """Min-Max (Shejwalkar & Houmansadr, NDSS 2021): the farthest μ + γ∇p that looks like a benign outlier (simulation only).

    Condition on γ: max_i ||m - Δ_i||² <= max_{i,j} ||Δ_i - Δ_j||², i.e. m is no farther from any
    honest update than the two farthest honest updates are from each other.
    """

    def _ok(self, dist_to_m: torch.Tensor, pair_d2: torch.Tensor) -> bool:
        return bool(dist_to_m.max() <= pair_d2.max())


@ATTACKS.register("min_sum", AGRAgnosticParams)
class MinSum(_AGRAgnostic):
    """Min-Sum (Shejwalkar & Houmansadr, NDSS 2021): the farthest μ + γ∇p no more isolated than any benign update (simulation only).

    Condition on γ: Σ_i ||m - Δ_i||² <= min_i Σ_j ||Δ_i - Δ_j||², the NDSS'21 code's *min* over
    honest sums (stricter than a max bound).
    """

    def _ok(self, dist_to_m: torch.Tensor, pair_d2: torch.Tensor) -> bool:
        return bool(dist_to_m.sum() <= pair_d2.sum(dim=1).min())
