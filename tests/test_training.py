"""Local training: fedsim's SGD and Adam against torch.optim's (the oracles), the training loop's
optimizer and epoch hooks, and the import it avoids."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn

from fedsim.training import SGD, Adam, TrainConfig, sgd_epochs, train


def small_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3))


def frozen_pair() -> tuple[nn.Module, nn.Module]:
    """Two copies of the small net with the first layer frozen (no gradient: skipped by both optimizers)."""
    ours, theirs = small_net(), small_net()
    for net in (ours, theirs):
        net[0].weight.requires_grad_(False)
    return ours, theirs


def step_both(pairs, steps: int = 7, skip_bias_every: int | None = None) -> None:
    """The same `steps` batches through each (net, optimizer); with `skip_bias_every`, the last bias
    has no gradient on every such step (a parameter that misses steps)."""
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        x, y = torch.randn(5, 1, 8, 8, generator=gen), torch.randint(0, 3, (5,), generator=gen)
        for net, opt in pairs:
            opt.zero_grad()
            nn.functional.cross_entropy(net(x), y).backward()
            if skip_bias_every is not None and step % skip_bias_every == 1:
                net[3].bias.grad = None
            opt.step()


@pytest.mark.parametrize("momentum, weight_decay", [(0.0, 0.0), (0.9, 0.0), (0.9, 1e-4), (0.0, 5e-3)])
def test_sgd_equals_torch_sgd_bit_for_bit(momentum, weight_decay):
    """Same steps on the same batches, with a frozen layer (no gradient: skipped by both)."""
    ours, theirs = frozen_pair()
    opt_ours = SGD(ours.parameters(), lr=0.05, momentum=momentum, weight_decay=weight_decay)
    opt_theirs = torch.optim.SGD(theirs.parameters(), lr=0.05, momentum=momentum, weight_decay=weight_decay)
    step_both(((ours, opt_ours), (theirs, opt_theirs)))
    for a, b in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(a, b)
    assert torch.equal(ours[0].weight, small_net()[0].weight)  # the frozen layer did not move
    moved = [not torch.equal(a, b) for a, b in zip(ours.parameters(), small_net().parameters())]
    assert moved == [False, True, True, True]


def test_adam_equals_torch_adam_bit_for_bit():
    """Same steps on the same batches, with a frozen layer and a parameter that misses some steps
    (torch counts steps per parameter for the bias corrections, and so does Adam)."""
    ours, theirs = frozen_pair()
    opt_ours, opt_theirs = Adam(ours.parameters(), lr=0.01), torch.optim.Adam(theirs.parameters(), lr=0.01, foreach=True)
    step_both(((ours, opt_ours), (theirs, opt_theirs)), skip_bias_every=3)
    for a, b in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(a, b)
    assert torch.equal(ours[0].weight, small_net()[0].weight)


def test_adam_matches_the_textbook_update():
    """Kingma & Ba's Algorithm 1 in float64 numpy (eps added to sqrt of the corrected v, as torch does)."""
    rng = np.random.default_rng(0)
    ref = [rng.normal(size=(3, 4)), rng.normal(size=5)]
    ours = [torch.tensor(p, dtype=torch.float32) for p in ref]
    opt = Adam(ours, lr=0.01)
    m = [np.zeros_like(p) for p in ref]
    v = [np.zeros_like(p) for p in ref]
    for t in range(1, 6):
        grads = [rng.normal(size=p.shape) for p in ref]
        for p, g in zip(ours, grads):
            p.grad = torch.tensor(g, dtype=torch.float32)
        opt.step()
        for i, g in enumerate(grads):
            m[i] = 0.9 * m[i] + 0.1 * g
            v[i] = 0.999 * v[i] + 0.001 * g**2
            ref[i] = ref[i] - 0.01 * (m[i] / (1 - 0.9**t)) / (np.sqrt(v[i] / (1 - 0.999**t)) + 1e-8)
    for a, b in zip(ours, ref):
        np.testing.assert_allclose(a.numpy(), b, rtol=1e-5, atol=1e-6)
    assert not np.allclose(ref[1], ours[1].numpy() + 0.01)  # the comparison has teeth


def test_the_loop_takes_another_optimizer_and_calls_its_epoch_hooks():
    """SGD given as `make_optimizer` is the default bit for bit; Adam takes each epoch's lr; the
    epoch hooks run around each epoch that trains, `last` where max_steps ends it mid-epoch."""
    rng = np.random.default_rng(2)
    x, y = rng.normal(size=(20, 1, 8, 8)).astype(np.float32), rng.integers(0, 3, 20)

    def run(**kwargs):
        net = small_net()
        calls = []
        loss = lambda xb, yb: nn.functional.cross_entropy(net(xb), yb)  # noqa: E731
        stats = sgd_epochs(net, list(net.parameters()), x, y, 8, [0.05, 0.02, 0.01], 0.9, 1e-4, 3, loss,
                           before_epoch=lambda e: calls.append(("before", e)),
                           after_epoch=lambda e, last, mean: calls.append(("after", e, last, mean)), **kwargs)
        return net, calls, stats

    default, calls, stats = run()
    given, _, _ = run(make_optimizer=lambda params: SGD(params, lr=0.0, momentum=0.9, weight_decay=1e-4))
    assert all(torch.equal(a, b) for a, b in zip(default.parameters(), given.parameters()))
    assert [c[:3] for c in calls] == [("before", 0), ("after", 0, False), ("before", 1), ("after", 1, False),
                                      ("before", 2), ("after", 2, True)]
    assert calls[-1][3] == stats["loss"]
    _, cut, stats = run(max_steps=4)  # 3 batches an epoch: the 4th step is the second epoch's first
    assert [c[:3] for c in cut] == [("before", 0), ("after", 0, False), ("before", 1), ("after", 1, True)]
    assert stats["steps"] == 4
    lrs = []

    class Recording(Adam):
        def step(self):
            lrs.append(self.lr)
            super().step()

    run(make_optimizer=lambda params: Recording(params, lr=1.0))
    assert lrs == [0.05] * 3 + [0.02] * 3 + [0.01] * 3


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
