"""FedProx's proximal term and FedSGD's single step (fedsim/training.py) against hand-written SGD."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from fedsim.client.app import make_client_app
from fedsim.flower.local_grid import LocalGrid
from fedsim.runs.folder import RunFolder
from fedsim.runs.results import read_rounds
from fedsim.scenario import load_scenario
from fedsim.server.app import run_server
from fedsim.training import TrainConfig, train

ROOT = Path(__file__).resolve().parents[1]


def data(n=24, d=5, classes=3, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, d)).astype(np.float32), rng.integers(0, classes, n).astype(np.int64)


def model(seed=0):
    torch.manual_seed(seed)
    return nn.Linear(5, 3)


def test_fedprox_steps_by_hand():
    """w ← w − lr·(∇CE(w) + μ(w − w0)) on each shuffled batch, as train() draws them."""
    x, y = data()
    cfg = TrainConfig(epochs=2, batch_size=8, lr=0.1, proximal_mu=0.5)
    trained = model()
    train(trained, x, y, cfg, seed=3)
    ref = model()
    w0 = [p.detach().clone() for p in ref.parameters()]
    gen = torch.Generator().manual_seed(3)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    for _ in range(2):
        order = torch.randperm(len(xt), generator=gen)
        for b in range(3):
            idx = order[b * 8:(b + 1) * 8]
            ref.zero_grad()
            nn.functional.cross_entropy(ref(xt[idx]), yt[idx]).backward()
            with torch.no_grad():
                for p, a in zip(ref.parameters(), w0):
                    p -= 0.1 * (p.grad + 0.5 * (p - a))
    for p, q in zip(trained.parameters(), ref.parameters()):
        assert torch.allclose(p, q, atol=1e-6)


def test_a_large_mu_keeps_the_model_near_its_start():
    x, y = data(n=64)
    moved = {}
    for mu in (0.0, 10.0):
        m = model()
        start = torch.cat([p.detach().flatten() for p in m.parameters()])
        train(m, x, y, TrainConfig(epochs=3, batch_size=8, lr=0.05, proximal_mu=mu), seed=1)
        moved[mu] = float(torch.linalg.vector_norm(torch.cat([p.detach().flatten() for p in m.parameters()]) - start))
    assert moved[10.0] < 0.5 * moved[0.0]


def test_fedsgd_is_one_full_batch_gradient_step():
    x, y = data()
    m = model()
    stats = train(m, x, y, TrainConfig(epochs=5, batch_size=len(x), lr=0.2, max_steps=1), seed=0)
    ref = model()
    ref.zero_grad()
    nn.functional.cross_entropy(ref(torch.from_numpy(x)), torch.from_numpy(y)).backward()
    with torch.no_grad():
        for p in ref.parameters():
            p -= 0.2 * p.grad
    assert stats["steps"] == 1
    for p, q in zip(m.parameters(), ref.parameters()):
        assert torch.allclose(p, q, atol=1e-6)


def test_fedprox_in_real_rounds(tmp_path):
    base = ["federation.rounds=2", "federation.num_clients=8", "federation.clients_per_round=5"]
    norms = {}
    for mu in (0.0, 1.0):
        sc = load_scenario(str(ROOT / "scenarios/quickstart.yaml"), base + [f"federation.proximal_mu={mu}"])
        run = RunFolder.create(sc, tmp_path / str(mu))
        run_server(LocalGrid(make_client_app(sc), 8), sc, run)
        norms[mu] = [r["honest_update_norm_median"] for r in read_rounds(run) if r["round"] > 0]
    assert all(a < b for a, b in zip(norms[1.0], norms[0.0]))  # the proximal term shortens honest updates
