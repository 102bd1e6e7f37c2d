"""PowerSGD (Vogels, Karimireddy, Jaggi 2019): rank-r compression by one power iteration.

Each tensor with >= 2 dims is viewed as a matrix M of shape [first dim, rest] (a conv kernel
[out, in, k, k] becomes [out, in*k*k]). With the query Q [m, r]: P = M Q, P̂ = Gram-Schmidt(P)
(eps 1e-8, as in the paper code), Q' = Mᵀ P̂; the client sends P̂ and Q' (float32) and the server
decodes P̂ Q'ᵀ. With warm start (the paper's `reuse_query`, default) the client keeps Q' as its next
query; the first query is N(0, 1) from a fixed seed, the same on every client. 1-D tensors, small
ones and those where r (n + m) >= n m (no saving) travel uncompressed. Error feedback is on by
default, as in PowerSGD.
"""

from __future__ import annotations

from math import prod

import torch
from pydantic import Field

from fedsim.compression.common import F32, CodecParams, Reader, TensorCodec, key, next_seed, tensor_generator
from fedsim.registry import COMPRESSORS

FIRST_QUERY_SEED = 0x9057  # warm start: the first query is the same on every client, as in the paper


def matrix_dims(shape: tuple[int, ...], rank: int) -> tuple[int, int, int]:
    n, m = shape[0], prod(shape[1:])
    return n, m, min(rank, n, m)


def lowrank_pays(shape: tuple[int, ...], rank: int) -> bool:
    """Whether rank-`rank` factors are smaller than the matrix itself."""
    if len(shape) < 2:
        return False
    n, m, r = matrix_dims(shape, rank)
    return r * (n + m) < n * m


def orthonormalize(p: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Column-wise Gram-Schmidt (a copy); columns that vanish stay ~0 thanks to eps."""
    p = p.clone()
    for c in range(p.shape[1]):
        col = p[:, c : c + 1]
        col /= torch.linalg.vector_norm(col) + eps
        if c + 1 < p.shape[1]:
            rest = p[:, c + 1 :]
            rest -= (col * rest).sum(dim=0, keepdim=True) * col
    return p


def power_step(mat: torch.Tensor, query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One power iteration: (P̂ = orth(M Q), Q' = Mᵀ P̂)."""
    p = orthonormalize(mat @ query)
    return p, mat.T @ p


def powersgd_encode(i: int, x: torch.Tensor, rank: int, state: dict, qkey: str, warm: bool, seed: int) -> dict:
    """P̂ and Q' for tensor `i`; with `warm`, Q' replaces the query stored under `state[qkey]`."""
    n, m, r = matrix_dims(tuple(x.shape), rank)
    stored = state.get(qkey) if warm else None
    if stored is not None and stored.shape == (m, r):
        query = torch.tensor(stored)
    else:
        query = torch.randn((m, r), generator=tensor_generator(seed, i))
    p, q = power_step(x.reshape(n, m), query)
    if warm and torch.isfinite(q).all() and bool(q.any()):  # a zero update would freeze Q at 0
        state[qkey] = q.numpy().copy()
    return {"p": p.numpy(), "q": q.numpy()}


def powersgd_decode(i: int, shape: tuple[int, ...], rank: int, reader: Reader) -> torch.Tensor:
    n, m, r = matrix_dims(shape, rank)
    p = torch.from_numpy(reader.get(key(i, "p"), F32, (n, r)).copy())
    q = torch.from_numpy(reader.get(key(i, "q"), F32, (m, r)).copy())
    return p @ q.T


class PowerSgdParams(CodecParams):
    rank: int = Field(2, ge=1, description="r: columns of P and Q")
    warm_start: bool = Field(True, description="reuse last round's Q as the query (the paper's reuse_query)")
    error_feedback: bool = Field(True, description="PowerSGD's error memory")


def query_seed(p: torch.Tensor, state: dict, warm: bool) -> int:
    """Warm start: the shared first-query seed. Otherwise a fresh seed per upload."""
    return FIRST_QUERY_SEED if warm else next_seed(p, state)


@COMPRESSORS.register("powersgd", PowerSgdParams)
class PowerSgd(TensorCodec):
    """PowerSGD: rank-r factors P̂, Q' of each matrix from one warm-started power iteration."""

    def compressible(self, shape):
        return super().compressible(shape) and lowrank_pays(shape, self.params.rank)

    def prepare(self, delta, p, layout, state):
        return {}, {"seed": query_seed(p, state, self.params.warm_start)}

    def encode_tensor(self, i, x, state, ctx):
        return powersgd_encode(i, x, self.params.rank, state, f"q{i}", self.params.warm_start, ctx["seed"])

    def decode_tensor(self, i, shape, reader, ctx):
        return powersgd_decode(i, shape, self.params.rank, reader)
