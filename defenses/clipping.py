"""Norm-difference clipping and weak differential privacy (Sun et al. 2019, as run in OOD_FL).

Each update is scaled to Δ_i / max(1, ||Δ_i|| / δ), so no single client can move the model by more
than δ; weak DP then adds N(0, σ²) to every coordinate of the aggregate. Adding the noise to the
aggregate is the same as adding it to the new global model, since global_new = global + aggregate.

Default δ = 3.0 is OOD_FL's argparse default; its README runs δ = 2 (CIFAR-10) and δ = 1.5
(EMNIST). Default σ = 0.025 is the README value (the argparse default is 0.158).
"""

from __future__ import annotations

import torch
from pydantic import Field

from fedsim.defenses.base import Defense
from fedsim.registry import DEFENSES, Params
from fedsim.updates import RoundContext, UpdateBatch


def clip_rows(updates: torch.Tensor, delta: float | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows scaled to L2 norm at most `delta`: (clipped, norms before, factor applied per row).

    The factor is min(1, δ/||Δ_i||), i.e. 1 / max(1, ||Δ_i||/δ); zero rows keep factor 1.
    """
    norms = torch.linalg.vector_norm(updates, dim=1)
    delta_t = torch.as_tensor(delta, dtype=norms.dtype, device=norms.device)
    over = norms > delta_t
    factor = torch.where(over, delta_t / torch.where(over, norms, torch.ones_like(norms)), torch.ones_like(norms))
    return updates * factor.to(updates.dtype)[:, None], norms, factor


def clip_log(client_ids: tuple[int, ...], norms: torch.Tensor, factor: torch.Tensor) -> dict:
    """`norms` for every client and `clipped` for those actually scaled, as JSON-ready numbers."""
    norms_l, factor_l = norms.tolist(), factor.tolist()
    return {
        "norms": {int(c): float(v) for c, v in zip(client_ids, norms_l)},
        "clipped": {int(c): float(f) for c, f in zip(client_ids, factor_l) if f < 1.0},
    }


def gaussian_like(vec: torch.Tensor, std: float, generator: torch.Generator) -> torch.Tensor:
    """i.i.d. N(0, std²) noise shaped like `vec`, drawn from `generator` (on the generator's device)."""
    noise = torch.randn(vec.shape, generator=generator, device=generator.device, dtype=torch.float32)
    return (noise * std).to(device=vec.device, dtype=vec.dtype)


class NormClippingParams(Params):
    delta: float = Field(3.0, gt=0, description="L2 bound δ on each update (OOD_FL argparse default; README: 2 CIFAR, 1.5 EMNIST)")
    adaptive: bool = Field(False, description="use δ = mean of this round's update norms instead (OOD_FL's experimental variant)")

    def round_problem(self, n: int):
        if self.adaptive and n < 2:  # δ = the one update's own norm
            return "adaptive", f"adaptive norm_clipping needs at least 2 updates, got n={n}: nothing would ever be clipped", True
        return None


@DEFENSES.register("norm_clipping", NormClippingParams,
                   secure_alternative="secure_aggregation.clip_norm: clients clip before masking")
class NormClipping(Defense):
    """Norm-difference clipping: scale each update to L2 norm at most δ (Sun et al. 2019)."""

    def before(self, batch: UpdateBatch, ctx: RoundContext) -> tuple[UpdateBatch, dict]:
        delta: float | torch.Tensor = self.params.delta
        if self.params.adaptive:
            delta = torch.linalg.vector_norm(batch.updates, dim=1).mean()
        clipped, norms, factor = clip_rows(batch.updates, delta)
        log = clip_log(batch.client_ids, norms, factor)
        if self.params.adaptive:
            log["delta"] = float(delta)
        return batch.with_updates(clipped), log


class WeakDPParams(Params):
    delta: float = Field(3.0, gt=0, description="L2 bound δ on each update before aggregation")
    sigma: float = Field(0.025, ge=0, description="std of the Gaussian noise added to every coordinate of the aggregate (OOD_FL README)")


@DEFENSES.register("weak_dp", WeakDPParams)
class WeakDP(Defense):
    """Weak DP: norm clipping to δ, then N(0, σ²) noise on every coordinate of the aggregate (Sun et al. 2019)."""

    def before(self, batch: UpdateBatch, ctx: RoundContext) -> tuple[UpdateBatch, dict]:
        clipped, norms, factor = clip_rows(batch.updates, self.params.delta)
        return batch.with_updates(clipped), clip_log(batch.client_ids, norms, factor)

    def after(self, aggregate: torch.Tensor, ctx: RoundContext) -> tuple[torch.Tensor, dict]:
        sigma = float(self.params.sigma)
        return aggregate + gaussian_like(aggregate, sigma, ctx.generator), {"noise_std": sigma}
