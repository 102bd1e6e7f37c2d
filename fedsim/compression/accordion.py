"""Accordion (Agarwal et al. 2021): light compression in critical regimes, heavy compression otherwise.

Per compressed tensor, every `interval`-th upload of a client is a check: with ‖Δ_new‖ the norm
of this upload's uncompressed update for that tensor and ‖Δ_old‖ the norm at the previous check,
the tensor is critical when |‖Δ_old‖ − ‖Δ_new‖| / ‖Δ_old‖ >= threshold (0.5, hard-coded in the
official code; ‖Δ_old‖ = 0 counts as ratio 9, i.e. critical). The first upload is critical. A
critical tensor uses `high_level` (high fidelity: PowerSGD rank 2 / top-k 10%), the others
`low_level` (rank 1 / top-k 1%), until the next check. A uint8 array `levels` (1 = high) tells
the server which setting each tensor used. Norms, levels and the upload count live in the
client state.

Departures from the official code: the decision applies to the upload whose norm triggered it
(in FL the whole update is known before it is sent; the official code switches from the next
epoch); the interval counts a client's own uploads, not epochs; there is no lr-decay rule
(the codec does not see the schedule); the top-k variant keeps error feedback (the official top-k
reducer never updates its memory) and defaults to 1% / 10% instead of 10% / 99%, because 99% with
explicit indices costs more bytes than the float32 update.
"""

from __future__ import annotations

from math import prod
from typing import Literal

import numpy as np
import torch
from pydantic import Field, model_validator

from fedsim.compression.base import PayloadError
from fedsim.compression.common import F32, I64, U8, CodecParams, TensorCodec
from fedsim.compression.powersgd import lowrank_pays, powersgd_decode, powersgd_encode, query_seed
from fedsim.compression.sparse import keep_count, topk_decode, topk_parts
from fedsim.registry import COMPRESSORS

LOW, HIGH = 0, 1
DEFAULT_LEVELS = {"powersgd": (1, 2), "topk": (0.01, 0.1)}  # (low, high); official PowerSGD: rank 1 <-> 2
ZERO_NORM_RATIO = 9.0  # the official code's ratio when the old norm is 0
NORM, LEVEL, COUNT = "acc_norm", "acc_level", "acc_count"


class AccordionParams(CodecParams):
    codec: Literal["powersgd", "topk"] = Field("powersgd", description="the inner codec whose setting switches")
    low_level: float | None = Field(None, description="heavy setting (rank or fraction); default rank 1 / fraction 0.01")
    high_level: float | None = Field(None, description="critical-regime setting; default rank 2 / fraction 0.1")
    threshold: float = Field(0.5, gt=0, description="η: relative norm change that marks a critical regime")
    interval: int = Field(1, ge=1, description="check every this many uploads of a client (the official switch_freq)")
    warm_start: bool = Field(True, description="PowerSGD: reuse each rank's last Q")
    error_feedback: bool = Field(True, description="keep the compression error for the next upload")

    @model_validator(mode="after")
    def _levels_fit(self):
        for level in self.levels():
            if self.codec == "powersgd" and not (level >= 1 and float(level).is_integer()):
                raise ValueError(f"powersgd levels are ranks (integers >= 1), got {level}")
            if self.codec == "topk" and not 0 < level <= 1:
                raise ValueError(f"topk levels are fractions in (0, 1], got {level}")
        return self

    def levels(self) -> tuple[float, float]:
        low, high = DEFAULT_LEVELS[self.codec]
        return (low if self.low_level is None else self.low_level, high if self.high_level is None else self.high_level)


def critical(old: np.ndarray, new: np.ndarray, threshold: float) -> np.ndarray:
    """Accordion's rule per tensor: relative norm change >= threshold."""
    safe = np.where(old != 0, old, 1.0)
    ratio = np.where(old != 0, np.abs(old - new) / safe, ZERO_NORM_RATIO)
    return ratio >= threshold


@COMPRESSORS.register("accordion", AccordionParams)
class Accordion(TensorCodec):
    """Accordion: per-tensor switch between a light and a heavy PowerSGD/top-k setting on norm changes."""

    def setting(self, level: int) -> float:
        return self.params.levels()[level]

    def compressible(self, shape):
        if not super().compressible(shape):
            return False
        return self.params.codec == "topk" or lowrank_pays(shape, int(max(self.params.levels())))

    def prepare(self, delta, p, layout, state):
        comp = [(o, s) for shape, o, s in zip(layout.shapes, layout.offsets, layout.sizes) if self.compressible(shape)]
        count = int(state[COUNT][0]) if COUNT in state else 0
        if count % self.params.interval == 0 or LEVEL not in state:
            new = np.array([float(torch.linalg.vector_norm(delta[o : o + s])) for o, s in comp], dtype=np.float64)
            old = state.get(NORM)
            if old is None or old.shape != new.shape:
                levels = np.full(len(comp), HIGH, dtype=np.uint8)
            else:
                levels = np.where(critical(old, new, self.params.threshold), HIGH, LOW).astype(np.uint8)
            state[NORM], state[LEVEL] = new, levels
        levels = np.asarray(state[LEVEL], dtype=np.uint8).copy()
        state[COUNT] = np.array([count + 1], dtype=I64)
        ctx = {"levels": self._by_tensor(layout, levels), "seed": query_seed(p, state, self.params.warm_start)}
        return {"levels": levels}, ctx

    def read_header(self, reader, layout):
        n = sum(1 for shape in layout.shapes if self.compressible(shape))
        levels = reader.get("levels", U8, (n,))
        if n and int(levels.max()) > HIGH:
            raise PayloadError(f"accordion levels must be 0 (low) or 1 (high), got {int(levels.max())}")
        return {"levels": self._by_tensor(layout, levels)}

    def _by_tensor(self, layout, levels: np.ndarray) -> dict[int, int]:
        comp = [i for i, shape in enumerate(layout.shapes) if self.compressible(shape)]
        return {i: int(v) for i, v in zip(comp, levels)}

    def encode_tensor(self, i, x, state, ctx):
        value = self.setting(ctx["levels"][i])
        if self.params.codec == "topk":
            return topk_parts(x, keep_count(value, x.numel()), F32)
        rank = int(value)
        return powersgd_encode(i, x, rank, state, f"q{i}.r{rank}", self.params.warm_start, ctx["seed"])

    def decode_tensor(self, i, shape, reader, ctx):
        value = self.setting(ctx["levels"][i])
        if self.params.codec == "topk":
            return topk_decode(i, shape, keep_count(value, prod(shape)), reader, F32)
        return powersgd_decode(i, shape, int(value), reader)
