"""Robust learning rate, RLR (Ozdayi, Kantarcioglu, Gel, AAAI 2021): reverse the server's step where updates disagree in sign.

For each coordinate k, the server counts how the round's updates vote on its sign,

    s_k = | Σ_i sgn(Δ_{i,k}) |,

and sets that coordinate's server learning rate to η_k = +η when s_k ≥ θ and to η_k = −η when
s_k < θ. The new global model is G + η ⊙ aggregate. A backdoor needs coordinates that the honest
majority does not push, where the votes are split; there the step is reversed, so the attackers'
contribution is unlearned rather than merely diluted.

Here η = 1: fedsim applies the aggregate to the global model as it is, with no server learning
rate (the official code's `server_lr` is 1 too for every rule but `sign`, see its `federated.py`).
`before` counts the sign votes of the batch it is given (after any earlier defense), unweighted
by example counts as in the code, and remembers the ±η vector for the round; `after` multiplies
the aggregate by it elementwise and reports how many coordinates it reversed (`flipped`,
`flipped_fraction`). The vector is round-local, not checkpoint state. sgn(0) = 0, so a zero
coordinate casts no vote. The official code adds its optional noise to the aggregate before the
±η product; here the order of `after` steps is the order of the scenario's defense list.

θ follows the official code (`src/aggregation.py: compute_robustLR`, `src/runner.sh`). The code
turns RLR on only when `robustLR_threshold > 0` (its argparse default 0 means off); θ = 0 keeps
every coordinate at +η, which is plain FedAvg. The runner uses θ = 4 with 10 agents per round
(Fashion-MNIST, 1 corrupt agent) and θ = 8 with 40 agents (CIFAR-10, 4 corrupt agents) and with
33 (FEMNIST, 1% of 3383 per round). The default here is θ = 4, for the quickstart's 10 clients per
round; scale it with clients_per_round. With θ > n every coordinate is reversed (the log carries a
note): such a round steps away from the clients' average.
"""

from __future__ import annotations

import torch
from pydantic import Field

from fedsim.defenses.base import Defense
from fedsim.registry import DEFENSES, Params
from fedsim.updates import RoundContext, UpdateBatch

_BLOCK_ELEMENTS = 1 << 24  # the sign vote runs over column blocks of about this many entries


class RLRParams(Params):
    threshold: int = Field(
        4, ge=0,
        description="θ: a coordinate keeps +η only if |Σ_i sgn(Δ_i)| ≥ θ, else −η (official runner: 4 for 10 agents/round, "
                    "8 for 40; 0 = FedAvg)",
    )

    def round_problem(self, n: int):
        if self.threshold > n:  # |Σ_i sgn(Δ_i)| <= n < θ everywhere
            return "threshold", f"rlr needs threshold θ <= n updates, got θ={self.threshold}, n={n}: every coordinate would be reversed", \
                self.threshold
        return None


def sign_agreement(updates: torch.Tensor) -> torch.Tensor:
    """[d] int64 |Σ_i sgn(Δ_{i,k})| for the rows of `updates` [n, d], counted in column blocks
    so that no [n, d] sign tensor is materialised at once."""
    n, d = updates.shape
    out = torch.empty(d, dtype=torch.int64, device=updates.device)
    step = max(1, _BLOCK_ELEMENTS // max(n, 1))
    for start in range(0, d, step):
        block = updates[:, start : start + step]
        out[start : start + step] = ((block > 0).sum(dim=0) - (block < 0).sum(dim=0)).abs()
    return out


def robust_lr(updates: torch.Tensor, threshold: int, server_lr: float = 1.0) -> torch.Tensor:
    """[d] per-coordinate learning rate: +server_lr where |Σ_i sgn(Δ_i)| ≥ θ, −server_lr elsewhere."""
    agree = sign_agreement(updates) >= threshold
    lr = torch.full(agree.shape, float(server_lr), dtype=updates.dtype, device=updates.device)
    return torch.where(agree, lr, -lr)


@DEFENSES.register("rlr", RLRParams)
class RobustLearningRate(Defense):
    """RLR: reverse the server step on coordinates whose update signs agree less than θ (Ozdayi et al. 2021)."""

    def __init__(self, params) -> None:
        super().__init__(params)
        self._lr: tuple[int, torch.Tensor] | None = None  # (round, ±1 [d]) set by before(), read by after()

    def before(self, batch: UpdateBatch, ctx: RoundContext) -> tuple[UpdateBatch, dict]:
        n = batch.updates.shape[0]
        self._lr = (ctx.round, robust_lr(batch.updates, int(self.params.threshold)))
        log: dict = {}
        if self.params.threshold > n:
            log["note"] = f"threshold {self.params.threshold} > {n} updates: every coordinate is reversed"
        return batch, log

    def after(self, aggregate: torch.Tensor, ctx: RoundContext) -> tuple[torch.Tensor, dict]:
        if self._lr is None or self._lr[0] != ctx.round:
            raise RuntimeError(f"rlr.after called for round {ctx.round} without before() in that round")
        lr = self._lr[1].to(device=aggregate.device, dtype=aggregate.dtype)
        self._lr = None
        if lr.shape != aggregate.shape:
            raise ValueError(f"rlr: aggregate of shape {tuple(aggregate.shape)} for {tuple(lr.shape)} learning rates")
        flipped = int((lr < 0).sum())
        d = int(lr.numel())
        return aggregate * lr, {"flipped": flipped, "flipped_fraction": flipped / d if d else 0.0}
