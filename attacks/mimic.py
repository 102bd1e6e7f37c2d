"""The mimic attack of Karimireddy, He & Jaggi, "Byzantine-Robust Learning on Heterogeneous
Datasets via Bucketing" (ICLR 2022), simulation only.

On heterogeneous data a robust rule can be pushed off course without sending anything abnormal:
every attacker sends a copy of one honest client's update, so the rule over-weights that client
and under-weights the rest. The client is chosen to be extreme along z, the direction of largest
variance of the honest updates, estimated online during a warm-up. This follows the official code
(github.com/epfml/byzantine-robust-noniid-optimizer, `codes/attacks/mimic.py`,
`MimicVariantAttacker`), counting its iterations as the rounds in which the attack runs:

* first attack round: μ = honest mean, z₀ ~ N(0, I) (the official code seeds it with 0, here the
  round's generator), z = Σ_i ⟨x_i − μ, z₀⟩ (x_i − μ), normalised: one power-iteration step on the
  honest covariance;
* later warm-up rounds t = 1 .. warmup − 1: μ ← t/(t+1)·μ + mean/(t+1); the same step from z gives
  u, and z ← t/(t+1)·z + u/‖u‖/(t+1), normalised (an online power iteration);
* every warm-up round: the target is argmax_i ⟨x_i, z⟩ (signed, as the official code's default
  `argmax=True`; ByzFL's port takes |⟨x_i, z⟩|), and the attackers copy it;
* after the warm-up, z stays fixed and the attackers keep copying the client chosen in the last
  warm-up round. The official code has every worker in every step; where clients are sampled and
  that client is not among this round's honest ones, the round's argmax_i ⟨x_i, z⟩ stands in for
  this round only (logged as `fallback`).

The warm-up length defaults to the official code's `--mimic-warmup 1`. z, μ, the round counter and
the chosen client are state kept across rounds: the server pipeline saves them in its checkpoint
(`state_dict`) so a resumed run continues exactly.
"""

from __future__ import annotations

import torch
from pydantic import Field

from fedsim.attacks.base import AttackParams, Crafted
from fedsim.attacks.byzantine import _Byzantine, _need_honest
from fedsim.registry import ATTACKS
from fedsim.updates import RoundContext


class MimicParams(AttackParams):
    warmup: int = Field(
        1, ge=1, description="attack rounds spent estimating z (official code: --mimic-warmup, default 1); "
        "the client chosen in the last of them is copied afterwards"
    )


def power_step(x: torch.Tensor, mu: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """Σ_i ⟨x_i − μ, z⟩ (x_i − μ), i.e. the honest scatter matrix times z, without forming it."""
    y = x - mu
    return y.T @ (y @ z)


def _unit(v: torch.Tensor) -> torch.Tensor | None:
    n = torch.linalg.vector_norm(v)
    return v / n if n > 0 and torch.isfinite(n) else None


@ATTACKS.register("mimic", MimicParams, with_client_ids=True, stateful=True)
class Mimic(_Byzantine):
    """Mimic (Karimireddy et al. 2022): every attacker copies the honest update most extreme along the top variance direction (simulation only)."""

    def __init__(self, params) -> None:
        super().__init__(params)
        self.load_state_dict({})

    # --- state across rounds ---------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"t": self.t, "target": self.target, "mu": self.mu, "z": self.z}

    def load_state_dict(self, state: dict) -> None:
        self.t = int(state.get("t", 0))  # attack rounds run so far
        self.target = state.get("target")  # client id chosen in the last warm-up round
        self.mu = state.get("mu")  # [d] running mean of the honest means (float32, as the official code)
        self.z = state.get("z")  # [d] unit direction of largest variance

    # --- one round -------------------------------------------------------------------------------
    def craft(self, honest: torch.Tensor, num_malicious: int, ctx: RoundContext,
              honest_ids: tuple[int, ...] | None = None) -> Crafted:
        """`honest_ids`: the honest rows' client ids (the pipeline passes them); by default the row
        numbers, which name the same clients every round only when all clients take part."""
        x = _need_honest(honest, "mimic")
        h, d = x.shape
        ids = list(range(h)) if honest_ids is None else [int(i) for i in honest_ids]
        if len(ids) != h:
            raise ValueError(f"mimic: {len(ids)} honest ids for {h} honest updates")
        if self.z is not None and self.z.shape[0] != d:
            raise ValueError(f"mimic: the model has {d} parameters but z was estimated on {self.z.shape[0]}")
        fallback = False
        if self.t < self.params.warmup:
            z = self._update_direction(x, ctx)
            row = int(torch.argmax(x @ z))
            self.target = ids[row]
        else:
            z = self.z.to(device=x.device, dtype=torch.float64)
            if self.target in ids:
                row = ids.index(self.target)
            else:
                row, fallback = int(torch.argmax(x @ z)), True
        self.t += 1
        log = {"mimicked": ids[row], "target": self.target, "warmup_left": max(self.params.warmup - self.t, 0),
               "fallback": fallback}
        return Crafted(honest[row].unsqueeze(0).expand(num_malicious, -1).clone(), log)

    def _update_direction(self, x: torch.Tensor, ctx: RoundContext) -> torch.Tensor:
        """One warm-up step of the official code's online estimate of μ and z (float64 here, kept as float32)."""
        mean = x.mean(dim=0)
        t = self.t
        if t == 0:
            mu = mean
            g = ctx.generator
            z0 = torch.randn(x.shape[1], generator=g, device=g.device, dtype=torch.float32).to(x.device, torch.float64)
            step = _unit(power_step(x, mu, z0))
            z = step if step is not None else _unit(z0)
        else:
            mu = self.mu.to(device=x.device, dtype=torch.float64) * (t / (t + 1)) + mean / (t + 1)
            z = self.z.to(device=x.device, dtype=torch.float64)
            step = _unit(power_step(x, mu, z))
            if step is not None:  # no spread among the honest updates: z stays
                z = _unit(z * (t / (t + 1)) + step / (t + 1))
        self.mu, self.z = mu.to(torch.float32).cpu(), z.to(torch.float32).cpu()
        return self.z.to(device=x.device, dtype=torch.float64)
