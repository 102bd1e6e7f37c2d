"""What the lossy codecs share: per-tensor compression, raw small tensors, error feedback, seeds.

A `TensorCodec` walks the layout's tensors. Tensors the codec does not compress (fewer than
`min_size` elements by default, e.g. biases) travel together as one float32 array `raw`; each
compressed tensor `i` sends arrays named `t{i}.<field>`. Which tensors are compressed depends only
on the layout and the parameters, so the server knows which arrays to expect.

Error feedback (Stich et al. 2018; Karimireddy et al. 2019): the client compresses p = delta + e
and keeps e <- p - decode(payload) in `state["residual"]`, so the mass a round drops is sent
later. The residual is computed with the server's own `decode`, so it is exactly what was lost.

Randomness (QSGD rounding, random-k indices, fresh PowerSGD queries) comes from `next_seed`: a
counter carried in the client state mixed with a CRC of the vector being compressed. Runs are
reproducible, and clients that start from the same empty state still draw different streams.
"""

from __future__ import annotations

import zlib
from abc import abstractmethod
from math import prod

import numpy as np
import torch
from pydantic import Field

from fedsim.compression.base import Codec, PayloadError, excerpt, expect_array
from fedsim.models.layout import ModelLayout
from fedsim.registry import Params
from fedsim.seeding import derive_seed

F32, F16, U8, U16, I32, I64, U64 = (np.dtype(t) for t in ("float32", "float16", "uint8", "uint16", "int32", "int64", "uint64"))

RESIDUAL, COUNTER = "residual", "counter"


class CodecParams(Params):
    error_feedback: bool = Field(False, description="keep the compression error and add it to the next upload")
    min_size: int = Field(
        1000, ge=1, description="tensors with fewer elements (biases, small layers) are sent uncompressed as float32"
    )


class Reader:
    """Checked access to an untrusted payload; `finish` rejects arrays nobody asked for."""

    def __init__(self, payload: dict[str, np.ndarray]) -> None:
        self.payload = payload
        self.used: set[str] = set()

    def get(self, key: str, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        self.used.add(key)
        return expect_array(self.payload, key, dtype, shape)

    def vector(self, key: str, dtype: np.dtype, max_len: int) -> np.ndarray:
        """A 1-D array of variable length 1..max_len (entropy-coded streams)."""
        self.used.add(key)
        if key not in self.payload:
            raise PayloadError(f"payload lacks array {key!r}")
        arr = self.payload[key]
        if arr.dtype != dtype or arr.ndim != 1 or not 1 <= arr.shape[0] <= max_len:
            raise PayloadError(
                f"payload array {key!r} is {arr.dtype}{arr.shape}, expected 1-D {np.dtype(dtype)} of length 1..{max_len}"
            )
        return arr

    def finish(self) -> None:
        extra = sorted(set(self.payload) - self.used)
        if extra:
            raise PayloadError(f"payload has unexpected arrays {excerpt(extra[:5])}")


def finite_nonneg(arr: np.ndarray, what: str) -> np.ndarray:
    bad = ~(np.isfinite(arr) & (arr >= 0))
    if bad.any():
        raise PayloadError(f"{what} must be finite and >= 0, got {arr.reshape(-1)[bad.reshape(-1)][:3].tolist()}")
    return arr


def check_indices(idx: np.ndarray, size: int, what: str) -> torch.Tensor:
    """Indices as int64, after checking 0 <= idx < size and that none repeats (the encoders never
    repeat one; a repeated index would make the scatter's result depend on write order)."""
    if not idx.size:
        return torch.from_numpy(idx.astype(np.int64))
    lo, hi = int(idx.min()), int(idx.max())
    if lo < 0 or hi >= size:
        raise PayloadError(f"{what} indices out of range [0, {size}), got {lo if lo < 0 else hi}")
    wide = idx.astype(np.int64)
    ordered = np.sort(wide)
    repeat = ordered[1:] == ordered[:-1]
    if repeat.any():
        raise PayloadError(f"{what} indices must be distinct, {int(ordered[1:][repeat][0])} repeats")
    return torch.from_numpy(wide)


def next_seed(vec: torch.Tensor, state: dict[str, np.ndarray]) -> int:
    """A fresh seed for this encode: the state's counter (advanced) mixed with a CRC of `vec`."""
    count = int(state[COUNTER][0]) if COUNTER in state else 0
    state[COUNTER] = np.array([count + 1], dtype=I64)
    crc = zlib.crc32(np.ascontiguousarray(vec.detach().numpy()).view(np.uint8))
    return derive_seed(count, crc)


def tensor_generator(seed: int, index: int) -> torch.Generator:
    return torch.Generator().manual_seed(derive_seed(seed, index))


def key(i: int, field: str) -> str:
    return f"t{i}.{field}"


class TensorCodec(Codec):
    """Base of the per-tensor codecs; subclasses compress one tensor at a time.

    Hooks: `compressible(shape)`, `prepare` (per-upload arrays and context, e.g. a seed),
    `read_header` (the server side of `prepare`), `encode_tensor` and `decode_tensor`.
    """

    def compressible(self, shape: tuple[int, ...]) -> bool:
        return prod(shape) >= self.params.min_size

    def prepare(self, delta: torch.Tensor, p: torch.Tensor, layout: ModelLayout, state: dict) -> tuple[dict, dict]:
        """(arrays sent once per upload, private context for `encode_tensor`)."""
        return {}, {}

    def read_header(self, reader: Reader, layout: ModelLayout) -> dict:
        return {}

    @abstractmethod
    def encode_tensor(self, i: int, x: torch.Tensor, state: dict, ctx: dict) -> dict[str, np.ndarray]:
        """The arrays (by field name) that stand for tensor `i` (shaped as in the layout)."""

    @abstractmethod
    def decode_tensor(self, i: int, shape: tuple[int, ...], reader: Reader, ctx: dict) -> torch.Tensor:
        """Tensor `i` back from its checked arrays `reader.get(key(i, field), ...)`."""

    def raw_size(self, layout: ModelLayout) -> int:
        return sum(s for shape, s in zip(layout.shapes, layout.sizes) if not self.compressible(shape))

    def encode(self, delta, layout, state):
        state = dict(state)
        delta = delta.detach().to(torch.float32).reshape(-1)
        p = delta
        if self.params.error_feedback and RESIDUAL in state:
            residual = state[RESIDUAL]
            if residual.shape != (layout.dim,):
                raise ValueError(f"codec residual has shape {residual.shape}, expected ({layout.dim},)")
            p = delta + torch.tensor(residual)
        payload, ctx = self.prepare(delta, p, layout, state)
        raw = []
        for i, (shape, off, size) in enumerate(zip(layout.shapes, layout.offsets, layout.sizes)):
            x = p[off : off + size].view(shape)
            if self.compressible(shape):
                payload.update({key(i, f): a for f, a in self.encode_tensor(i, x, state, ctx).items()})
            else:
                raw.append(x.reshape(-1))
        if raw:
            payload["raw"] = torch.cat(raw).numpy()
        if self.params.error_feedback:
            state[RESIDUAL] = (p - self.decode(payload, layout)).numpy()
        return payload, state

    def decode(self, payload, layout):
        reader = Reader(payload)
        ctx = self.read_header(reader, layout)
        n_raw = self.raw_size(layout)
        raw = torch.from_numpy(reader.get("raw", F32, (n_raw,)).copy()) if n_raw else None
        out = torch.empty(layout.dim, dtype=torch.float32)
        pos = 0
        for i, (shape, off, size) in enumerate(zip(layout.shapes, layout.offsets, layout.sizes)):
            if self.compressible(shape):
                out[off : off + size] = self.decode_tensor(i, shape, reader, ctx).reshape(-1).to(torch.float32)
            else:
                out[off : off + size] = raw[pos : pos + size]
                pos += size
        reader.finish()
        return out
