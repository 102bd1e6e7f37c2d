"""Random update batches, and the references and comparison more than one aggregation-rule test uses."""

from __future__ import annotations

import torch


def make_updates(n: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random updates with uneven spreads (so Krum choices and scores are not near-ties) and example counts."""
    gen = torch.Generator().manual_seed(seed)
    spread = 0.5 + 2.0 * torch.rand(n, 1, generator=gen)
    updates = (torch.randn(n, d, generator=gen) * spread + 0.3).float()
    weights = torch.randint(5, 200, (n,), generator=gen).float()
    return updates, weights


def loop_centered_clip(updates, center, tau, iterations, skip=()):
    """The paper's iteration, one row at a time in float64; rows in `skip` add nothing."""
    rows = [r.double() for r in updates]
    v = center.double().clone()
    for _ in range(iterations):
        step = torch.zeros_like(v)
        for i, row in enumerate(rows):
            if i in skip:
                continue
            diff = row - v
            norm = float(torch.linalg.vector_norm(diff))
            step += diff * min(1.0, tau / norm) if norm > 0 else diff
        v = v + step / len(rows)
    return v


def close(a, b, rtol=1e-5, atol=1e-5):
    torch.testing.assert_close(a.double(), b.double(), rtol=rtol, atol=atol)
