"""Vectorised cohort training (fedsim/cohort/vectorized.py) against the sequential path it replaces:
each client's row and stats must be what `fedsim.training.train` gives that client alone.

Tolerances are relative to the scale of the update (max |row - start| of that client). Measured on
CPU (2 cores, torch 2.13): mlp and factorized lenet 2e-7 to 1.2e-6, lenet 1.2e-6, vgg9 1e-7 to
1e-6. Conv nets occasionally show one client at 2e-5 to 5e-4: a ReLU pre-activation or max-pool
pair within rounding distance of a tie goes one way in one path and the other way in the other (the
sequential fp32 path differs from an fp64 computation by as much, measured), so those models allow
one or two clients such a kink. Configuration tests (momentum, weight decay, FedProx, max_steps)
run on the mlp, which shows no kinks, at the tight tolerance.
"""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch

from fedsim.cohort.vectorized import _last_level_cache_bytes, chunk_size_for, train_cohort, vector_refusal
from fedsim.lowrank.layers import build_factorized
from fedsim.models.layout import ModelLayout
from fedsim.registry import MODELS
from fedsim.training import TrainConfig, train

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py: why

MNIST = (1, 28, 28)
CIFAR = (3, 32, 32)
TIGHT = 1e-5  # relative to the update's scale: fp32 rounding (measured <= 1.2e-6)
KINK = 5e-3  # one client of a conv net whose ReLU / max-pool flipped (measured <= 5.5e-4)
SEEDS = [11, 12, 13, 14, 15]
CFG = TrainConfig(epochs=2, batch_size=10, lr=0.05, momentum=0.9, weight_decay=5e-4)


def build(name: str, input_shape=MNIST, **params) -> torch.nn.Module:
    entry = MODELS.get(name)
    torch.manual_seed(0)
    return entry.obj(input_shape, 10, entry.params(**params))


def datasets(sizes, shape=MNIST, seed=0) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [(rng.normal(size=(n, *shape)).astype(np.float32), rng.integers(0, 10, n).astype(np.int64)) for n in sizes]


def sequential(model, layout, start, data, cfg, seeds) -> tuple[torch.Tensor, list[dict]]:
    """The reference: one `train` per client, each from `start`."""
    model = copy.deepcopy(model)
    rows, stats = [], []
    for (x, y), seed in zip(data, seeds):
        layout.load_into(model, start)
        stats.append(train(model, x, y, cfg, seed))
        rows.append(layout.flatten_model(model))
    return torch.stack(rows), stats


def relative_errors(rows, ref, start) -> list[float]:
    """Per client: max |row - reference| over the scale of its update (max |reference - start|)."""
    scale = (ref - start).abs().amax(1).clamp_min(1e-12)
    return ((rows - ref).abs().amax(1) / scale).tolist()


def check_against_sequential(model, data, cfg, seeds=SEEDS, kinks: int = 0) -> tuple[torch.Tensor, list[dict]]:
    """train_cohort == sequential train, per client: all within TIGHT, or `kinks` clients within KINK."""
    layout = ModelLayout.of(model)
    start = layout.flatten_model(model)
    before = copy.deepcopy(model.state_dict())
    was_training = [m.training for m in model.modules()]
    kept = start.clone()
    rows, stats = train_cohort(model, layout, start, data, cfg, seeds)
    assert torch.equal(start, kept)  # the caller's global model, untouched
    ref, ref_stats = sequential(model, layout, start, data, cfg, seeds)
    assert rows.shape == (len(data), layout.dim) and rows.dtype == torch.float32 and rows.device.type == "cpu"
    errors = sorted(relative_errors(rows, ref, start))
    assert errors[len(errors) - 1 - kinks] <= TIGHT, errors
    assert errors[-1] <= KINK, errors
    for ours, theirs in zip(stats, ref_stats):
        assert ours["steps"] == theirs["steps"] and ours["samples"] == theirs["samples"]
        assert ("start_loss" in ours) == ("start_loss" in theirs)  # the first batch's loss, when a step was taken
        if "start_loss" in ours:
            assert ours["start_loss"] == pytest.approx(theirs["start_loss"], rel=1e-5, abs=1e-6)
        assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-5, abs=1e-6)
    # the model passed in is neither trained nor left in another mode
    assert all(torch.equal(t, before[n]) for n, t in model.state_dict().items())
    assert [m.training for m in model.modules()] == was_training
    return rows, stats


# ---------------------------------------------------------------- the zoo models it accepts
def factorized_lenet() -> torch.nn.Module:
    return build_factorized(lambda: build("lenet", dropout=False), {"conv2": 8, "fc1": 16})


@pytest.mark.parametrize("make, shape, sizes, batch, kinks", [
    (lambda: build("mlp", hidden=[32]), MNIST, (7, 23, 30, 41, 50), 10, 0),
    (lambda: build("lenet", dropout=False), MNIST, (7, 23, 30, 41, 50), 10, 1),
    (factorized_lenet, MNIST, (7, 23, 30, 41, 50), 10, 1),
    (lambda: build("vgg9", CIFAR), CIFAR, (2, 5, 6, 8, 9), 4, 2),
], ids=["mlp", "lenet", "lenet-factorized", "vgg9"])
def test_each_row_is_the_sequential_update(make, shape, sizes, batch, kinks):
    """Different dataset sizes: short last batches (padded with zero weights) and clients that stop
    while others train on (their parameters and momentum must not move)."""
    model = make()
    cfg = dataclasses.replace(CFG, batch_size=batch)
    assert vector_refusal(model, cfg) is None
    _, stats = check_against_sequential(model, datasets(sizes, shape), cfg, kinks=kinks)
    assert [s["steps"] for s in stats] == [2 * -(-n // batch) for n in sizes]


@pytest.mark.parametrize("cfg", [
    dataclasses.replace(CFG, proximal_mu=0.1),  # FedProx
    dataclasses.replace(CFG, batch_size=64, max_steps=1, momentum=0.0, weight_decay=0.0),  # FedSGD: one full batch
    dataclasses.replace(CFG, max_steps=3),  # local steps, across an epoch boundary for the small clients
    dataclasses.replace(CFG, weight_decay=0.05, momentum=0.5, lr=0.1, epochs=3),  # weight decay large enough to see
], ids=["fedprox", "fedsgd", "local-steps", "weight-decay"])
def test_training_variants_match_sequential(cfg):
    """An empty client in the cohort keeps the start and reports what `train` reports (0.0, 0 steps)."""
    data = datasets((7, 23, 0, 41, 50))
    rows, stats = check_against_sequential(build("mlp", hidden=[32]), data, cfg)
    start = ModelLayout.of(build("mlp", hidden=[32])).flatten_model(build("mlp", hidden=[32]))
    assert torch.equal(rows[2], start) and stats[2] == {"loss": 0.0, "steps": 0, "samples": 0}
    expected = [min(cfg.epochs * -(-len(y) // cfg.batch_size), cfg.max_steps or 10**9) for _, y in data]
    assert [s["steps"] for s in stats] == expected


def test_a_frozen_parameter_stays_as_it_does_sequentially():
    """A parameter without requires_grad has no gradient: torch's SGD skips it (no weight decay, no
    FedProx pull), and so does the cohort."""
    model = build("mlp", hidden=[32])
    model[1].weight.requires_grad_(False)
    rows, _ = check_against_sequential(model, datasets((7, 23, 30)), dataclasses.replace(CFG, proximal_mu=0.1),
                                       seeds=SEEDS[:3])
    frozen = ModelLayout.of(model).slice("1.weight")
    assert torch.equal(rows[:, frozen], model[1].weight.detach().reshape(1, -1).expand(3, -1))


def test_bf16_autocast_is_applied_and_close_to_sequential_bf16():
    """bf16 follows the sequential bf16 path to bf16's rounding (measured <= 7e-3), and is not fp32."""
    model, data = build("mlp", hidden=[32]), datasets((7, 23, 30))
    layout = ModelLayout.of(model)
    start = layout.flatten_model(model)
    cfg = dataclasses.replace(CFG, precision="bf16")
    rows, _ = train_cohort(model, layout, start, data, cfg, SEEDS[:3])
    ref, _ = sequential(model, layout, start, data, cfg, SEEDS[:3])
    fp32, _ = train_cohort(model, layout, start, data, CFG, SEEDS[:3])
    assert max(relative_errors(rows, ref, start)) <= 5e-2
    assert min(relative_errors(rows, fp32, start)) > 1e-4


def test_deterministic_switches_train_the_same():
    model, data = build("mlp", hidden=[32]), datasets((7, 23))
    layout = ModelLayout.of(model)
    start = layout.flatten_model(model)
    rows, _ = train_cohort(model, layout, start, data, dataclasses.replace(CFG, deterministic=True), SEEDS[:2])
    plain, _ = train_cohort(model, layout, start, data, CFG, SEEDS[:2])
    assert torch.equal(rows, plain)
    assert not torch.are_deterministic_algorithms_enabled()  # put back as it was


# ---------------------------------------------------------------- what it refuses
@pytest.mark.parametrize("name, shape, params, reason", [
    ("resnet20", CIFAR, {}, "BatchNorm keeps per-client running statistics"),
    ("lstm", (6,), {"vocab_size": 20, "embed_dim": 4, "hidden": 5}, "nn.LSTM has no vmap rule"),
    ("char_lstm", (6,), {"embed_dim": 4, "hidden": 5}, "nn.LSTM has no vmap rule"),
])
def test_models_that_cannot_vmap_are_refused(name, shape, params, reason):
    model = build(name, shape, **params)
    assert vector_refusal(model, CFG) == reason
    layout = ModelLayout.of(model)
    with pytest.raises(ValueError, match=reason):
        train_cohort(model, layout, layout.flatten_model(model), [], CFG, [])


def test_fp16_is_refused():
    assert vector_refusal(build("mlp"), dataclasses.replace(CFG, precision="fp16")) == \
        "fp16 loss scaling skips steps per client"


# ---------------------------------------------------------------- dropout, reproducibility, chunks
def test_dropout_draws_per_client_and_reproducibly():
    """Two clients with the same data and seed get different masks, so different rows; the same
    call again gives the same rows bit for bit (the generator is seeded from the seeds)."""
    model = build("lenet")  # dropout 0.25 / 0.5
    layout = ModelLayout.of(model)
    start = layout.flatten_model(model)
    (x, y), = datasets((12,))
    data, seeds = [(x, y), (x, y)], [7, 7]
    rows, _ = train_cohort(model, layout, start, data, CFG, seeds)
    again, _ = train_cohort(model, layout, start, data, CFG, seeds)
    assert not torch.equal(rows[0], rows[1])
    assert torch.equal(rows, again)
    # without dropout the two are the same client
    plain = build("lenet", dropout=False)
    same, _ = train_cohort(plain, layout, layout.flatten_model(plain), data, CFG, seeds)
    assert torch.equal(same[0], same[1])


def test_same_call_twice_is_bit_identical_and_neighbours_change_only_rounding():
    """Bit for bit for the same cohort. Another cohort (alone, other neighbours, other chunks) runs
    other kernels (a grouped convolution of another group count, a GEMM of another batch) and agrees
    within rounding: measured on one thread, the mlp bit for bit, lenet within 3e-8 absolute."""
    model = build("lenet", dropout=False)
    layout = ModelLayout.of(model)
    start = layout.flatten_model(model)
    data = datasets((12, 3, 7, 20, 9))
    cfg = dataclasses.replace(CFG, batch_size=5)
    rows, stats = train_cohort(model, layout, start, data, cfg, SEEDS)
    again, stats_again = train_cohort(model, layout, start, data, cfg, SEEDS)
    assert torch.equal(rows, again) and stats == stats_again
    alone, _ = train_cohort(model, layout, start, data[:1], cfg, SEEDS[:1])
    others, _ = train_cohort(model, layout, start, [data[3], data[0]], cfg, [SEEDS[3], SEEDS[0]])
    chunked, _ = train_cohort(model, layout, start, data, cfg, SEEDS, chunk=2)
    for row in (alone[0], others[1], chunked[0]):
        assert max(relative_errors(row[None], rows[:1], start)) <= TIGHT
    assert max(relative_errors(chunked, rows, start)) <= TIGHT


def test_chunks_give_the_rows_of_one_computation():
    model = build("mlp", hidden=[32])
    layout = ModelLayout.of(model)
    start = layout.flatten_model(model)
    data = datasets((7, 23, 0, 41, 50, 12))
    whole, stats = train_cohort(model, layout, start, data, CFG, SEEDS + [16])
    for chunk in (1, 2, 4):
        rows, chunk_stats = train_cohort(model, layout, start, data, CFG, SEEDS + [16], chunk=chunk)
        assert max(relative_errors(rows, whole, start)) <= TIGHT
        assert [s["steps"] for s in chunk_stats] == [s["steps"] for s in stats]


def test_chunk_size_on_cpu_keeps_activations_in_cache():
    """Bigger activations per client, smaller chunks; None where the cache size is unknown."""
    sizes = [chunk_size_for(m, ModelLayout.of(m), CFG, shape, "cpu")
             for m, shape in ((build("mlp"), MNIST), (build("lenet"), MNIST), (build("vgg9", CIFAR), CIFAR))]
    if _last_level_cache_bytes() is None:
        assert sizes == [None] * 3
    else:
        assert sizes[0] > sizes[1] >= sizes[2] >= 1


# ---------------------------------------------------------------- CUDA
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name, params, kinks", [("mlp", {"hidden": [32]}, 0), ("lenet", {"dropout": False}, 1)])
def test_rows_on_cuda_are_the_sequential_update_on_cuda(name, params, kinks, monkeypatch):
    """In fp32: cuDNN's default TF32 convolutions round the two paths' different kernels (grouped
    vs plain) differently, ~1e-3 of the update on LeNet (measured on an H100, docs/gpu.md), which
    says nothing about the algorithm; the comparison turns TF32 off."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    model = build(name, **params)
    cfg = dataclasses.replace(CFG, device="cuda", proximal_mu=0.01)
    check_against_sequential(model, datasets((7, 23, 30, 41, 50)), cfg, kinks=kinks)
    size = chunk_size_for(model, ModelLayout.of(model), cfg, MNIST, "cuda")
    assert isinstance(size, int) and size >= 1
