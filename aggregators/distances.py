"""Pairwise squared distances between updates, from one Gram-matrix product.

`||a - b||^2 = ||a||^2 + ||b||^2 - 2 a.b` costs one [n, d] x [d, n] product instead of n^2 passes
over d coordinates. The identity cancels badly in float32 when the rows share a large common
component, so the rows are first shifted by the smallest-norm row: distances do not change, the
shared component goes away, and (unlike the mean) one huge malicious row cannot move the shift.
Rows holding NaN or inf come out infinitely far from every other row, so Krum-type rules rank
them last rather than producing NaN scores.
"""

from __future__ import annotations

import torch


def pairwise_sq_distances(updates: torch.Tensor) -> torch.Tensor:
    """[n, n] squared L2 distances between the rows: symmetric, zero diagonal, never negative."""
    inf = float("inf")
    norms = torch.linalg.vector_norm(updates, dim=1)
    centred = updates - updates[int(torch.argmin(torch.where(norms.isnan(), inf, norms)))]
    gram = centred @ centred.T
    sq_norms = gram.diagonal()
    dist = (sq_norms[:, None] + sq_norms[None, :] - 2.0 * gram).clamp_min_(0.0)
    dist = 0.5 * (dist + dist.T)
    dist = torch.where(dist.isnan(), inf, dist)
    dist.fill_diagonal_(0.0)
    return dist
