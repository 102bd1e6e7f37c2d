"""One round's decoded client updates and the context defenses, attacks and rules may read."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from fedsim.models.layout import ModelLayout


@dataclass(frozen=True)
class UpdateBatch:
    """One round's updates: row i of `updates` came from client `client_ids[i]` with `weights[i]` examples."""

    updates: torch.Tensor  # [n, d] float32
    weights: torch.Tensor  # [n] float32
    client_ids: tuple[int, ...]  # partition ids

    def select(self, keep: torch.Tensor) -> "UpdateBatch":
        """Rows where the boolean mask `keep` is true."""
        idx = torch.nonzero(keep, as_tuple=False).flatten()
        return UpdateBatch(self.updates[idx], self.weights[idx], tuple(self.client_ids[i] for i in idx.tolist()))

    def with_updates(self, updates: torch.Tensor) -> "UpdateBatch":
        return replace(self, updates=updates)

    def with_weights(self, weights: torch.Tensor) -> "UpdateBatch":
        return replace(self, weights=weights)


@dataclass(frozen=True)
class RoundContext:
    """What a defense may know about the round besides the updates."""

    round: int
    global_weights: torch.Tensor  # [d] flat global model the updates are relative to
    layout: ModelLayout
    generator: torch.Generator  # seeded from (scenario seed, round): use it for all randomness
    previous_aggregate: torch.Tensor | None = None  # [d] last round's aggregate after the defenses, before a server optimizer (None at first)
    tools: Any = None  # fedsim/server/tools.py ServerTools: the server's own data and training (None on bare tensors)
