"""Fang et al.'s full-knowledge local model poisoning attacks (USENIX Security 2020), simulation only.

"Local Model Poisoning Attacks to Byzantine-Robust Federated Learning" crafts the c compromised
local *models* against a known rule. fedsim's updates are Δ = w_local − w_global, so the paper's
model-space formulas are written here in update space: the paper's w_Re (the global model the
clients received) is Δ = 0, a crafted model w_Re − λs is the update −λs, and a distance between two
local models, D(w_i, w_l), is ‖Δ_i − Δ_l‖. For Krum this is exact; for the trimmed-mean attack the
paper scales parameter values, and here (as in the FLTrust/FLDetector code by the same group, which
works on gradients) the same rule scales update values.

The direction s is the sign of the honest mean update (s_j = 1 when the j-th parameter would grow
without an attack). The paper takes the before-attack change of the global model under the
attacked rule, i.e. the aggregate the rule would produce; the FLDetector code uses Krum's pick,
the FLTrust code the sign of the sum of all updates, and the NDSS'21 code (Shejwalkar &
Houmansadr) the sign of the mean, as here. The attackers' own honest updates are unknown to the
server, so statistics are over the honest rows only.
"""

from __future__ import annotations

import math

import torch
from pydantic import Field

from fedsim.aggregators.distances import pairwise_sq_distances
from fedsim.aggregators.krum import scores_from_distances
from fedsim.attacks.base import AttackParams, Crafted
from fedsim.attacks.byzantine import _Byzantine, _need_honest
from fedsim.registry import ATTACKS
from fedsim.updates import RoundContext


def _uniform(shape: tuple[int, ...], low: float, high: float, ctx: RoundContext, like: torch.Tensor) -> torch.Tensor:
    """U(low, high) of `shape` from the round's seeded generator, as float64 on `like`'s device."""
    g = ctx.generator
    u = torch.rand(shape, generator=g, device=g.device, dtype=torch.float64).to(like.device)
    return low + (high - low) * u


# ----------------------------------------------------------------------------------------- Krum


class FangKrumParams(AttackParams):
    krum_f: int | None = Field(
        None, ge=0, description="f of the Krum the attack simulates; None = this round's number of attackers c (the paper's c)"
    )
    stop_threshold: float = Field(1e-5, gt=0, description="λ is halved until Krum picks an attacker or λ falls below this (paper: 1e-5)")
    epsilon: float = Field(
        0.01, ge=0, description="the other attackers send the first one's update plus a random offset of norm U(0, ε) "
        "(FLDetector code: 0.01; 0 = exact copies, as FLPoison)"
    )


def fang_lambda_bound(honest_d2: torch.Tensor, honest_norms: torch.Tensor, n: int, c: int, f: int, d: int) -> float:
    """The paper's upper bound on λ, in update space (their Eq. for the full-knowledge Krum attack):

        λ ≤ 1/((m − 2c − 1)·√d) · min_i Σ_{l ∈ Γ_i} D(w_l, w_i) + 1/√d · max_i D(w_i, w_Re),

    i over the benign models, Γ_i the m − c − 2 benign models nearest to w_i, m = n the round's
    updates, D Euclidean (not squared). m − c − 2 is Krum's neighbour count n − f − 2 and m − 2c − 1
    its benign part once the c − 1 other attackers sit next to w'_1; with Krum's f ≠ c they are
    written with f (equal to the paper's when f = c). When the attackers alone fill w'_1's
    neighbourhood (no benign neighbour left) the first term is dropped.
    """
    h = honest_d2.shape[0]
    k = min(n - f - 2, h - 1)
    dist = honest_d2.clamp_min(0.0).sqrt()
    term = 0.0
    benign_neighbours = n - f - 2 - (c - 1)
    if k >= 1 and benign_neighbours >= 1:
        others = dist.clone()
        others.fill_diagonal_(float("inf"))
        nearest = others.topk(k, dim=1, largest=False).values.sum(dim=1)
        term = float(nearest.min()) / (benign_neighbours * math.sqrt(d))
    return term + float(honest_norms.max()) / math.sqrt(d)


class _KrumRound:
    """Krum's squared distances on [honest; −λs + e_k] for any λ in O(n²): the honest Gram part, the
    honest–offset products and the offsets' own distances do not depend on λ."""

    def __init__(self, x: torch.Tensor, s: torch.Tensor, offsets: torch.Tensor) -> None:
        self.h, self.c = x.shape[0], offsets.shape[0]
        self.hh = pairwise_sq_distances(x)
        self.x_sq = (x * x).sum(dim=1)  # ‖x_i‖²
        self.x_s = x @ s  # x_i · s
        self.x_e = x @ offsets.T  # [h, c] x_i · e_k
        self.s_s = float(s @ s)
        self.s_e = offsets @ s  # [c]
        self.e_sq = (offsets * offsets).sum(dim=1)
        self.mm = pairwise_sq_distances(offsets)

    def sq_distances(self, lam: float) -> torch.Tensor:
        m_sq = lam * lam * self.s_s - 2.0 * lam * self.s_e + self.e_sq  # ‖−λs + e_k‖²
        x_m = -lam * self.x_s[:, None] + self.x_e  # x_i · m_k
        hm = (self.x_sq[:, None] + m_sq[None, :] - 2.0 * x_m).clamp_min(0.0)
        top = torch.cat([self.hh, hm], dim=1)
        bottom = torch.cat([hm.T, self.mm], dim=1)
        return torch.cat([top, bottom], dim=0)


@ATTACKS.register("fang_krum", FangKrumParams)
class FangKrum(_Byzantine):
    """Fang et al.'s full-knowledge attack on Krum: −λ·sign(μ), λ halved until Krum picks it (simulation only).

    Follows the paper: w'_1 = w_Re − λs with λ starting at the paper's upper bound
    (`fang_lambda_bound`) and halved until Krum, run on the honest updates plus the crafted ones
    with f = `krum_f` (default: the c attackers of the round, the paper's setting), selects one of
    the crafted updates, or until λ < `stop_threshold` (then the last λ is sent, as the paper's
    loop and the peer codes do). The other c − 1 attackers send w'_1 plus a random offset of norm
    U(0, ε) in a uniformly random direction, the FLDetector code's ε-perturbed copies; the paper
    only asks that they lie within ε of w'_1, FLPoison sends exact copies. The offsets are drawn
    once per round, before the search, so the Krum check sees exactly the vectors that are sent
    (FLDetector checks exact copies, then perturbs). Krum scoring is fedsim's
    (`aggregators/krum.py`); a round with too few updates for Krum (n < 2f + 3) cannot be checked
    and is treated as one where Krum never picks an attacker. Peer codes start λ elsewhere:
    FLDetector at 0.25 in gradient units, FLPoison at 1.0, the NDSS'21 code at the bound.
    """

    def craft(self, honest: torch.Tensor, num_malicious: int, ctx: RoundContext) -> Crafted:
        x = _need_honest(honest, "fang_krum")
        h, d = x.shape
        c = num_malicious
        if c == 0:
            return Crafted(honest.new_zeros((0, d)))
        n = h + c
        f = c if self.params.krum_f is None else self.params.krum_f
        s = torch.sign(x.mean(dim=0))
        direction = _uniform((c, d), -0.5, 0.5, ctx, x)  # FLDetector: U(-0.5, 0.5)^d, normalised
        radius = _uniform((c, 1), 0.0, float(self.params.epsilon), ctx, x)
        norms = torch.linalg.vector_norm(direction, dim=1, keepdim=True).clamp_min(1e-300)
        offsets = direction / norms * radius
        offsets[0] = 0.0  # w'_1 itself

        krum_round = _KrumRound(x, s, offsets)
        lam = fang_lambda_bound(krum_round.hh, torch.linalg.vector_norm(x, dim=1), n, c, f, d)
        can_score = n >= 2 * f + 3
        selected, tried = False, 0
        while True:
            tried += 1
            if can_score:
                scores = scores_from_distances(krum_round.sq_distances(lam), n - f - 2)
                selected = int(torch.argmin(scores)) >= h
            if selected or lam < self.params.stop_threshold:
                break
            lam /= 2.0
        log = {"lambda": lam, "selected": selected, "halvings": tried - 1}
        return Crafted((-lam * s[None, :] + offsets).to(honest.dtype), log)


# ---------------------------------------------------------------------------------- trimmed mean


class FangTrimParams(AttackParams):
    b: float = Field(2.0, ge=1.0, description="how far past the honest extreme the values go: up to b times it (paper and FLTrust code: 2)")


@ATTACKS.register("fang_trim", FangTrimParams)
class FangTrim(_Byzantine):
    """Fang et al.'s full-knowledge attack on trimmed mean and median: values past the honest extreme opposite the honest direction (simulation only).

    Per coordinate j, with s_j the sign of the honest mean and Δ_max,j / Δ_min,j the largest and
    smallest honest values, every attacker draws its own value (paper, in update space):

    * s_j > 0 (the parameter would grow): in [Δ_min/b, Δ_min] when Δ_min > 0, [b·Δ_min, Δ_min] otherwise;
    * s_j < 0: in [Δ_max, b·Δ_max] when Δ_max > 0, [Δ_max/b, Δ_max] otherwise,

    so every value lies beyond the honest range on the side opposite to s_j. The draw follows the
    FLTrust code (Cao, Fang et al.): the extreme times r, or divided by r, with r ~ U(1, b) per
    attacker and coordinate from the round's seeded generator (the paper only says "randomly
    sample" in the interval). Where s_j = 0 the FLTrust code sends 0, and so does this.
    """

    def craft(self, honest: torch.Tensor, num_malicious: int, ctx: RoundContext) -> Crafted:
        x = _need_honest(honest, "fang_trim")
        d = x.shape[1]
        s = torch.sign(x.mean(dim=0))
        extreme = torch.where(s > 0, x.min(dim=0).values, torch.where(s < 0, x.max(dim=0).values, torch.zeros_like(s)))
        r = _uniform((num_malicious, d), 1.0, float(self.params.b), ctx, x)
        # same sign as the direction: shrink towards 0 (divide by r); opposite sign: grow away from 0 (times r)
        shrink = (s * extreme > 0)[None, :]
        out = torch.where(shrink, extreme[None, :] / r, extreme[None, :] * r)
        return Crafted(out.to(honest.dtype))
