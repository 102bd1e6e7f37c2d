"""The server's optimizer: how the round's aggregate moves the global model (FedOpt, Reddi et al.,
ICLR 2021; FedAvgM, Hsu et al. 2019).

The aggregate Δ_t (the rule's output after the defenses) is the pseudo-gradient. `sgd` with
`lr = 1` and `momentum = 0` is FedAvg (x ← x + Δ, computed as exactly that); `sgd` with momentum
is FedAvgM (m ← β·m + Δ; x ← x + η·m, Flower's FedAvgM). `adam`, `yogi` and `adagrad` follow
Flower 1.41's FedAdam / FedYogi / FedAdagrad maths so that they can be checked against them
(tests/test_server_optimizer.py): m ← β1·m + (1 − β1)·Δ; v ← β2·v + (1 − β2)·Δ² (Adam),
v − (1 − β2)·Δ²·sign(v − Δ²) (Yogi), v + Δ² (Adagrad), v starting at 0; x ← x + η·m / (√v + τ),
with Flower's bias-corrected η for Adam (η·√(1 − β2^(t+1)) / (1 − β1^(t+1))). Flower's FedAdagrad
fixes β1 = 0; here β1 is a setting for all three (Reddi et al. use momentum for FedAdagrad too). A lower server
learning rate alone is a known defense (BackFed), hence `lr` for every optimizer.

The moments are server state: checkpointed each round, and restarted when the model's size
changes (a low-rank switch).
"""

from __future__ import annotations

import torch


class ServerOptimizer:
    def __init__(self, spec) -> None:
        self.spec = spec  # the scenario's `server` section
        self.m: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    @property
    def is_plain(self) -> bool:
        """FedAvg's x ← x + Δ: nothing to compute, no state."""
        s = self.spec
        return s.optimizer == "sgd" and s.lr == 1.0 and s.momentum == 0.0

    def step(self, global_vec: torch.Tensor, aggregate: torch.Tensor, rnd: int) -> torch.Tensor:
        """The new global model after round `rnd`'s aggregate."""
        if self.is_plain:
            return global_vec + aggregate
        s, delta = self.spec, aggregate.to(torch.float32)
        if self.m is not None and self.m.shape != delta.shape:  # the model was factorized: start again
            self.m = self.v = None
        if s.optimizer == "sgd":
            self.m = delta.clone() if self.m is None else s.momentum * self.m + delta
            return global_vec + s.lr * self.m
        m = torch.zeros_like(delta) if self.m is None else self.m
        v = torch.zeros_like(delta) if self.v is None else self.v
        self.m = s.beta_1 * m + (1 - s.beta_1) * delta
        square = delta * delta
        if s.optimizer == "adam":
            self.v = s.beta_2 * v + (1 - s.beta_2) * square
            lr = s.lr * (1 - s.beta_2 ** (rnd + 1.0)) ** 0.5 / (1 - s.beta_1 ** (rnd + 1.0))
        elif s.optimizer == "yogi":
            self.v = v - (1 - s.beta_2) * square * torch.sign(v - square)
            lr = s.lr
        else:  # adagrad
            self.v = v + square
            lr = s.lr
        return global_vec + lr * self.m / (torch.sqrt(self.v) + s.tau)

    def state_dict(self) -> dict:
        return {"m": self.m, "v": self.v}

    def load_state_dict(self, state: dict) -> None:
        self.m, self.v = state.get("m"), state.get("v")
