"""The uncompressed upload: the float32 update as it is."""

from __future__ import annotations

import numpy as np
import torch

from fedsim.compression.base import Codec, expect_array
from fedsim.registry import COMPRESSORS, Params


class NoneParams(Params):
    pass


@COMPRESSORS.register("none", NoneParams)
class Uncompressed(Codec):
    """No compression: the flat float32 update (4 bytes per parameter)."""

    def encode(self, delta, layout, state):
        return {"delta": delta.detach().to(torch.float32).numpy()}, state

    def decode(self, payload, layout):
        return torch.from_numpy(expect_array(payload, "delta", np.dtype(np.float32), (layout.dim,)).copy())
