"""What one training sample costs a device: the FLOPs of a forward and backward pass, counted.

Counted, not timed: torch's FlopCounterMode adds up the FLOPs of the matrix products and
convolutions a forward and backward pass on a batch of real inputs dispatches, which depends on
the model and the input shape only, so a client's compute time is the same on any host.
Element-wise work (activations, pooling, the loss) is not counted: for the networks here it is a
few percent of the total. A model whose work the counter does not see (recurrent layers run as
one fused op) falls back to 6 FLOPs per parameter per sample (a forward multiply-add and twice
that backward), and says so.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from torch.utils.flop_counter import FlopCounterMode

log = logging.getLogger("fedsim")


def train_flops_per_sample(model: torch.nn.Module, x, batch: int = 2) -> float:
    """FLOPs of one sample's forward and backward pass through `model`, on `batch` of the inputs `x`
    (the loss's own work is element-wise: a sum stands in for it, the backward pass is the same)."""
    xb = torch.from_numpy(np.array(x[:batch]))  # a copy: the cached arrays are read-only memory maps
    was_training = model.training
    model.train()
    counter = FlopCounterMode(display=False)
    try:
        with counter:
            model(xb).float().sum().backward()
    finally:
        model.zero_grad(set_to_none=True)
        model.train(was_training)
    flops = counter.get_total_flops() / len(xb)
    params = sum(p.numel() for p in model.parameters())
    if flops < 2 * params:  # the counter missed most of the work (fused recurrent kernels)
        log.info("clock: counted %.3g FLOPs per sample for %d parameters; using 6 per parameter instead", flops, params)
        return 6.0 * params
    return float(flops)
