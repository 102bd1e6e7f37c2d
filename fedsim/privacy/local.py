"""Local differential privacy: an honest client clips its update to L2 norm C and adds N(0, (z·C)²)
to every coordinate before the update leaves it, so the server never sees an un-noised update
(`federation.local_dp` in the scenario).

The guarantee is per client and holds against the server itself, which sees each release:
- Sensitivity 2C: local DP compares any two inputs of the client's mechanism, and two updates of
  norm <= C differ by at most 2C. With noise std z·C the mechanism's noise multiplier is z/2.
  (Flower's LocalDpMod takes the sensitivity as a separate argument.)
- No amplification by subsampling: the server picks the clients of each round, so it knows which
  rounds a client took part in. A client's ε composes its own releases, k Gaussian mechanisms at
  multiplier z/2 (RDP, sampling rate 1), where k is the number of rounds it was sampled in.
`LocalPrivacyLedger` counts k per client from the rounds' sampled clients (seeded by the scenario, so
the server can rebuild the counts after a resume) and reports the largest ε, that of the client
sampled most often: every client's ε is at most that.

The noise comes from a stream seeded by (scenario seed, round, client), so a seed reproduces the
run; see docs/privacy.md for what that means outside a simulation.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable

import torch

from fedsim.privacy.accountant import default_delta, gaussian_epsilon
from fedsim.seeding import torch_generator

LOCAL_DP = 0x1D9  # seed purpose of a client's local-DP noise


def privatize(update: torch.Tensor, clip: float, noise_multiplier: float, generator: torch.Generator) -> torch.Tensor:
    """`update` scaled to L2 norm at most `clip`, plus i.i.d. N(0, (noise_multiplier·clip)²) noise
    (drawn in float32 from `generator`) on every coordinate."""
    if clip <= 0 or noise_multiplier < 0:
        raise ValueError(f"local DP needs clip > 0 and noise_multiplier >= 0, got {clip}, {noise_multiplier}")
    norm = float(torch.linalg.vector_norm(update, dtype=torch.float64))
    out = update * (clip / norm) if norm > clip else update.clone()
    std = noise_multiplier * clip
    if std > 0:
        noise = torch.randn(update.shape, generator=generator, device=generator.device, dtype=torch.float32)
        out = out + (noise * std).to(device=update.device, dtype=update.dtype)
    return out


def privatize_release(update: torch.Tensor, settings, seed: int, rnd: int, pid: int) -> torch.Tensor:
    """What client `pid` sends in round `rnd`: `privatize` with its own seeded stream, or `update`
    unchanged when `settings` (the scenario's `federation.local_dp`) is None."""
    if settings is None:
        return update
    return privatize(update, settings.clip, settings.noise_multiplier, torch_generator(seed, LOCAL_DP, rnd, pid))


def local_epsilon(noise_multiplier: float, releases: int, delta: float) -> float:
    """ε of one client after `releases` local-DP releases at δ (sensitivity 2C: multiplier z/2)."""
    return gaussian_epsilon(noise_multiplier / 2, 1.0, releases, delta, "rdp") if releases else 0.0


class LocalPrivacyLedger:
    """The server's count of each client's releases and the per-client ε that follows."""

    def __init__(self, settings, num_clients: int) -> None:
        self.settings = settings
        self.delta = settings.delta if settings.delta is not None else default_delta(num_clients)
        self.releases: Counter[int] = Counter()

    def count(self, sampled: Iterable[int]) -> None:
        """One round's sampled clients: each releases one update (an upper bound when one fails)."""
        self.releases.update(int(p) for p in sampled)

    def report(self) -> dict:
        most = max(self.releases.values(), default=0)
        return {"epsilon": local_epsilon(self.settings.noise_multiplier, most, self.delta), "delta": self.delta,
                "accountant": "rdp", "releases": most, "noise_multiplier": float(self.settings.noise_multiplier),
                "clip": float(self.settings.clip)}
