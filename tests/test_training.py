"""Local training: fedsim's SGD against torch.optim.SGD (the oracle), and the import it avoids."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn

from fedsim.training import SGD, TrainConfig, train


def small_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3))


@pytest.mark.parametrize("momentum, weight_decay", [(0.0, 0.0), (0.9, 0.0), (0.9, 1e-4), (0.0, 5e-3)])
def test_sgd_equals_torch_sgd_bit_for_bit(momentum, weight_decay):
    """Same steps on the same batches, with a frozen layer (no gradient: skipped by both)."""
    ours, theirs = small_net(), small_net()
    for net in (ours, theirs):
        net[0].weight.requires_grad_(False)
    opt_ours = SGD(ours.parameters(), lr=0.05, momentum=momentum, weight_decay=weight_decay)
    opt_theirs = torch.optim.SGD(theirs.parameters(), lr=0.05, momentum=momentum, weight_decay=weight_decay)
    gen = torch.Generator().manual_seed(1)
    for _ in range(7):
        x, y = torch.randn(5, 1, 8, 8, generator=gen), torch.randint(0, 3, (5,), generator=gen)
        for net, opt in ((ours, opt_ours), (theirs, opt_theirs)):
            opt.zero_grad()
            nn.functional.cross_entropy(net(x), y).backward()
            opt.step()
    for a, b in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(a, b)
    assert torch.equal(ours[0].weight, small_net()[0].weight)  # the frozen layer did not move
    moved = [not torch.equal(a, b) for a, b in zip(ours.parameters(), small_net().parameters())]
    assert moved == [False, True, True, True]


def test_train_with_momentum_matches_a_torch_sgd_loop():
    """train() gives the model a plain torch.optim.SGD loop over the same seeded batches gives."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(40, 1, 8, 8)).astype(np.float32), rng.integers(0, 3, 40)
    cfg = TrainConfig(epochs=2, batch_size=8, lr=0.05, momentum=0.9, weight_decay=1e-4)
    ours = small_net()
    train(ours, x, y, cfg, seed=3)

    ref = small_net()
    opt = torch.optim.SGD(ref.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    torch.manual_seed(3)
    gen = torch.Generator().manual_seed(3)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    for _ in range(cfg.epochs):
        order = torch.randperm(len(xt), generator=gen)
        for b in range(0, len(xt), cfg.batch_size):
            idx = order[b : b + cfg.batch_size]
            opt.zero_grad()
            nn.functional.cross_entropy(ref(xt[idx]), yt[idx]).backward()
            opt.step()
    for a, b in zip(ours.parameters(), ref.parameters()):
        assert torch.equal(a, b)


def test_training_does_not_import_dynamo():
    """The reason SGD exists: torch.optim's Optimizer imports torch._dynamo on first use (seconds per process)."""
    code = (
        "import sys, numpy as np, torch\n"
        "from fedsim.training import TrainConfig, train\n"
        "net = torch.nn.Linear(4, 2)\n"
        "train(net, np.ones((8, 4), np.float32), np.zeros(8, np.int64), TrainConfig(1, 4, 0.1, 0.9, 1e-4), seed=0)\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
