"""FLTrust (Cao, Fang, Liu, Gong, NDSS 2021): trust bootstrapped from a small dataset the server holds.

Each round the server trains the current global model on its root dataset exactly as a client
trains (same local epochs, batch size, learning rate) and gets its own update g0. A client update
g_i earns the trust score TS_i = ReLU(cos(g_i, g0)); its magnitude is normalised to g0's,
ḡ_i = (‖g0‖ / ‖g_i‖) g_i; the aggregate is Σ TS_i ḡ_i / Σ TS_i. An update pointing away from the
server's (cos ≤ 0) gets weight 0, and scaling an update up buys nothing. Example counts are not
used (the paper weights by trust only). A round in which every score is 0 is skipped (the paper
leaves Σ TS_i = 0 undefined; the global model then stays as it is).

The root dataset: `root_size` examples (the paper: 100) drawn uniformly once per scenario and seed
from the training split (`root_source: train`, as in the paper's experiments, which sample the
clients' clean training data) or from the test split (`test`: a held-out sample; the central
evaluation then leaves those examples out). The paper's biased root datasets (a class share
`bias`) are not implemented. FLTrust is a top-level rule only (`top_level_only`): nested inside
DETOX or a mixing wrapper its root dataset would judge group winners or bucket means, which the
paper does not define, so such a scenario is refused at validation.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from fedsim.aggregators.base import AggregationError, check_inputs
from fedsim.registry import AGGREGATORS, Params
from fedsim.updates import RoundContext


def fltrust(updates: torch.Tensor, server_update: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(aggregate, trust scores [n]) for `updates` [n, d] against the server's update [d]."""
    g0_norm = torch.linalg.vector_norm(server_update)
    if not torch.isfinite(g0_norm) or g0_norm == 0:
        raise AggregationError("fltrust: the server's own update is zero or not finite; no direction to trust")
    norms = torch.linalg.vector_norm(updates, dim=1)
    safe = torch.where(norms > 0, norms, torch.ones_like(norms))
    cos = (updates @ server_update) / (safe * g0_norm)
    trust = torch.relu(torch.where(norms > 0, cos, torch.zeros_like(cos)))
    total = trust.sum()
    if total <= 0:
        raise AggregationError("fltrust: every client update points away from the server's (all trust scores are 0)")
    scaled = (trust * g0_norm / safe) / total  # per row: TS_i · ‖g0‖/‖g_i‖ / Σ TS
    return scaled.to(updates.dtype) @ updates, trust


class FLTrustParams(Params):
    root_size: int = Field(100, ge=1, le=100_000, description="examples in the server's root dataset (paper: 100)")
    root_source: Literal["train", "test"] = Field(
        "train", description="draw the root dataset from the training split (paper) or the test split (held out from evaluation)")


def fltrust_with_info(updates: torch.Tensor, weights: torch.Tensor, root_size: int = 100,
                      root_source: str = "train", ctx: RoundContext | None = None) -> tuple[torch.Tensor, dict]:
    """FLTrust with the server's update computed on its root dataset; reports each client's trust."""
    check_inputs(updates, weights)
    if ctx is None or ctx.tools is None:
        raise AggregationError("fltrust needs the server's tools (its root dataset), which this call does not have")
    x, y = ctx.tools.server_data(root_size, root_source)
    server_update = ctx.tools.train_update(ctx.global_weights, ctx.layout, x, y, ctx.round)
    aggregate, trust = fltrust(updates, server_update.to(updates.dtype))
    info = {
        "selected": [i for i, t in enumerate(trust.tolist()) if t > 0],
        "per_row": {"trust": trust.tolist(), "weight": (trust / trust.sum()).tolist()},
        "server_update_norm": float(torch.linalg.vector_norm(server_update)),
    }
    return aggregate, info


@AGGREGATORS.register("fltrust", FLTrustParams, with_context=True, with_info=fltrust_with_info, top_level_only=True)
def fltrust_rule(updates: torch.Tensor, weights: torch.Tensor, **params) -> torch.Tensor:
    """FLTrust: ReLU-cosine trust to the server's own update on a root dataset, magnitudes normalised (Cao et al. 2021)."""
    return fltrust_with_info(updates, weights, **params)[0]
