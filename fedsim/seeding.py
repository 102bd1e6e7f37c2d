"""Every random stream is derived from the scenario seed and the place it is used."""

from __future__ import annotations

import threading

import numpy as np
import torch

# torch's global generator is one per process. Code that seeds it and then draws from it (a model's
# initial weights, dropout masks while training) holds this lock, and so does code that draws from
# it unseeded (building any model): a sweep runs several runs' servers in one process at once
# (fedsim/engine/shared.py), and a draw in one thread between another's seed and its draws would
# change that run's numbers.
TORCH_GLOBAL_RNG = threading.RLock()


def derive_seed(*keys: int) -> int:
    """A 63-bit seed from a tuple of non-negative ints (scenario seed, round, client, purpose...)."""
    return int(np.random.SeedSequence([int(k) for k in keys]).generate_state(2, dtype=np.uint64)[0] >> np.uint64(1))


def torch_generator(*keys: int) -> torch.Generator:
    return torch.Generator().manual_seed(derive_seed(*keys))


def numpy_rng(*keys: int) -> np.random.Generator:
    return np.random.default_rng(derive_seed(*keys))


# purposes, so that streams for different uses never coincide
TRAIN, SAMPLE, SERVER, INIT = 1, 2, 3, 4
CLOCK = 5  # the federation clock: devices, networks, time zones, who is offline or drops out
