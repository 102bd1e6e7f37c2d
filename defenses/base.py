"""The defense interface.

A defense sees the round's decoded updates before aggregation (`before`: clip, filter, reweight)
and/or the aggregate after it (`after`: add noise). It returns what it changed as a small dict
that goes to `rounds.jsonl` under `defenses.<name>`: `{"removed": [client ids], "clipped":
{client id: factor}, ...}`. State that the method keeps across rounds (FoolsGold's history) lives
on the instance and is exposed by `state_dict()` / `load_state_dict()` so a run can checkpoint it.
"""

from __future__ import annotations

from typing import Any

import torch

from fedsim.updates import RoundContext, UpdateBatch


class Defense:
    """Base class: identity before and after aggregation, no state."""

    def __init__(self, params) -> None:
        self.params = params

    def before(self, batch: UpdateBatch, ctx: RoundContext) -> tuple[UpdateBatch, dict]:
        return batch, {}

    def after(self, aggregate: torch.Tensor, ctx: RoundContext) -> tuple[torch.Tensor, dict]:
        return aggregate, {}

    def deployed_state(self) -> Any:
        """What this defense's `inference` part (its registry trait) needs to build the deployed model
        after the round just aggregated: a snapshot, since the next round changes the state while the
        evaluation may still run beside it. None: nothing."""
        return None

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if state:
            raise ValueError(f"{type(self).__name__} keeps no state, got keys {sorted(state)}")
