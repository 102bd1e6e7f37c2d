"""Privacy accounting for client-level DP: how much ε a run has spent, from opacus' accountants.

Each aggregated round is one step of the sampled Gaussian mechanism with noise multiplier z
(noise std / sensitivity) and sampling rate q; the accountant composes the steps and converts the
total to (ε, δ)-DP. `rdp` is Rényi DP (Mironov 2017; opacus' `RDPAccountant`, the conversion of
Balle et al. 2020); `prv` is the numerical composition of privacy loss random variables (Gopi et
al. 2021; opacus' `PRVAccountant`, an upper bound within 0.01 of the exact ε, usually tighter
than RDP). Both analyse Poisson sampling at rate q.

The state is the step history [(z, q, steps)], which is all an accountant holds, so a checkpoint
stores it as a small tensor and a resumed run rebuilds the same accountant.

opacus is imported on first use: it takes seconds, and only a run with differential privacy needs it.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

AccountantName = Literal["rdp", "prv"]


def default_delta(num_clients: int) -> float:
    """δ for N clients: the largest power of ten strictly below 1/N (20 → 1e-2, 100 → 1e-3,
    3383 → 1e-4). δ < 1/N is the usual requirement for client-level DP: a mechanism that publishes
    one random client's data outright is (0, 1/N)-DP, so δ must be well under 1/N to mean anything."""
    if num_clients < 1:
        raise ValueError(f"num_clients must be at least 1, got {num_clients}")
    return 10.0 ** -len(str(int(num_clients)))


def _opacus(kind: AccountantName):
    if kind == "rdp":
        from opacus.accountants import RDPAccountant

        return RDPAccountant()
    if kind == "prv":
        from opacus.accountants import PRVAccountant

        return PRVAccountant()
    raise ValueError(f"unknown accountant {kind!r}; allowed: rdp, prv")


class PrivacyAccountant:
    """Steps of the sampled Gaussian mechanism, composed by opacus into ε at a given δ."""

    def __init__(self, kind: AccountantName = "rdp") -> None:
        self.kind = kind
        self._inner = _opacus(kind)

    def step(self, noise_multiplier: float, sample_rate: float) -> None:
        if not (noise_multiplier >= 0 and 0 < sample_rate <= 1):
            raise ValueError(f"a step needs noise_multiplier >= 0 and 0 < sample_rate <= 1, got {noise_multiplier}, {sample_rate}")
        self._inner.step(noise_multiplier=float(noise_multiplier), sample_rate=float(sample_rate))

    @property
    def steps(self) -> int:
        return sum(int(n) for _, _, n in self._inner.history)

    def epsilon(self, delta: float) -> float:
        """ε spent so far at δ: 0 before any step, inf when a step had no noise (z = 0)."""
        if not 0 < delta < 1:
            raise ValueError(f"delta must be in (0, 1), got {delta}")
        history = self._inner.history
        if not history:
            return 0.0
        if any(z == 0 for z, _, _ in history):
            return math.inf  # no noise: the release is the data itself
        return float(self._inner.get_epsilon(delta=delta))

    # --- checkpoint -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"history": torch.tensor(self._inner.history, dtype=torch.float64).reshape(-1, 3)}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        rows = state["history"].tolist()
        self._inner.history = [(float(z), float(q), int(n)) for z, q, n in rows]


def gaussian_epsilon(noise_multiplier: float, sample_rate: float, steps: int, delta: float,
                     kind: AccountantName = "rdp") -> float:
    """ε of `steps` compositions of the sampled Gaussian mechanism (z, q) at δ."""
    acc = PrivacyAccountant(kind)
    if steps > 0:
        acc.step(noise_multiplier, sample_rate)
        acc.load_state_dict({"history": torch.tensor([[noise_multiplier, sample_rate, steps]], dtype=torch.float64)})
    return acc.epsilon(delta)
