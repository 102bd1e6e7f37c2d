"""When and how the server moves the global model to low-rank factorized layers.

Pufferfish switches after a fixed number of full-rank warm-up rounds at rank ratio·full;
Cuttlefish tracks every layer's stable rank each round and switches once the curves are flat.
The switch factorizes the global model by truncated SVD; the ranks then travel in every message
so clients build the same architecture. The state (ranks, tracker history) is checkpointed.
"""

from __future__ import annotations

import json
import logging

import torch

from fedsim.models.layout import ModelLayout
from fedsim.lowrank.layers import CuttlefishTracker, factorizable_layers, factorize, rank_for_ratio

log = logging.getLogger("fedsim")


class LowRankSwitch:
    def __init__(self, runtime, spec) -> None:
        self.rt, self.spec = runtime, spec
        self.ranks: dict[str, int] | None = None
        self.tracker: CuttlefishTracker | None = None

    def layout(self) -> ModelLayout:
        return self.rt.layout_for(self.ranks)

    def model(self, vec: torch.Tensor) -> torch.nn.Module:
        model = self.rt.build_model(self.ranks)
        self.layout().load_into(model, vec)
        return model

    def start(self, vec: torch.Tensor) -> torch.Tensor:
        """Before round 1: the scheme's own start (Cuttlefish's history; Pufferfish without warm-up factorizes now)."""
        if self.spec is None:
            return vec
        return self.spec.start(self, vec)

    def pufferfish_ranks(self, vec: torch.Tensor) -> dict[str, int]:
        model = self.model(vec)
        modules = dict(model.named_modules())
        names = factorizable_layers(model, skip_first=self.spec.skip_first, skip_last=self.spec.skip_last)
        return {n: rank_for_ratio(modules[n], self.spec.rank_ratio) for n in names}

    def switch(self, vec: torch.Tensor, ranks: dict[str, int]) -> tuple[torch.Tensor, dict]:
        before = self.layout().dim
        factorized = factorize(self.model(vec), ranks)
        self.ranks = dict(ranks)
        new_vec = self.layout().flatten_model(factorized)
        log.info("low-rank switch: %s, %d -> %d parameters", ranks, before, self.layout().dim)
        return new_vec, {"switched": True, "ranks": self.ranks, "params_before": before, "params_after": self.layout().dim}

    def after_round(self, rnd: int, vec: torch.Tensor) -> tuple[torch.Tensor, dict | None]:
        """The (possibly factorized) global model after round `rnd`, and a report when it switched."""
        if self.spec is None or self.ranks is not None:
            return vec, None
        return self.spec.after_round(self, rnd, vec)

    # --- each scheme's rule, called by its scenario section (fedsim/scenario.py: Pufferfish, Cuttlefish) ---
    def pufferfish_start(self, vec: torch.Tensor) -> torch.Tensor:
        return self.switch(vec, self.pufferfish_ranks(vec))[0] if self.spec.warmup_rounds == 0 else vec

    def pufferfish_after_round(self, rnd: int, vec: torch.Tensor) -> tuple[torch.Tensor, dict | None]:
        return self.switch(vec, self.pufferfish_ranks(vec)) if rnd >= self.spec.warmup_rounds else (vec, None)

    def cuttlefish_start(self, vec: torch.Tensor) -> torch.Tensor:
        model = self.model(vec)
        s = self.spec
        self.tracker = CuttlefishTracker(
            model, window=s.window, min_rounds=s.min_rounds, tail=s.tail, threshold=s.threshold,
            threshold_scaler=s.threshold_scaler, skip_first=s.skip_first, skip_last=s.skip_last,
        )
        self.tracker.update(model)  # the official history starts with the untrained weights
        return vec

    def cuttlefish_after_round(self, rnd: int, vec: torch.Tensor) -> tuple[torch.Tensor, dict | None]:
        self.tracker.update(self.model(vec))
        return self.switch(vec, self.tracker.ranks()) if self.tracker.should_switch() else (vec, None)

    def state_dict(self) -> dict:
        state = {"ranks": self.ranks or {}}
        if self.tracker is not None:
            state["tracker"] = json.dumps(self.tracker.state_dict())
        return state

    def load_state_dict(self, state: dict) -> None:
        if state.get("ranks"):
            self.ranks = {str(k): int(v) for k, v in state["ranks"].items()}
        if self.tracker is not None and "tracker" in state:
            self.tracker.load_state_dict(json.loads(state["tracker"]))
