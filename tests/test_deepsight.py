"""DeepSight against independent oracles: NEUPs, threshold exceedings, the classification boundary
and the cluster rule by hand; DDifs against a numpy forward pass looped over inputs and classes; a
synthetic round whose few-neuron (backdoor-like) updates are removed; clipping factors by hand."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from fedsim.defenses.deepsight import (
    DeepSight, DeepSightParams, accepted_models, co_cluster_distances, ddifs, neups_and_tes, noise_seeds,
    suspicious_by_te,
)
from fedsim.models.layout import ModelLayout
from fedsim.registry import DEFENSES, MODELS
from fedsim.scenario import load_scenario
from fedsim.server.pipeline import RoundPipeline
from fedsim.updates import RoundContext, UpdateBatch

ROOT = Path(__file__).resolve().parents[1]
FAST = dict(num_samples=200)  # DDif noise inputs per set in the round tests (the default is 2000)


class NetTools:
    """Stands in for fedsim/server/tools.py's ServerTools: builds `build()` loaded with flat weights."""

    def __init__(self, build, input_shape: tuple[int, ...], num_classes: int) -> None:
        self.build, self.input_shape, self.num_classes = build, input_shape, num_classes
        self.layout = ModelLayout.of(build())

    def model_of(self, vec: torch.Tensor) -> nn.Module:
        model = self.build()
        self.layout.load_into(model, vec)
        return model


def tiny_mlp() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 5))


def backdoor_round(seed: int = 3, n_bad: int = 3, honest_norms=None):
    """10 updates of a 6-8-5 MLP: honest ones small noise on every tensor; the last n_bad raise
    output neuron 2 strongly (its weight row and bias) on top of tiny noise."""
    tools = NetTools(tiny_mlp, (6,), 5)
    layout = tools.layout
    g = torch.Generator().manual_seed(seed)
    gw = 0.3 * torch.randn(layout.dim, generator=g)
    honest = 0.05 * torch.randn(10 - n_bad, layout.dim, generator=g)
    if honest_norms is not None:
        honest = honest / honest.norm(dim=1, keepdim=True) * torch.tensor(honest_norms, dtype=torch.float32)[:, None]
    bad = 0.005 * torch.randn(n_bad, layout.dim, generator=g)
    w, b = layout.slice(layout.names[-2]), layout.slice(layout.names[-1])
    rows = bad[:, w].reshape(n_bad, 5, 8)
    rows[:, 2, :] += 0.5
    bad[:, w] = rows.reshape(n_bad, -1)
    bad[:, b.start + 2] += 0.5
    updates = torch.cat([honest, bad])
    batch = UpdateBatch(updates, torch.full((10,), 10.0), tuple(range(100, 110)))
    ctx = RoundContext(round=1, global_weights=gw, layout=layout, generator=torch.Generator().manual_seed(0), tools=tools)
    return batch, ctx


# ------------------------------------------------------------------------------- NEUPs and TEs


def test_neups_and_threshold_exceedings_by_hand():
    # client 0: energies |b| + Σ|w| = (0 + 1 + 1, 0.5 + 0.5, 0.1 + 0) = (2, 1, 0.1)
    # client 1: energies (1, 1, 1); client 2: no output-layer change
    w = torch.tensor([[[1.0, -1.0], [0.5, 0.0], [0.0, 0.0]],
                      [[1.0, 0.0], [0.0, -1.0], [0.5, 0.0]],
                      [[0.0, 0.0], [0.0, 0.0], [0.0, 0.0]]], dtype=torch.float64)
    b = torch.tensor([[0.0, 0.5, 0.1], [0.0, 0.0, 0.5], [0.0, 0.0, 0.0]], dtype=torch.float64)
    neups, tes = neups_and_tes(w, b)
    np.testing.assert_allclose(neups[0].numpy(), [4 / 5.01, 1 / 5.01, 0.01 / 5.01], rtol=1e-12)
    np.testing.assert_allclose(neups[1].numpy(), [1 / 3] * 3, rtol=1e-12)
    np.testing.assert_allclose(neups[2].numpy(), [0.0] * 3)
    # ξ = max(0.01, 1/3) · max NEUP: client 0: 0.266 -> only the first; client 1: 1/9 -> all three;
    # client 2: every NEUP is 0 >= ξ = 0
    assert tes.tolist() == [1, 3, 3]


def test_threshold_factor_is_001_when_there_are_more_than_100_outputs():
    # P = 200: ξ = 0.01 · max NEUP (1/P = 0.005 would also count the 196 neurons of energy 0.8)
    energy = torch.tensor([10.0, 1.2, 1.2, 1.2] + [0.8] * 196)
    neups, tes = neups_and_tes(energy[None, :, None], torch.zeros(1, 200))
    sq = energy.double() ** 2
    np.testing.assert_allclose(neups[0].numpy(), (sq / sq.sum()).numpy(), rtol=1e-12)
    # max NEUP = 100 / S; 1.44 / S > 0.01 · 100 / S; 0.64 / S < 1 / S
    assert tes.tolist() == [4]


def test_classification_boundary_by_hand():
    cases = {
        (10, 10, 9, 2, 5, 1, 10): [3, 5],  # median 9: TE <= 4.5
        (3, 6, 6): [0],                    # median 6: TE <= 3, equality is suspicious
        (1, 2, 6, 8): [0, 1],              # even n: median (2 + 6) / 2 = 4, TE <= 2
        (5, 5, 5, 5): [],                  # all alike: nobody
    }
    for tes, expected in cases.items():
        got = suspicious_by_te(torch.tensor(tes)).nonzero().flatten().tolist()
        assert got == expected, tes


# ------------------------------------------------------------------------- clusters and the τ rule


def test_co_cluster_distances_by_hand():
    expected = np.array([[0, 0, 1, 1, 1],
                         [0, 0, 1, 1, 1],
                         [1, 1, 0, 1, 1],   # noise shares a cluster with nobody
                         [1, 1, 1, 0, 1],   # two noise points are not one cluster
                         [1, 1, 1, 1, 0]], dtype=float)
    np.testing.assert_array_equal(co_cluster_distances(np.array([0, 0, -1, -1, 1])), expected)


def test_cluster_rule_by_hand():
    labels = np.array([0, 0, 0, 0, 1, 1, 1, -1, -1, 2, 2])
    suspicious = np.array([0, 0, 0, 1, 1, 0, 0, 1, 0, 1, 1], dtype=bool)
    # cluster 0: 1/4 < 1/3 kept; cluster 1: exactly 1/3 removed; noise: its own label; cluster 2: 2/2 removed
    expected = [True] * 4 + [False] * 3 + [False, True] + [False] * 2
    assert accepted_models(labels, suspicious, 1 / 3).tolist() == expected
    # τ = 0.5: cluster 1 (1/3) is kept now
    assert accepted_models(labels, suspicious, 0.5).tolist() == [True] * 7 + [False, True, False, False]


# ------------------------------------------------------------------------------------------ DDifs


def numpy_probs(net: nn.Sequential, x: np.ndarray) -> np.ndarray:
    """Softmax of the 3-4-3 MLP's output for one input, from its weights with numpy."""
    w1, b1, w2, b2 = (p.detach().double().numpy() for p in net.parameters())
    z = w2 @ np.maximum(w1 @ x + b1, 0.0) + b2
    e = np.exp(z - z.max())
    return e / e.sum()


def test_ddifs_against_a_direct_loop():
    build = lambda: nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 3))  # noqa: E731
    tools = NetTools(build, (3,), 3)
    g = torch.Generator().manual_seed(5)
    gw = torch.randn(tools.layout.dim, generator=g)
    updates = 0.5 * torch.randn(2, tools.layout.dim, generator=g)
    seeds, n_samples = [9, 4], 5
    got = ddifs(tools.model_of, gw, updates, (3,), n_samples, seeds, batch=3)
    assert got.shape == (2, 2, 3) and got.dtype == torch.float64

    glob = tools.model_of(gw)
    for s, seed in enumerate(seeds):
        rng = torch.Generator().manual_seed(seed)  # the documented noise: chunks of `batch` inputs, uniform in [0, 1)
        xs = torch.cat([torch.rand((3, 3), generator=rng), torch.rand((2, 3), generator=rng)]).double().numpy()
        for k in range(2):
            local = tools.model_of(gw + updates[k])
            for c in range(3):
                total = 0.0
                for x in xs:
                    total += numpy_probs(local, x)[c] / numpy_probs(glob, x)[c]
                assert got[s, k, c].item() == pytest.approx(total / n_samples, rel=1e-6), (s, k, c)
    # the global model against itself: exactly 1
    same = ddifs(tools.model_of, gw, torch.zeros(1, tools.layout.dim), (3,), 7, [0])
    np.testing.assert_allclose(same.numpy(), 1.0, rtol=1e-12)


# --------------------------------------------------------------------------------- whole rounds


def test_backdoor_group_is_removed_and_honest_updates_kept():
    batch, ctx = backdoor_round()
    out, log = DeepSight(DeepSightParams(**FAST)).before(batch, ctx)
    honest, bad = list(range(100, 107)), [107, 108, 109]
    assert log["removed"] == bad and set(bad) <= set(log["suspicious"])
    assert out.client_ids == tuple(honest)
    assert all(log["te"][c] == 1 for c in bad) and all(log["te"][c] >= 4 for c in honest)
    assert len({log["clusters"][c] for c in bad}) == 1 and log["clusters"][bad[0]] >= 0  # one cluster of their own
    assert not {log["clusters"][c] for c in honest} & {log["clusters"][bad[0]]}
    # clipping: min(1, median of all 10 norms / own norm), by numpy
    norms = batch.updates.double().norm(dim=1).numpy()
    bound = np.median(norms)
    factors = np.minimum(1.0, bound / norms[:7])
    np.testing.assert_allclose(out.updates.double().numpy(), batch.updates[:7].double().numpy() * factors[:, None], rtol=1e-6)
    assert log["bound"] == pytest.approx(bound, rel=1e-6)
    assert log["clipped"] == {100 + i: pytest.approx(f, rel=1e-6) for i, f in enumerate(factors) if f < 1}
    assert torch.equal(out.weights, batch.weights[:7])
    json.dumps(log)


def test_clipping_factor_by_hand():
    # honest norms 1..7; attackers ≈ 0.5·sqrt(9) = 1.5 (nine raised coordinates)
    batch, ctx = backdoor_round(honest_norms=[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0])
    bad_norms = batch.updates[7:].norm(dim=1)
    assert ((bad_norms > 1.0) & (bad_norms < 2.0)).all()  # sorted: 1, 3 attackers, 2, 3, ..., 7: median (2 + 3) / 2
    out, log = DeepSight(DeepSightParams(**FAST)).before(batch, ctx)
    assert log["removed"] == [107, 108, 109]
    assert log["bound"] == pytest.approx(2.5, rel=1e-6)
    assert log["clipped"] == {102: pytest.approx(2.5 / 3), 103: pytest.approx(2.5 / 4), 104: pytest.approx(2.5 / 5),
                              105: pytest.approx(2.5 / 6), 106: pytest.approx(2.5 / 7)}
    np.testing.assert_allclose(out.updates.norm(dim=1).numpy(), [1.0, 2.0, 2.5, 2.5, 2.5, 2.5, 2.5], rtol=1e-5)

    out, log = DeepSight(DeepSightParams(clip=False, **FAST)).before(batch, ctx)
    assert log["clipped"] == {} and "bound" not in log and torch.equal(out.updates, batch.updates[:7])


def test_same_generator_seed_same_round():
    batch, ctx = backdoor_round()
    runs = []
    for _ in range(2):
        fresh = RoundContext(ctx.round, ctx.global_weights, ctx.layout, torch.Generator().manual_seed(4), tools=ctx.tools)
        runs.append(DeepSight(DeepSightParams(**FAST)).before(batch, fresh))
    (out1, log1), (out2, log2) = runs
    assert log1 == log2 and torch.equal(out1.updates, out2.updates)
    # and the noise comes from the round's generator: another generator seed, other noise sets
    assert noise_seeds(torch.Generator().manual_seed(4), 3) == noise_seeds(torch.Generator().manual_seed(4), 3)
    assert noise_seeds(torch.Generator().manual_seed(4), 3) != noise_seeds(torch.Generator().manual_seed(5), 3)
    a, b = (ddifs(ctx.tools.model_of, ctx.global_weights, batch.updates[:2], (6,), 50, [s]) for s in (0, 1))
    assert not torch.equal(a, b)


def test_without_server_tools_the_batch_passes_with_a_note():
    batch, ctx = backdoor_round()
    bare = RoundContext(ctx.round, ctx.global_weights, ctx.layout, ctx.generator)
    out, log = DeepSight(DeepSightParams()).before(batch, bare)
    assert out is batch and "note" in log and "removed" not in log


def test_a_model_without_an_output_layer_at_the_end_is_refused():
    batch, ctx = backdoor_round()
    layout = ModelLayout(names=("w", "b"), shapes=((ctx.layout.dim - 1,), (1,)))
    odd = RoundContext(ctx.round, ctx.global_weights, layout, ctx.generator, tools=ctx.tools)
    with pytest.raises(ValueError, match="output layer"):
        DeepSight(DeepSightParams()).before(batch, odd)


def test_registered_with_the_papers_defaults():
    entry = DEFENSES.get("deepsight")
    params = entry.params()
    assert params.tau == pytest.approx(1 / 3) and params.clip is True and params.num_seeds == 3
    assert all(f.description for f in entry.params.model_fields.values())
    with pytest.raises(ValueError):
        entry.params(tau=0.0)


def test_pipeline_drops_the_removed_clients_before_the_rule():
    """The quickstart's MLP through RoundPipeline: what reaches fedavg is the clipped accepted rows."""
    sc = load_scenario(str(ROOT / "scenarios/quickstart.yaml"),
                       ["attack=null", "aggregator=fedavg", "defenses=[{name: deepsight, num_samples: 200}]"])
    spec = MODELS.get("mlp")
    tools = NetTools(lambda: spec.obj((1, 8, 8), 10, spec.params(hidden=[16])), (1, 8, 8), 10)
    layout = tools.layout
    g = torch.Generator().manual_seed(2)
    gw = 0.1 * torch.randn(layout.dim, generator=g)
    updates = 0.02 * torch.randn(10, layout.dim, generator=g)
    w, b = layout.slice(layout.names[-2]), layout.slice(layout.names[-1])
    for row in (8, 9):  # two attackers pushing output neuron 1
        block = updates[row, w].reshape(10, 16)
        block[1] += 0.4
        updates[row, w] = block.reshape(-1)
        updates[row, b.start + 1] += 0.4
    batch = UpdateBatch(updates, torch.full((10,), 5.0), tuple(range(10)))
    ctx = RoundContext(round=1, global_weights=gw, layout=layout, generator=torch.Generator().manual_seed(0), tools=tools)
    out = RoundPipeline(sc).run(batch, set(), ctx)
    info = out.defenses["deepsight"]
    assert out.skipped is None and {8, 9} <= set(info["removed"])
    assert out.aggregated == [c for c in range(10) if c not in info["removed"]]
    norms = updates.norm(dim=1)
    bound = float(np.median(norms.numpy()))
    kept = updates[out.aggregated]
    factors = torch.clamp(bound / kept.norm(dim=1), max=1.0)
    np.testing.assert_allclose(out.aggregate.numpy(), (kept * factors[:, None]).mean(dim=0).numpy(), rtol=1e-5, atol=1e-7)
