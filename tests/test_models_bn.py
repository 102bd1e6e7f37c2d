"""The ResNets and LSTMs (fedsim/models/resnet.py, recurrent.py) and how BatchNorm buffers travel
(fedsim/models/layout.py, buffers.py, the server pipeline): parameter counts computed by hand,
forward shapes, buffers averaged apart from the trainable coordinates the rules and defenses see."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from conftest import QUICKSTART, quick_scenario, round_context
from fedsim.models.layout import ModelLayout
from fedsim.models.nets import features, head
from fedsim.registry import MODELS
from fedsim.server.pipeline import RoundPipeline
from fedsim.training import TrainConfig, train
from fedsim.updates import RoundContext, UpdateBatch


def build(name: str, input_shape, num_classes: int, **params) -> nn.Module:
    entry = MODELS.get(name)
    return entry.obj(tuple(input_shape), num_classes, entry.params(**params))


def count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def conv(c_in, c_out, k=3):  # bias-free, as in both ResNets
    return c_in * c_out * k * k


def bn(c):  # weight and bias
    return 2 * c


# --- parameter counts, by hand --------------------------------------------------------------------

def test_resnet18_cifar10_parameter_count_by_hand():
    total = conv(3, 64) + bn(64)
    c = 64
    for width, first_stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        for block in range(2):
            total += conv(c, width) + bn(width) + conv(width, width) + bn(width)
            if block == 0 and (first_stride != 1 or c != width):
                total += conv(c, width, 1) + bn(width)  # projection shortcut
            c = width
    total += 512 * 10 + 10
    assert total == 11_173_962
    assert count(build("resnet18", (3, 32, 32), 10)) == total


@pytest.mark.parametrize("shortcut", ["A", "B"])
def test_resnet20_parameter_count_by_hand(shortcut):
    total = conv(3, 16) + bn(16)
    c = 16
    for width in (16, 32, 64):
        for block in range(3):
            total += conv(c, width) + bn(width) + conv(width, width) + bn(width)
            if block == 0 and c != width and shortcut == "B":
                total += conv(c, width, 1) + bn(width)
            c = width
    total += 64 * 10 + 10
    assert total == {"A": 269_722, "B": 272_474}[shortcut]
    assert count(build("resnet20", (3, 32, 32), 10, shortcut=shortcut)) == total


def lstm_count(vocab, embed, hidden, layers, classes):
    """nn.LSTM: per layer 4 gates of (input + hidden) weights and two bias vectors."""
    total = vocab * embed
    width = embed
    for _ in range(layers):
        total += 4 * hidden * (width + hidden) + 2 * 4 * hidden
        width = hidden
    return total + hidden * classes + classes


def test_lstm_parameter_counts_by_hand():
    assert count(build("lstm", (30,), 2)) == lstm_count(10_002, 200, 200, 2, 2)
    assert count(build("char_lstm", (80,), 80)) == lstm_count(80, 8, 256, 2, 80) == 819_920


# --- forward passes -------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["resnet18", "resnet20"])
def test_resnets_forward_shape_and_head_split(name):
    model = build(name, (3, 32, 32), 10).eval()
    x = torch.randn(2, 3, 32, 32)
    out = model(x)
    assert out.shape == (2, 10)
    assert torch.allclose(head(model)(features(model, x)), out)


def test_text_models_forward_shapes_and_padding_is_ignored():
    torch.manual_seed(0)
    model = build("lstm", (6,), 2, embed_dim=8, hidden=8).eval()
    x = torch.tensor([[5, 7, 9, 0, 0, 0], [3, 4, 0, 0, 0, 0]])
    assert model(x).shape == (2, 2)
    # the first row read at its last real token: the same as the unpadded sequence
    assert torch.allclose(model(x[:1])[0], model(x[:1, :3])[0], atol=1e-6)
    char = build("char_lstm", (80,), 80).eval()
    y = torch.randint(0, 80, (3, 80))
    assert char(y).shape == (3, 80)
    assert torch.allclose(head(char)(features(char, y)), char(y))


def test_text_models_refuse_ids_outside_the_vocabulary_and_bad_shapes():
    model = build("char_lstm", (80,), 80)
    with pytest.raises(ValueError, match="vocab_size"):
        model(torch.full((1, 80), 80))
    with pytest.raises(ValueError, match=r"\(L,\)"):
        build("lstm", (3, 32, 32), 2)
    with pytest.raises(ValueError, match=r"\[C, H, W\]"):
        build("resnet20", (80,), 10)


@pytest.mark.parametrize("name,shape,classes,params", [
    ("lstm", (12,), 2, {"vocab_size": 50, "embed_dim": 16, "hidden": 16}),
    ("char_lstm", (20,), 80, {"hidden": 32}),
])
def test_lstm_models_learn_a_fixed_batch(name, shape, classes, params):
    torch.manual_seed(0)
    model = build(name, shape, classes, **params)
    rng = np.random.default_rng(0)
    vocab = params.get("vocab_size", classes)
    x = rng.integers(1, vocab, size=(16, *shape)).astype(np.int64)
    y = rng.integers(0, classes, size=16).astype(np.int64)
    losses = [train(model, x, y, TrainConfig(epochs=1, batch_size=16, lr=1.0), seed=0)["loss"] for _ in range(8)]
    assert all(np.isfinite(losses))
    assert all(b < a for a, b in zip(losses, losses[1:]))  # full-batch SGD: every step lowers the loss


# --- BatchNorm buffers in the flat layout ---------------------------------------------------------

def test_layout_marks_buffers_and_leaves_integer_counters_out():
    model = build("resnet20", (3, 32, 32), 10)
    layout = ModelLayout.of(model)
    assert not any(n.endswith("num_batches_tracked") for n in layout.names)
    mask = layout.trainable_mask
    assert int(mask.sum()) == count(model)
    bn_channels = sum(m.num_features for m in model.modules() if isinstance(m, nn.BatchNorm2d))
    assert int((~mask).sum()) == 2 * bn_channels  # running_mean + running_var
    assert not mask[layout.slice("bn1.running_var")].any() and mask[layout.slice("bn1.weight")].all()
    sub = layout.trainable_only()
    assert sub.dim == count(model) and not sub.has_buffers
    vec = layout.flatten_model(model)
    assert torch.equal(sub.flatten({n: t for n, t in layout.unflatten(vec).items()}), vec[mask])


def test_models_without_buffers_keep_the_old_layout():
    for name, shape, classes in (("mlp", (1, 8, 8), 10), ("lenet", (1, 28, 28), 10), ("char_lstm", (80,), 80)):
        model = build(name, shape, classes)
        layout = ModelLayout.of(model)
        assert layout.trainable is None and not layout.has_buffers
        assert layout.names == tuple(model.state_dict()) and bool(layout.trainable_mask.all())


def test_load_into_keeps_the_models_step_counter_and_checks_the_fit():
    model = build("resnet20", (3, 32, 32), 10)
    model.bn1.num_batches_tracked.fill_(7)
    layout = ModelLayout.of(model)
    vec = torch.arange(layout.dim, dtype=torch.float32)
    layout.load_into(model, vec)
    assert torch.equal(layout.flatten_model(model), vec) and int(model.bn1.num_batches_tracked) == 7
    with pytest.raises(ValueError, match="does not fit"):
        ModelLayout.of(build("resnet18", (3, 32, 32), 10)).load_into(model, torch.zeros(ModelLayout.of(
            build("resnet18", (3, 32, 32), 10)).dim))


# --- the server pipeline ----------------------------------------------------------------------------

def scenario(*overrides: str):
    return quick_scenario("attack=null", *overrides, base=QUICKSTART)


def local_updates(n_clients: int, seed: int = 0):
    """What clients send (ClientApp: trained model minus global), for a small resnet20."""
    torch.manual_seed(seed)
    model = build("resnet20", (3, 8, 8), 4)
    layout = ModelLayout.of(model)
    global_vec = layout.flatten_model(model)
    rows = []
    rng = np.random.default_rng(seed)
    for i in range(n_clients):
        layout.load_into(model, global_vec)
        x = (rng.standard_normal((8, 3, 8, 8)) * (1 + i) + i).astype(np.float32)  # clients with other statistics
        y = rng.integers(0, 4, 8).astype(np.int64)
        train(model, x, y, TrainConfig(epochs=1, batch_size=4, lr=0.05), seed=i)
        rows.append(layout.flatten_model(model) - global_vec)
    return layout, global_vec, torch.stack(rows)


def context(layout: ModelLayout, global_vec: torch.Tensor) -> RoundContext:
    return round_context(global_weights=global_vec, layout=layout)


def test_buffers_travel_and_fedavg_averages_them_by_weight():
    layout, global_vec, updates = local_updates(3)
    buffers = ~layout.trainable_mask
    assert (updates[:, buffers] != 0).any(dim=1).all()  # every client's running stats moved
    weights = torch.tensor([1.0, 2.0, 5.0])
    out = RoundPipeline(scenario("aggregator=fedavg", "defenses=[]")).run(
        UpdateBatch(updates, weights, (3, 4, 5)), set(), context(layout, global_vec))
    new_global = layout.unflatten(global_vec + out.aggregate)
    sl = layout.slice("bn1.running_mean")
    client_means = [(global_vec + u)[sl] for u in updates]
    by_hand = sum(w * m for w, m in zip(weights.tolist(), client_means)) / 8.0
    assert torch.allclose(new_global["bn1.running_mean"], by_hand, atol=1e-6)
    # FedAvg on the whole state dict, as before the split
    assert torch.allclose(out.aggregate, (weights[:, None] * updates).sum(0) / weights.sum(), atol=1e-6)


@pytest.mark.parametrize("rule", ["{name: krum, num_malicious: 1}", "median"])
def test_robust_rules_see_trainable_coordinates_only(rule):
    layout, global_vec, updates = local_updates(1)
    mask = layout.trainable_mask
    rows = updates.repeat(5, 1)
    rows[:, ~mask] = torch.tensor([0.0, 1e4, -1e4, 3e4, 5e3])[:, None]  # huge buffer differences only
    out = RoundPipeline(scenario(f"aggregator={rule}", "defenses=[]")).run(
        UpdateBatch(rows, torch.ones(5), (0, 1, 2, 3, 4)), set(), context(layout, global_vec))
    assert out.skipped is None
    assert torch.equal(out.aggregate[mask], updates[0][mask])  # the clients are identical to the rule
    buffers = out.aggregate[~mask]
    if out.aggregator is not None:  # Krum's scores are all equal: it keeps the first, and its buffers
        assert out.aggregator["selected"] == [0]
        assert torch.equal(buffers, torch.zeros_like(buffers))
    else:  # the median picks nobody: the buffers' weighted mean
        assert torch.allclose(buffers, torch.full_like(buffers, (0.0 + 1e4 - 1e4 + 3e4 + 5e3) / 5))


def test_norm_clipping_never_rescales_running_statistics():
    layout, global_vec, updates = local_updates(3)
    mask = layout.trainable_mask
    weights = torch.tensor([1.0, 1.0, 2.0])
    out = RoundPipeline(scenario("aggregator=fedavg", "defenses=[{name: norm_clipping, delta: 1.0e-6}]")).run(
        UpdateBatch(updates, weights, (0, 1, 2)), set(), context(layout, global_vec))
    unclipped = (weights[:, None] * updates).sum(0) / weights.sum()
    assert torch.allclose(out.aggregate[~mask], unclipped[~mask], atol=1e-7)
    assert float(torch.linalg.vector_norm(out.aggregate[mask])) <= 1e-6 * (1 + 1e-5)
    clip_norms = out.defenses["norm_clipping"]["norms"]  # measured on the trainable part only
    assert clip_norms[2] == pytest.approx(float(torch.linalg.vector_norm(updates[2][mask])), rel=1e-5)


def test_a_rule_that_picks_clients_averages_the_picked_clients_buffers():
    layout, global_vec, updates = local_updates(1)
    mask = layout.trainable_mask
    rows = updates.repeat(5, 1)
    rows[4, mask] += 100.0  # an outlier in the weights, with poisoned running statistics
    rows[:, ~mask] = torch.tensor([1.0, 2.0, 3.0, 4.0, 1e6])[:, None]
    weights = torch.tensor([1.0, 1.0, 1.0, 3.0, 1.0])
    out = RoundPipeline(scenario("aggregator={name: multikrum, num_malicious: 1, num_selected: 3}", "defenses=[]")).run(
        UpdateBatch(rows, weights, (10, 11, 12, 13, 14)), set(), context(layout, global_vec))
    picked = out.aggregator["selected"]
    assert 14 not in picked and len(picked) == 3
    values = {10: 1.0, 11: 2.0, 12: 3.0, 13: 4.0}
    by_hand = sum(weights[p - 10].item() * values[p] for p in picked) / sum(weights[p - 10].item() for p in picked)
    assert torch.allclose(out.aggregate[~mask], torch.full((int((~mask).sum()),), by_hand))


class RecordingTools:
    """Server tools that train nothing: they check they get whole models and return a fixed update."""

    def __init__(self, layout: ModelLayout, update: torch.Tensor) -> None:
        self.layout, self.update, self.seen = layout, update, []

    def server_data(self, size, source):
        return None, None

    def train_update(self, global_weights, layout, x, y, rnd):
        self.seen.append((global_weights.clone(), layout))
        return self.update


def test_server_tools_get_whole_models_and_the_rule_the_trainable_part():
    layout, global_vec, updates = local_updates(3)
    mask = layout.trainable_mask
    server_update = updates.mean(0)
    server_update[~mask] = 1e6  # the server's own buffers must not reach FLTrust's cosine either
    tools = RecordingTools(layout, server_update)
    ctx = RoundContext(1, global_vec, layout, torch.Generator().manual_seed(0), tools=tools)
    out = RoundPipeline(scenario("aggregator=fltrust", "defenses=[]")).run(
        UpdateBatch(updates, torch.ones(3), (0, 1, 2)), set(), ctx)
    (seen_global, seen_layout), = tools.seen
    assert torch.equal(seen_global, global_vec) and seen_layout is layout  # buffers filled back in
    g0 = server_update[mask]
    assert out.aggregator["server_update_norm"] == pytest.approx(float(torch.linalg.vector_norm(g0)), rel=1e-5)


def test_an_asynchronous_reference_is_split_like_the_batch():
    """A server-side attack crafting from recent honest rows (asynchronous protocols) sees their
    trainable coordinates only, as it sees the batch's; BatchNorm buffers are averaged aside."""
    from fedsim.registry import ATTACKS
    from fedsim.server.pipeline import RoundPipeline
    from fedsim.updates import UpdateBatch

    layout, global_vec, updates = local_updates(6)
    spec = ATTACKS.get("alie").params()
    pipe = RoundPipeline(scenario(), ATTACKS.get("alie").obj(spec))
    batch = UpdateBatch(updates[:3], torch.ones(3), (0, 1, 2))
    reference = UpdateBatch(updates[3:], torch.ones(3), (3, 4, 5))
    out = pipe.run(batch, {0}, context(layout, global_vec), reference=reference)
    assert out.skipped is None and torch.isfinite(out.aggregate).all() and out.aggregate.shape == (layout.dim,)
    assert "failed" not in out.attack
