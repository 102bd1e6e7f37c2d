"""Random update batches shared by the aggregation-rule tests."""

from __future__ import annotations

import torch


def make_updates(n: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random updates with uneven spreads (so Krum choices and scores are not near-ties) and example counts."""
    gen = torch.Generator().manual_seed(seed)
    spread = 0.5 + 2.0 * torch.rand(n, 1, generator=gen)
    updates = (torch.randn(n, d, generator=gen) * spread + 0.3).float()
    weights = torch.randint(5, 200, (n,), generator=gen).float()
    return updates, weights
