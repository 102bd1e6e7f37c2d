"""Sparsification: top-k with error feedback (Stich et al. 2018; Lin et al. 2018) and random-k.

Per tensor, k = max(1, ceil(fraction * numel)) entries travel. Top-k sends their values and
indices (uint16 when the tensor has at most 65536 entries, else int32). Random-k sends only the
values plus one uint64 seed per upload: the server regenerates the same indices from the seed,
which is where random-k saves the index bytes. Neither rescales the kept values (no n/k factor);
the dropped mass comes back through error feedback, on by default as in the papers.
"""

from __future__ import annotations

from math import ceil, prod
from typing import Literal

import numpy as np
import torch
from pydantic import Field

from fedsim.compression.common import F32, I32, U16, U64, CodecParams, Reader, TensorCodec, check_indices, key, next_seed
from fedsim.registry import COMPRESSORS
from fedsim.seeding import derive_seed


def keep_count(fraction: float, numel: int) -> int:
    return min(numel, max(1, ceil(fraction * numel)))


def index_dtype(numel: int) -> np.dtype:
    return U16 if numel <= 1 << 16 else I32


def topk_parts(x: torch.Tensor, k: int, value_dtype: np.dtype) -> dict[str, np.ndarray]:
    """Values and indices of the k largest-magnitude entries of `x` (any shape)."""
    flat = x.reshape(-1)
    idx = torch.topk(flat.abs(), k, sorted=False).indices
    vals = flat[idx].numpy().astype(value_dtype)
    return {"v": vals, "i": idx.numpy().astype(index_dtype(flat.numel()))}


def topk_decode(i: int, shape: tuple[int, ...], k: int, reader: Reader, value_dtype: np.dtype) -> torch.Tensor:
    numel = prod(shape)
    vals = reader.get(key(i, "v"), value_dtype, (k,))
    idx = check_indices(reader.get(key(i, "i"), index_dtype(numel), (k,)), numel, f"tensor {i}")
    out = torch.zeros(numel, dtype=torch.float32)
    out[idx] = torch.from_numpy(vals.astype(np.float32))
    return out


class TopKParams(CodecParams):
    fraction: float = Field(0.01, gt=0, le=1, description="share of each tensor's entries sent")
    value_dtype: Literal["float32", "float16"] = Field("float32", description="dtype of the sent values")
    error_feedback: bool = Field(True, description="keep the unsent entries for the next upload (Stich et al.)")


@COMPRESSORS.register("topk", TopKParams)
class TopK(TensorCodec):
    """Top-k sparsification per tensor: the k largest-magnitude entries as values + indices."""

    def encode_tensor(self, i, x, state, ctx):
        return topk_parts(x, keep_count(self.params.fraction, x.numel()), np.dtype(self.params.value_dtype))

    def decode_tensor(self, i, shape, reader, ctx):
        k = keep_count(self.params.fraction, prod(shape))
        return topk_decode(i, shape, k, reader, np.dtype(self.params.value_dtype))


class RandomKParams(CodecParams):
    fraction: float = Field(0.01, gt=0, le=1, description="share of each tensor's entries sent")
    error_feedback: bool = Field(True, description="keep the unsent entries for the next upload")


def random_indices(seed: int, i: int, numel: int, k: int) -> np.ndarray:
    """k distinct indices of tensor `i`, the same on client and server for the same seed."""
    return np.random.default_rng(derive_seed(seed, i)).choice(numel, size=k, replace=False)


@COMPRESSORS.register("randomk", RandomKParams)
class RandomK(TensorCodec):
    """Random-k sparsification per tensor: k seeded random entries; only values and a seed travel."""

    def prepare(self, delta, p, layout, state):
        seed = next_seed(p, state)
        return {"seed": np.array([seed], dtype=U64)}, {"seed": seed}

    def read_header(self, reader, layout):
        return {"seed": int(reader.get("seed", U64, (1,))[0])}

    def encode_tensor(self, i, x, state, ctx):
        idx = random_indices(ctx["seed"], i, x.numel(), keep_count(self.params.fraction, x.numel()))
        return {"v": x.reshape(-1)[torch.from_numpy(idx)].numpy().copy()}

    def decode_tensor(self, i, shape, reader, ctx):
        numel = prod(shape)
        k = keep_count(self.params.fraction, numel)
        vals = reader.get(key(i, "v"), F32, (k,))
        out = torch.zeros(numel, dtype=torch.float32)
        out[torch.from_numpy(random_indices(ctx["seed"], i, numel, k))] = torch.from_numpy(vals.copy())
        return out

