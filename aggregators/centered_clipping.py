"""Centered clipping (Karimireddy, He, Jaggi, "Learning from History for Byzantine Robust
Optimization", ICML 2021).

Starting from a center v_0, each of L iterations moves the center by the average of the updates'
differences to it, each difference clipped to norm at most tau:

    v_{l+1} = v_l + (1/n) sum_i clip_tau(Delta_i - v_l),    clip_tau(x) = min(1, tau / ||x||) x

and the rule returns v_L. One update, however large, moves each iteration by at most tau / n; an
update within tau of the center counts in full, so with a huge tau and L = 1 the rule is the plain
mean. The paper's code keeps its last output as the next call's center; here:

- `center: previous` (default, the paper): v_0 is the update the server applied last round
  (`RoundContext.previous_aggregate`, so the rule is registered `with_context=True`); zeros in the
  first round, after a round-skipping stretch at the start, and in a direct call without a context.
  It is the rule's own last output unless a defense's `after` step changed the aggregate (then it
  is what was applied). A skipped round keeps the center of the last aggregated one.
- `center: zero`: v_0 = 0 every round (clipping around the origin, then re-centered L - 1 times).

Defaults: L = 1 (`iterations`) is the paper's choice and that of the official code's momentum
experiments (`epfml/byzantine-robust-optimizer`, `Clipping(tau=100, n_iter=1)`); tau = 10 is the
official code's `--clip-tau` default in the follow-up bucketing paper's code
(`epfml/byzantine-robust-noniid-optimizer`, which runs n_iter = 3 and divides tau by 1 - beta when
workers use momentum beta) and the middle of the paper's CIFAR-10 grid (0.1, 10, 1000); Blades uses
tau = 10 with 5 iterations. tau is a norm in the units of the uploaded update (a model delta after
local training here, a momentum of gradients in the paper), so it has to be tuned to the task: it
should sit above the honest updates' spread around the center.

Worker momentum: the paper's workers send m_i = (1 - beta) g_i + beta m_i (momentum over all
their steps) and its analysis needs it against time-coupled attacks. The nearest thing in
fedsim is the clients' local SGD momentum, `federation.momentum`; it runs inside each round's
local training with a fresh buffer every round, so an upload is a multi-step local update rather
than a momentum carried across rounds. The rule applies the paper's clipping to whatever the
clients send and does not add momentum of its own; the history it keeps is the center.

Unweighted, as in the paper: every update counts 1/n whatever its example count (like median and
trimmed mean; a weight would let a client that claims a large dataset move the center further).
An update with NaN or inf entries (or whose difference to the center overflows float32) adds
nothing: it leaves the center where it is, which is the limit of clipping a vector of unbounded
norm in no defined direction. A huge finite update is clipped exactly (see `centered_clip`).
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from fedsim.aggregators.base import check_inputs
from fedsim.registry import AGGREGATORS, Params
from fedsim.updates import RoundContext

DEFAULT_TAU = 10.0  # official code's --clip-tau default (see the module's doc)


def centered_clip(updates: torch.Tensor, center: torch.Tensor, tau: float, iterations: int) -> torch.Tensor:
    """[d] v_L of the iteration above from v_0 = `center`, for `updates` [n, d].

    Each difference is written as peak * u with peak its largest |entry| and u its direction
    scaled to max |u| = 1; the clipped difference is then min(peak, tau / ||u||) * u. Unlike
    min(1, tau / ||x||) * x this neither overflows float32 on a huge update (whose norm does
    not fit in float32) nor underflows the factor of a huge update to a subnormal number.
    """
    n = updates.shape[0]
    v = center.to(device=updates.device, dtype=updates.dtype).clone()
    for _ in range(iterations):
        diff = updates - v
        peak = diff.abs().amax(dim=1)  # NaN or inf for a row holding NaN or inf, or whose difference overflows
        usable = torch.isfinite(peak)
        diff.div_(torch.where(usable & (peak > 0), peak, torch.ones_like(peak))[:, None])
        diff = torch.where(usable[:, None], diff, torch.zeros_like(diff))  # 0 * inf would be NaN in the product
        unit_norms = torch.linalg.vector_norm(diff, dim=1).double()  # in [1, sqrt(d)], or 0 for a zero difference
        coeff = torch.minimum(peak.double(), tau / unit_norms)  # tau / 0 = inf: a zero difference stays 0
        coeff = torch.where(usable, coeff, torch.zeros_like(coeff))
        v = v + (coeff / n).to(updates.dtype) @ diff
    return v


def starting_center(updates: torch.Tensor, center: str, ctx: RoundContext | None) -> torch.Tensor:
    """v_0: last round's applied update for `previous` (zeros when there is none), zeros for `zero`."""
    d = updates.shape[1]
    previous = ctx.previous_aggregate if ctx is not None else None
    if center == "zero" or previous is None:
        return torch.zeros(d, dtype=updates.dtype, device=updates.device)
    if tuple(previous.shape) != (d,):  # a caller bug (the strategy resets it when the model changes shape)
        raise ValueError(f"centered_clipping: previous aggregate has shape {tuple(previous.shape)}, updates have d={d}")
    return previous


class CenteredClippingParams(Params):
    tau: float = Field(DEFAULT_TAU, gt=0.0, description="clipping radius around the center, in update-norm units (official code: 10)")
    iterations: int = Field(1, ge=1, description="L, clipping iterations (paper: 1)")
    center: Literal["previous", "zero"] = Field(
        "previous", description="start from last round's applied update (paper) or from zero")


@AGGREGATORS.register("centered_clipping", CenteredClippingParams, with_context=True)
def centered_clipping(
    updates: torch.Tensor,
    weights: torch.Tensor,
    tau: float = DEFAULT_TAU,
    iterations: int = 1,
    center: str = "previous",
    ctx: RoundContext | None = None,
) -> torch.Tensor:
    """Centered clipping: the center moves by the mean of the updates' clipped differences to it (Karimireddy et al. 2021)."""
    check_inputs(updates, weights)
    return centered_clip(updates, starting_center(updates, center, ctx), tau, iterations)
