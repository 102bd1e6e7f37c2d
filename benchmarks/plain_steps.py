"""One client's local training as a plain PyTorch script writes it (`torch.optim.SGD` on a copy of
the global model), shared by the plain loops of benchmarks/overhead.py and benchmarks/peers.py. It
follows fedsim's seeding (the global generator for dropout, a seeded generator for the shuffles),
so the plain loops train the same batches as fedsim's clients."""

from __future__ import annotations

import copy

import torch


def local_sgd(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, *, lr: float, epochs: int, batch_size: int,
              seed: int, momentum: float = 0.0, weight_decay: float = 0.0, device: str = "cpu") -> torch.nn.Module:
    """A trained copy of `model`: `epochs` shuffled passes of SGD over (x, y)."""
    local = copy.deepcopy(model)
    local.train()
    opt = torch.optim.SGD(local.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        order = torch.randperm(len(x), generator=gen).to(device)
        for b in range(0, len(x), batch_size):
            idx = order[b : b + batch_size]
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(local(x[idx]), y[idx]).backward()
            opt.step()
    return local
