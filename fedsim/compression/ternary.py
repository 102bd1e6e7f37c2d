"""3LC (Lim, Andersen, Kaminsky 2019): 3-value quantization, base-3^5 packing, zero-run encoding.

Per tensor T (the update plus the error-accumulation buffer, on by default as in 3LC):
1. M = max|T|, q = round(T / (M*s)) in {-1, 0, +1}, decoded as q*M*s; s in [1, 2) is the
   sparsity multiplier (larger s, more zeros). Rounding is deterministic, as in the paper (the TFF
   port rounds stochastically).
2. Five trits per byte: sum_i (q_i + 1) * 3^i in 0..242 (1.6 bits per value). The last group is
   padded with zeros (q = 0), which decode to nothing.
3. Zero runs: byte 121 is five zeros; k consecutive 121 bytes (2 <= k <= 14) become the single
   byte 241 + k (243..255). Longer runs are cut into chunks of 14; a chunk of 1 stays 121.
What travels is the encoded uint8 stream (at most ceil(d/5) bytes) and the float32 scale M*s.
"""

from __future__ import annotations

from math import ceil, prod

import numpy as np
import torch
from pydantic import Field

from fedsim.compression.base import PayloadError
from fedsim.compression.common import F32, U8, CodecParams, TensorCodec, finite_nonneg, key
from fedsim.registry import COMPRESSORS

POW3 = np.array([1, 3, 9, 27, 81], dtype=np.uint8)
ZERO_GROUP = 121  # five zero trits: sum of 3^i
RUN_OFFSET = 241  # a run of k zero groups is the byte 241 + k
MAX_RUN = 14


def pack_trits(q: np.ndarray) -> np.ndarray:
    """Values in {-1, 0, 1} to bytes in 0..242, five per byte (last group padded with 0)."""
    m = ceil(q.size / 5)
    t = np.ones(m * 5, dtype=np.uint8)
    t[: q.size] = q + 1
    return (t.reshape(m, 5) * POW3).sum(axis=1, dtype=np.uint8)


def unpack_trits(packed: np.ndarray, n: int) -> np.ndarray:
    """Bytes in 0..242 back to n values in {-1, 0, 1} (int8)."""
    digits = (packed[:, None] // POW3) % 3
    return digits.reshape(-1)[:n].astype(np.int8) - 1


def zero_run_encode(packed: np.ndarray) -> np.ndarray:
    """Replace runs of 2..14 zero-group bytes (121) by one byte 243..255."""
    zero = np.flatnonzero(packed == ZERO_GROUP)
    if zero.size == 0:
        return packed.copy()
    edges = np.diff(np.concatenate(([0], (packed == ZERO_GROUP).astype(np.int8), [0])))
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    run = np.searchsorted(starts, zero, side="right") - 1
    pos = zero - starts[run]
    chunk = np.minimum(ends[run] - zero, MAX_RUN)  # zero groups left in the run from here, capped
    out = packed.copy()
    out[zero] = np.where(chunk == 1, ZERO_GROUP, RUN_OFFSET + chunk)
    keep = np.ones(packed.size, dtype=bool)
    keep[zero] = pos % MAX_RUN == 0  # the first byte of each chunk of 14 carries the chunk
    return out[keep]


def zero_run_decode(encoded: np.ndarray, length: int, what: str = "stream") -> np.ndarray:
    """Expand run bytes; the result must have exactly `length` bytes (checked before allocating)."""
    run = encoded >= RUN_OFFSET + 2
    counts = np.where(run, encoded.astype(np.int64) - RUN_OFFSET, 1)
    total = int(counts.sum())
    if total != length:
        raise PayloadError(f"{what}: zero-run stream expands to {total} bytes, expected {length}")
    return np.repeat(np.where(run, np.uint8(ZERO_GROUP), encoded), counts)


def ternarize(x: torch.Tensor, s: float) -> tuple[float, np.ndarray]:
    """(scale M*s, trits q) of the 3-value quantization of flat `x`."""
    scale = float(np.float32(float(x.abs().max()) * s))  # the float32 value that is sent
    if scale == 0.0:
        return 0.0, np.zeros(x.numel(), dtype=np.int8)
    return scale, torch.round(x / scale).clamp(-1, 1).to(torch.int8).numpy()


class TernaryParams(CodecParams):
    sparsity_multiplier: float = Field(1.0, ge=1.0, lt=2.0, description="s in [1, 2): values below M*s/2 become 0")
    error_feedback: bool = Field(True, description="3LC's error accumulation buffer")


@COMPRESSORS.register("ternary", TernaryParams)
class Ternary(TensorCodec):
    """3LC: 3-value quantization, 5 trits per byte, zero-run encoding (Lim et al. 2019)."""

    def encode_tensor(self, i, x, state, ctx):
        scale, q = ternarize(x.reshape(-1), self.params.sparsity_multiplier)
        return {"scale": np.array([scale], dtype=F32), "b": zero_run_encode(pack_trits(q))}

    def decode_tensor(self, i, shape, reader, ctx):
        n = prod(shape)
        m = ceil(n / 5)
        scale = finite_nonneg(reader.get(key(i, "scale"), F32, (1,)), f"tensor {i} scale")
        packed = zero_run_decode(reader.vector(key(i, "b"), U8, m), m, f"tensor {i}")
        return torch.from_numpy(unpack_trits(packed, n).astype(np.float32)) * float(scale[0])
