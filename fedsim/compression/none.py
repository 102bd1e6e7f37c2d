"""The uncompressed upload: the float32 update as it is."""

from __future__ import annotations

import torch

from fedsim.compression.base import Codec
from fedsim.compression.common import F32, Reader
from fedsim.registry import COMPRESSORS, Params


class NoneParams(Params):
    pass


@COMPRESSORS.register("none", NoneParams, dense=True)
class Uncompressed(Codec):
    """No compression: the flat float32 update (4 bytes per parameter)."""

    def encode(self, delta, layout, state):
        return {"delta": delta.detach().to(torch.float32).numpy()}, state

    def decode(self, payload, layout):
        reader = Reader(payload)
        delta = torch.from_numpy(reader.get("delta", F32, (layout.dim,)).copy())
        reader.finish()  # arrays beside "delta" are refused, as by every other codec
        return delta
