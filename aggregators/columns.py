"""Coordinate-wise reductions applied to blocks of columns.

Sorting or selecting along dim 0 allocates int64 indices the size of the input (3x its float32
memory). Reducing a few million coordinates at a time keeps the peak memory of median, trimmed
mean and Bulyan near the input's own size, whatever the model dimension d.
"""

from __future__ import annotations

from typing import Callable

import torch

BLOCK_ELEMENTS = 1 << 22


def reduce_column_blocks(
    reduce: Callable[[torch.Tensor], torch.Tensor],
    updates: torch.Tensor,
    block_elements: int | None = None,
) -> torch.Tensor:
    """Apply `reduce: [n, b] -> [b]` to column blocks of `updates` [n, d]; returns [d]."""
    n, d = updates.shape
    width = max(1, (block_elements or BLOCK_ELEMENTS) // max(n, 1))
    if width >= d:
        return reduce(updates)
    out = torch.empty(d, dtype=updates.dtype, device=updates.device)
    for start in range(0, d, width):
        out[start : start + width] = reduce(updates[:, start : start + width])
    return out
