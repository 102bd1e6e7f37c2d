"""Quantization: float16, QSGD (Alistarh et al. 2017) and scaled sign (EF-SignSGD, Karimireddy et al. 2019).

QSGD splits each tensor into buckets (512 entries by default) with one float32 L2 norm each and
rounds |v_i| / ||v|| * s stochastically to an integer level 0..s, so the decoded value is unbiased.
The signed levels travel as int8 for s <= 127 (the default, "8-bit" QSGD), two per byte for
s <= 7 ("4-bit", level + s in 0..14 per nibble), int16 otherwise; the paper's Elias-gamma coding
is not used. Sign sends one bit per coordinate (np.packbits) and the per-tensor scale ||p||_1 / d.
"""

from __future__ import annotations

from math import ceil, prod

import numpy as np
import torch
from pydantic import Field

from fedsim.compression.base import PayloadError
from fedsim.compression.common import F16, F32, U8, CodecParams, TensorCodec, finite_nonneg, key, next_seed, tensor_generator
from fedsim.registry import COMPRESSORS

FP16_MAX = float(np.finfo(np.float16).max)


class Fp16Params(CodecParams):
    pass


@COMPRESSORS.register("fp16", Fp16Params)
class Fp16(TensorCodec):
    """Half precision: each entry cast to float16 (clamped to ±65504 so it stays finite)."""

    def encode_tensor(self, i, x, state, ctx):
        return {"h": x.reshape(-1).clamp(-FP16_MAX, FP16_MAX).to(torch.float16).numpy()}

    def decode_tensor(self, i, shape, reader, ctx):
        return torch.from_numpy(reader.get(key(i, "h"), F16, (prod(shape),)).astype(np.float32))


class QsgdParams(CodecParams):
    levels: int = Field(127, ge=1, le=32767, description="s: quantization levels per sign (127 = int8, <= 7 = 4 bits)")
    bucket_size: int = Field(512, ge=1, description="entries sharing one norm")


def level_dtype(s: int) -> np.dtype:
    return U8 if s <= 7 else np.dtype(np.int8) if s <= 127 else np.dtype(np.int16)


def level_len(s: int, n: int) -> int:
    return ceil(n / 2) if s <= 7 else n


def pack_levels(levels: torch.Tensor, s: int) -> np.ndarray:
    """Signed levels in [-s, s] to the wire: nibbles (s <= 7), int8 or int16."""
    if s > 7:
        return levels.numpy().astype(level_dtype(s))
    u = (levels + s).numpy().astype(np.uint8)
    if u.size % 2:
        u = np.append(u, np.uint8(s))  # padding nibble decodes to level 0
    return u[0::2] | (u[1::2] << 4)


def unpack_levels(arr: np.ndarray, s: int, n: int, what: str) -> torch.Tensor:
    if s <= 7:
        u = np.empty(2 * arr.size, dtype=np.int16)
        u[0::2], u[1::2] = arr & 15, arr >> 4
        levels = u[:n] - s
    else:
        levels = arr.astype(np.int32)  # wide enough that abs(int8/int16 minimum) cannot wrap around
    if levels.size:
        worst = int(np.abs(levels.astype(np.int32, copy=False)).max())
        if worst > s:
            raise PayloadError(f"{what}: level outside [-{s}, {s}], got magnitude {worst}")
    return torch.from_numpy(levels.astype(np.float32))


def qsgd_quantize(x: torch.Tensor, s: int, bucket: int, gen: torch.Generator) -> tuple[np.ndarray, torch.Tensor]:
    """(bucket norms float32, signed levels int) of the flat tensor `x`, stochastically rounded."""
    n = x.numel()
    nb = ceil(n / bucket)
    v = torch.nn.functional.pad(x.reshape(-1), (0, nb * bucket - n)).view(nb, bucket)
    norms = torch.linalg.vector_norm(v, dim=1)
    safe = torch.where(norms > 0, norms, torch.ones_like(norms))
    scaled = v.abs() / safe[:, None] * s
    low = scaled.floor()
    up = torch.rand(scaled.shape, generator=gen) < (scaled - low)
    levels = (low + up.to(low.dtype)).clamp(max=s).to(torch.int32) * torch.sign(v).to(torch.int32)
    return norms.numpy(), levels.reshape(-1)[:n]


@COMPRESSORS.register("qsgd", QsgdParams)
class Qsgd(TensorCodec):
    """QSGD: per-bucket norm plus stochastically rounded signed levels (unbiased, no error feedback)."""

    def prepare(self, delta, p, layout, state):
        return {}, {"seed": next_seed(p, state)}

    def encode_tensor(self, i, x, state, ctx):
        s = self.params.levels
        norms, levels = qsgd_quantize(x, s, self.params.bucket_size, tensor_generator(ctx["seed"], i))
        return {"norm": norms, "q": pack_levels(levels, s)}

    def decode_tensor(self, i, shape, reader, ctx):
        s, bucket, n = self.params.levels, self.params.bucket_size, prod(shape)
        nb = ceil(n / bucket)
        norms = finite_nonneg(reader.get(key(i, "norm"), F32, (nb,)), f"tensor {i} norms")
        levels = unpack_levels(reader.get(key(i, "q"), level_dtype(s), (level_len(s, n),)), s, n, f"tensor {i}")
        levels = torch.nn.functional.pad(levels, (0, nb * bucket - n)).view(nb, bucket)
        return (levels * (torch.from_numpy(norms.copy()) / s)[:, None]).reshape(-1)[:n]


class SignParams(CodecParams):
    error_feedback: bool = Field(True, description="EF-SignSGD: keep p - decode(p) for the next upload")


@COMPRESSORS.register("sign", SignParams)
class Sign(TensorCodec):
    """Scaled sign (EF-SignSGD): 1 bit per entry and one scale per tensor, the mean absolute value."""

    def encode_tensor(self, i, x, state, ctx):
        flat = x.reshape(-1)
        scale = (flat.abs().sum() / flat.numel()).reshape(1)
        return {"scale": scale.numpy(), "bits": np.packbits((flat >= 0).numpy())}

    def decode_tensor(self, i, shape, reader, ctx):
        n = prod(shape)
        scale = finite_nonneg(reader.get(key(i, "scale"), F32, (1,)), f"tensor {i} scale")
        bits = np.unpackbits(reader.get(key(i, "bits"), U8, (ceil(n / 8),)), count=n)
        return (torch.from_numpy(bits.astype(np.float32)) * 2 - 1) * float(scale[0])
