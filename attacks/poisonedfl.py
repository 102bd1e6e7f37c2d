"""PoisonedFL (Xie, Fang & Gong, "Model Poisoning Attacks to Federated Learning via Multi-Round
Consistency", CVPR 2025, arXiv:2404.15611), simulation only.

Existing untargeted attacks craft each round on its own, so what they push the global model by in
one round is undone in the next (their effects self-cancel). PoisonedFL keeps the malicious
updates *consistent across rounds*: every fake client, in every round, sends an update whose sign
vector is one fixed random s ∈ {−1, +1}^d, drawn once before the attack starts. It needs no
genuine client's update or data, only the global models the fake clients receive. As the
official code computes it:

    g_i^t = λ_t · v_t ⊙ s,        v_t = k_t / ‖k_t‖,        λ_t = c_t · ‖g^{t−1}‖,
    k_t = | g^{t−1} − (‖g^{t−1}‖ / ‖g_i^{t−1}‖) · g_i^{t−1} |

g^{t−1} = θ_t − θ_{t−1} is the last change of the global model and g_i^{t−1} the malicious update
sent in the last round: subtracting it (rescaled to ‖g^{t−1}‖) leaves an estimate of the genuine
clients' part of the change, whose per-coordinate magnitude shapes v_t. All fake clients send the
same g_i^t.

Dynamic magnitude: every T rounds the attack checks its progress. The global model's change since
the last check, θ_t − θ_{t−T+1} (the model itself where that change is 0), should agree in sign
with s on more coordinates than chance: if fewer than the `confidence` quantile of
Binomial(d, 1/2) agree, the attack did not move the model along s, and c ← β·c (only while β·c
stays at least `min_scale`). c never grows back.

This follows the official code (github.com/xyq7/PoisonedFL, MXNet): `byzantine.py` `poisonedfl`
and its driver `test_agr.py` (`fixed_rand`, `history`, `last_grad`, `last_50_model`, `--sf`):

* s = sign(N(0, I_d)) drawn once (`fixed_rand`); here from the first attack round's seeded
  generator, then kept in the attack's state (a 0 sign, of probability 0, is taken as +1);
* `scale` = c_0 = 8 (`--sf 8` in every script of `scripts/`; the argparse default is 10),
  β = 0.7, `min_scale` = 0.5, T = 50 (`e % 50 == 0`), `confidence` = 0.99 (`k_99`; the code
  hard-codes the 95% and 99% quantiles for its four networks' d, and uses the 99% one: here the
  quantile is `scipy.stats.binom.ppf(confidence, d, 1/2)`, which gives exactly those numbers);
* the ‖·‖ in v_t and in the rescaling of g_i^{t−1} get the code's +1e-9;
* in the attack's first round there is no g^{t−1}: the code's fake clients then send their
  initial zero updates, and so does this; with g_i^{t−1} = 0 the next round's k_t is |g^{t−1}|.

Where fedsim differs, and why:

* the code's fake clients see the global model of every round, even one in which none of them is
  sampled, and check the progress at fixed iterations; here the attack runs when the server
  strikes with it (its attackers sampled this round), as a device would only learn the global
  model when it is sent one. g^{t−1} is then the change since the last attack round divided by
  the rounds it spans (the mean per-round change: with every-round attacks, exactly the code's),
  and the progress check runs in the first attack round at least T rounds after the last one
  (the first "last one": the attack's first round), on θ_t minus the first global model received
  after the last check, as the code's `last_50_model` (so with attacks in every round a window
  spans T − 1 rounds, exactly as in the code);
* the update space is the same as the code's (the change of the model: local − global), so no
  conversion is needed; with BatchNorm models the attack sees the trainable coordinates only, as
  every server-side attack in fedsim, and the running statistics stay what the attackers' clients uploaded;
* the attack runs in the simulated server (like fang/mimic), but reads nothing of the round's
  honest updates besides their number of coordinates: only the global model (`ctx.global_weights`)
  and its own state. The state (s, the last global model, the last malicious update, the check's
  anchor and round, c) is checkpointed with the server, so a resumed run continues exactly.
"""

from __future__ import annotations

import torch
from pydantic import Field

from fedsim.attacks.base import AttackParams, Crafted
from fedsim.attacks.byzantine import _Byzantine
from fedsim.registry import ATTACKS
from fedsim.updates import RoundContext

EPS = 1e-9  # the official code's guard in both norms


class PoisonedFLParams(AttackParams):
    scale: float = Field(
        8.0, gt=0, description="c_0: initial scaling factor, λ_t = c_t·‖g^{t-1}‖ (official scripts: --sf 8; argparse default 10)"
    )
    check_every: int = Field(
        50, ge=1, description="T: rounds between the checks whether the global model moved along s (official: e % 50)"
    )
    decay: float = Field(0.7, gt=0, lt=1, description="β: c ← β·c when a check fails (official: 0.7)")
    min_scale: float = Field(
        0.5, gt=0, description="c is decayed only while β·c stays at least this (official: 0.5)"
    )
    confidence: float = Field(
        0.99, gt=0.5, lt=1,
        description="a check passes when sign(θ_t − θ_{t−T}) agrees with s on at least the confidence quantile of "
        "Binomial(d, 1/2) coordinates (official: k_99)",
    )


def aligned_threshold(d: int, confidence: float) -> int:
    """The `confidence` quantile of Binomial(d, 1/2): how many of d coordinates must agree with s
    before the agreement is more than chance (the official k_95 / k_99 for its networks)."""
    from scipy.stats import binom  # here, not at import: the ClientApp imports every attack, and a device has no scipy

    return int(binom.ppf(confidence, d, 0.5))


def magnitude(history: torch.Tensor, last_malicious: torch.Tensor) -> torch.Tensor:
    """v_t: |g^{t−1} − ‖g^{t−1}‖/(‖g_i^{t−1}‖ + ε) · g_i^{t−1}|, normalised to unit norm (+ε)."""
    k = (history - last_malicious * (torch.linalg.vector_norm(history) / (torch.linalg.vector_norm(last_malicious) + EPS))).abs()
    return k / (torch.linalg.vector_norm(k) + EPS)


def aligned_count(total: torch.Tensor, model: torch.Tensor, s: torch.Tensor) -> int:
    """Coordinates whose sign of the model's change `total` (the model itself where the change is
    0, as the official code) equals s."""
    return int((torch.sign(torch.where(total == 0, model, total)) == s).sum())


@ATTACKS.register("poisonedfl", PoisonedFLParams, stateful=True)
class PoisonedFL(_Byzantine):
    """PoisonedFL (Xie et al. 2025): one fixed random sign vector in every round, magnitude from the last global change (simulation only)."""

    def __init__(self, params) -> None:
        super().__init__(params)
        self.load_state_dict({})

    # --- state across rounds ---------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"s": self.s, "c": self.c, "previous_global": self.previous_global, "previous_round": self.previous_round,
                "last_malicious": self.last_malicious, "anchor": self.anchor, "check_round": self.check_round}

    def load_state_dict(self, state: dict) -> None:
        self.s = state.get("s")  # [d] float32 of ±1, fixed once drawn
        self.c = float(state.get("c", self.params.scale))  # the current scaling factor c_t
        self.previous_global = state.get("previous_global")  # [d] float32 global model of the last attack round
        self.previous_round = state.get("previous_round")
        self.last_malicious = state.get("last_malicious")  # [d] float32: what the fake clients sent last
        self.check_round = state.get("check_round")  # round of the last progress check (first: the first attack round)
        self.anchor = state.get("anchor")  # [d] float32 model the next check measures from; None: take the next one received

    # --- one round -------------------------------------------------------------------------------
    def craft(self, honest: torch.Tensor, num_malicious: int, ctx: RoundContext) -> Crafted:
        """The round's malicious updates from the global model alone (`honest` gives only d, dtype, device)."""
        if honest.ndim != 2:
            raise ValueError(f"poisonedfl expects the honest updates as [h, d], got shape {tuple(honest.shape)}")
        d = honest.shape[1]
        theta = ctx.global_weights.detach().to("cpu", torch.float64).reshape(-1)
        if theta.numel() != d:
            raise ValueError(f"poisonedfl: the global model has {theta.numel()} coordinates, the updates {d}")
        if self.s is not None and self.s.numel() != d:
            raise ValueError(f"poisonedfl: the model has {d} parameters but s was drawn for {self.s.numel()}")
        p, rnd = self.params, int(ctx.round)
        if self.s is None:
            g = ctx.generator
            s = torch.sign(torch.randn(d, generator=g, device=g.device, dtype=torch.float32)).cpu()
            self.s = torch.where(s == 0, torch.ones_like(s), s)
        s = self.s.to(torch.float64)
        if self.previous_global is None:  # no global change seen yet: the official fake clients' zero update
            self._remember(theta, torch.zeros_like(theta), rnd)
            self.check_round = rnd
            return Crafted(honest.new_zeros((num_malicious, d)), {"scale": self.c, "lambda": 0.0, "first": True})

        if self.anchor is None:  # the first model received after the last check (the official last_50_model)
            self.anchor = theta.to(torch.float32)
        span = max(rnd - int(self.previous_round), 1)
        history = (theta - self.previous_global.to(torch.float64)) / span
        v = magnitude(history, self.last_malicious.to(torch.float64))
        log: dict = {"span": span}
        if rnd - int(self.check_round) >= p.check_every:
            aligned = aligned_count(theta - self.anchor.to(torch.float64), theta, s)
            needed = aligned_threshold(d, p.confidence)
            failed = aligned < needed
            if failed and self.c * p.decay >= p.min_scale:
                self.c *= p.decay
            log.update({"aligned": aligned, "aligned_needed": needed, "check_failed": failed})
            self.check_round, self.anchor = rnd, None
        lam = self.c * float(torch.linalg.vector_norm(history))
        malicious = lam * v * s
        self._remember(theta, malicious, rnd)
        log.update({"scale": self.c, "lambda": lam})
        return Crafted(malicious.to(device=honest.device, dtype=honest.dtype)[None, :].expand(num_malicious, -1).clone(), log)

    def _remember(self, theta: torch.Tensor, malicious: torch.Tensor, rnd: int) -> None:
        self.previous_global, self.previous_round = theta.to(torch.float32), rnd
        self.last_malicious = malicious.to(torch.float32)
