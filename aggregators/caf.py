"""CAF, covariance-bound agnostic filter (Allouah, Guerraoui, Stephan, "Towards Trustworthy
Federated Learning with Untrusted Participants", ICML 2025; the reference ByzFL gives).

A filter in the style of robust-statistics spectral filtering that needs no bound on the honest
updates' covariance. Every update carries a weight c_i, all 1 at first; while sum_i c_i > n - 2f:

    mu_c = sum_i c_i x_i / sum_i c_i,      Sigma_c = sum_i c_i (x_i - mu_c)(x_i - mu_c)^T / sum_i c_i,
    (lambda, v) = the largest eigenvalue of Sigma_c and its unit eigenvector,
    tau_i = ((x_i - mu_c)^T v)^2,           c_i <- c_i (1 - tau_i / max_j tau_j),

and the output is the mu_c of the smallest lambda met (the first, on equal values).

Which rows max_j tau_j runs over is the one point where the statement leaves room, and it
matters (`tau_max`):

- `weighted` (default): the rows still weighted (c_j > 0), as in the soft filter this algorithm
  descends from (Diakonikolas et al.; Steinhardt's notes): every step zeroes the weighted row of
  largest tau, so the loop ends within n steps whatever the updates.
- `all`: every row, those already at weight 0 included, as ByzFL's code (and the formula on its
  documentation page) has it. Once a far update is out, its tau stays the maximum and the others
  shrink by (1 - tau_i / max tau) a step, so the step count grows with the outlier's distance
  (a row 100 times the honest spread takes about 10^4-10^6 steps; a row of 1e30 never
  ends in float64 arithmetic: an attacker could stall the server). Here it stops after
  MAX_STEPS_ALL steps with an AggregationError (the round is skipped).

The paper's own text was not at hand to settle it; `weighted` is chosen because it is the filter
whose step count does not depend on what an attacker sends, and the two agree step by step
until the largest tau belongs to a row already at weight 0. It needs n > 2f
(ByzFL refuses 2f >= n too). With f = 0 the loop condition sum c > n never holds and the output
is the plain mean (ByzFL returns None there: its best mu_c is only set inside the loop).

The eigenpair is exact: Sigma_c's non-zero eigenvalues are those of the [n, n] matrix
D K D / sum c (D = diag(sqrt(c)), K the Gram matrix of the centred rows, itself obtained from one
float64 Gram product of the updates per round, not per step), and the projections (x_i - mu_c)^T v
are K D u / sqrt(lambda sum c) for u the [n] eigenvector. So a step costs O(n^3) after one O(n^2 d) product
per round, and no d x d matrix is formed.

Where ByzFL (0.0.11, `byzfl.CAF`) differs: it runs one power-method step from an unseeded random
vector, so its lambda is ||Sigma_c v0|| for a random unit v0 and its "eigenvector" the normalised
Sigma_c v0; both are exact only when d = 1. In higher dimension its weights follow a random
direction and its output changes from call to call. This module follows the paper (the top
eigenpair); tests/test_aggregators_byzfl.py checks equal outputs with d = 1 and tau_max=all
(on far outliers, where that variant runs past its cap, that it is refused and the default
zeroes them). In d > 1 no far-outlier case gave ByzFL the same output under every seed.

Conventions where the paper says nothing: unweighted (c starts at 1 whatever the example
counts); a row holding NaN or inf starts at weight 0 (its tau would be infinite, so the first
step would zero it anyway); if that leaves the loop nothing to do, the output is the mean of the
finite rows; if Sigma_c is zero (all weighted rows equal) the current mu_c is returned (every
tau is 0, and tau / max tau is undefined).
"""

from __future__ import annotations

import math

import torch
from typing import Literal

from pydantic import Field

from fedsim.aggregators.base import AggregationError, check_inputs
from fedsim.aggregators.subsets import check_majority, majority_problem
from fedsim.registry import AGGREGATORS, Params

MAX_STEPS_ALL = 20_000  # tau_max: all (ByzFL's) stops here, see the module's doc


def caf_weights(updates: torch.Tensor, num_malicious: int, tau_max: str = "weighted") -> torch.Tensor:
    """[n] float64 weights c of the output mu_c (zero for the rows filtered out)."""
    n = updates.shape[0]
    check_majority("caf", n, num_malicious)
    x = updates.double()
    finite = torch.isfinite(x).all(dim=1)
    if not bool(finite.any()):
        raise AggregationError("caf: every update holds NaN or inf")
    x = torch.where(finite[:, None], x, torch.zeros_like(x))
    # Shift by the finite rows' coordinate-wise median: the filter is shift-free, and the honest
    # rows' Gram block stays exact in float64 however far an outlier is (a mean shift would carry
    # the outlier into every row and cancel their differences away).
    x = x - x[finite].median(dim=0).values
    x = torch.where(finite[:, None], x, torch.zeros_like(x))
    gram = x @ x.T
    c = finite.double()
    best_c, best_lam = c.clone(), math.inf
    steps = n + 1 if tau_max == "weighted" else MAX_STEPS_ALL
    for _ in range(steps):
        total = float(c.sum())
        if total <= n - 2 * num_malicious:
            break
        a = c / total  # mu_c = a^T x
        proj_mu = gram @ a  # x_i . mu_c
        centred = gram - proj_mu[:, None] - proj_mu[None, :] + a @ proj_mu  # (x_i - mu)(x_j - mu)
        s = c.sqrt()
        lams, vecs = torch.linalg.eigh(s[:, None] * centred * s[None, :] / total)
        lam = float(lams[-1])
        if lam < best_lam:
            best_lam, best_c = lam, c.clone()
        if lam <= 0.0:
            break
        tau = (centred @ (s * vecs[:, -1])) ** 2 / (lam * total)
        top = tau.max() if tau_max == "all" else tau[c > 0].max()
        c = c * (1.0 - tau / top).clamp_min(0.0)
    else:
        if float(c.sum()) > n - 2 * num_malicious:
            raise AggregationError(f"caf with tau_max=all did not bring the weights to n - 2f in {steps} steps "
                                   f"(n={n}, f={num_malicious}): an update far from the others stalls it; use tau_max=weighted")
    return best_c


class CAFParams(Params):
    num_malicious: int = Field(1, ge=0, description="f: filters until the weights sum to n - 2f; needs n > 2f")
    tau_max: Literal["weighted", "all"] = Field(
        "weighted", description="max tau over the rows still weighted (ends within n steps) or over all rows (ByzFL's code)")

    def round_problem(self, n: int):
        return majority_problem("caf", n, self.num_malicious)


def caf_with_info(updates: torch.Tensor, weights: torch.Tensor, num_malicious: int = 1,
                  tau_max: str = "weighted") -> tuple[torch.Tensor, dict]:
    """CAF's output and its weights by row (for the round log)."""
    check_inputs(updates, weights)
    c = caf_weights(updates, num_malicious, tau_max)
    kept = c > 0
    share = c / c.sum()
    out = (share[kept] @ updates[kept].double()).to(updates.dtype)
    return out, {"per_row": {"weight": share.tolist()}, "selected": torch.nonzero(kept).flatten().tolist()}


@AGGREGATORS.register("caf", CAFParams, with_info=caf_with_info)
def caf(updates: torch.Tensor, weights: torch.Tensor, num_malicious: int = 1, tau_max: str = "weighted") -> torch.Tensor:
    """Covariance-bound agnostic filter: spectral down-weighting of outliers (Allouah et al. 2025)."""
    return caf_with_info(updates, weights, num_malicious, tau_max)[0]
