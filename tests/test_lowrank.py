"""Low-rank building blocks against independent oracles: dense reconstructions of the factorized layers,
Eckart–Young for the SVD initialisation, hand-made stable ranks, Cuttlefish's switching rule against a
scipy.signal EMA, and parameter counts of LeNet worked out by hand."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from scipy.linalg import svdvals
from scipy.signal import lfilter
from torch import nn

from fedsim.lowrank.layers import (
    CuttlefishTracker,
    FactorizedConv2d,
    FactorizedLinear,
    build_factorized,
    compression_of,
    factorizable_layers,
    factorize,
    full_rank,
    parameter_count,
    rank_for_ratio,
    rank_scale,
    scaled_stable_rank_rank,
    stable_rank,
)
from fedsim.models.nets import LeNetParams, MlpParams, Vgg9Params, lenet, mlp, vgg9

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py: why


def _lenet() -> nn.Module:
    torch.manual_seed(0)
    return lenet((1, 28, 28), 10, LeNetParams()).eval()


def _vgg9() -> nn.Module:
    torch.manual_seed(0)
    return vgg9((3, 32, 32), 10, Vgg9Params()).eval()


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return mlp((1, 8, 8), 10, MlpParams(hidden=[32, 16])).eval()


# ---------------------------------------------------------------------------------------------- layers


@pytest.mark.parametrize("bias", [True, False])
def test_factorized_linear_equals_dense_u_vt(bias):
    torch.manual_seed(1)
    layer = FactorizedLinear(7, 5, 3, bias=bias).double()
    w = layer.u.weight @ layer.v.weight  # U [5, 3] · Vᵀ [3, 7]
    x = torch.randn(11, 7, dtype=torch.float64)
    expected = x @ w.T + (layer.u.bias if bias else 0)
    torch.testing.assert_close(layer(x), expected)
    assert dict((k, tuple(v.shape)) for k, v in layer.state_dict().items()) == {
        "v.weight": (3, 7), "u.weight": (5, 3), **({"u.bias": (5,)} if bias else {})
    }


@pytest.mark.parametrize("stride,padding,bias", [(1, 0, True), (2, 1, True), (1, 1, False)])
def test_factorized_conv_equals_composed_kernel(stride, padding, bias):
    torch.manual_seed(2)
    layer = FactorizedConv2d(3, 6, 3, rank=2, stride=stride, padding=padding, bias=bias).double()
    u = layer.u.weight[:, :, 0, 0]  # [out, r]
    kernel = torch.einsum("or,rikl->oikl", u, layer.v.weight)
    x = torch.randn(4, 3, 9, 9, dtype=torch.float64)
    expected = F.conv2d(x, kernel, layer.u.bias if bias else None, stride=stride, padding=padding)
    torch.testing.assert_close(layer(x), expected)


def test_factorized_layers_reject_bad_ranks():
    with pytest.raises(ValueError):
        FactorizedLinear(4, 3, 4)
    with pytest.raises(ValueError):
        FactorizedConv2d(1, 32, 3, rank=10)  # full rank is min(32, 1·3·3) = 9
    with pytest.raises(ValueError):
        FactorizedLinear(4, 3, 0)


# ----------------------------------------------------------------------------------------- factorize


@pytest.mark.parametrize("builder,shape", [(_mlp, (5, 1, 8, 8)), (_lenet, (3, 1, 28, 28)), (_vgg9, (2, 3, 32, 32))])
def test_factorize_at_full_rank_reproduces_outputs(builder, shape):
    model = builder()
    names = factorizable_layers(model)
    ranks = {n: full_rank(model.get_submodule(n)) for n in names}
    low = factorize(model, ranks)
    x = torch.randn(*shape)
    with torch.no_grad():
        ref, out = model(x), low(x)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    assert all(isinstance(model.get_submodule(n), (nn.Linear, nn.Conv2d)) for n in names)  # original untouched
    assert not low.training


@pytest.mark.parametrize("dense", [nn.Linear(20, 12), nn.Linear(6, 15), nn.Conv2d(4, 10, 3, padding=1)])
@pytest.mark.parametrize("rank", [1, 3, 5])
def test_factorize_is_best_rank_r_approximation(dense, rank):
    torch.manual_seed(3)
    net = nn.Sequential(dense)
    low = factorize(net, {"0": rank})[0]
    w = dense.weight.detach().double().reshape(dense.weight.shape[0], -1).numpy()
    u = low.u.weight.detach().double().reshape(low.u.weight.shape[0], rank).numpy()  # [out, r]
    vt = low.v.weight.detach().double().reshape(rank, -1).numpy()  # [r, in·k·k]
    sigma = np.linalg.svd(w, compute_uv=False)
    err = np.linalg.norm(w - u @ vt, "fro") ** 2
    assert err == pytest.approx(np.sum(sigma[rank:] ** 2), rel=1e-4, abs=1e-8)
    # Σ^{1/2} split evenly between the factors: UᵀU = VᵀV = diag(σ_1..σ_r)
    np.testing.assert_allclose(u.T @ u, np.diag(sigma[:rank]), atol=1e-5)
    np.testing.assert_allclose(vt @ vt.T, np.diag(sigma[:rank]), atol=1e-5)
    torch.testing.assert_close(low.u.bias, dense.bias)


def test_conv_factors_have_pufferfish_shapes():
    net = nn.Sequential(nn.Conv2d(5, 8, 3, stride=2, padding=1))
    low = factorize(net, {"0": 4})[0]
    assert isinstance(low, FactorizedConv2d)
    assert low.v.weight.shape == (4, 5, 3, 3) and low.v.bias is None
    assert low.u.weight.shape == (8, 4, 1, 1) and low.u.bias.shape == (8,)
    assert low.v.stride == (2, 2) and low.v.padding == (1, 1) and low.u.stride == (1, 1)


# -------------------------------------------------------------------------------------------- ranks


def test_stable_rank_on_hand_made_matrices():
    assert stable_rank(torch.eye(5)) == pytest.approx(5.0)
    a, b = torch.arange(1.0, 5.0), torch.tensor([2.0, -1.0, 0.5])
    assert stable_rank(torch.outer(a, b)) == pytest.approx(1.0)
    assert stable_rank(torch.diag(torch.tensor([3.0, 1.0]))) == pytest.approx((9 + 1) / 9)
    assert stable_rank(torch.zeros(3, 4)) == 0.0
    assert stable_rank(torch.eye(4).reshape(4, 1, 2, 2)) == pytest.approx(4.0)  # conv reshape [out, in·k·k]
    torch.manual_seed(4)
    w = torch.randn(6, 2, 3, 3)
    s = svdvals(w.reshape(6, -1).numpy().astype(np.float64))  # the official code's scipy route
    assert stable_rank(w) == pytest.approx(np.sum(s**2) / s.max() ** 2, rel=1e-6)


def test_full_rank_and_ratio_ranks():
    model = _lenet()
    assert [full_rank(model.get_submodule(n)) for n in ("conv1", "conv2", "fc1", "fc2")] == [9, 64, 128, 10]
    assert rank_for_ratio(model.conv2) == 16 and rank_for_ratio(model.fc1) == 32
    assert rank_for_ratio(model.conv1, 1 / 3) == 3  # exact 9/3, not floor(2.999…)
    assert rank_for_ratio(nn.Linear(3, 3)) == 1  # floor(3/4) = 0 → at least 1
    assert full_rank(FactorizedConv2d(32, 64, 3, rank=5)) == 64


def test_scaled_stable_rank_rank():
    w0 = torch.diag(torch.tensor([1.0, 1.0, 0.5] + [0.0] * 9))  # srank 2.25, floored to 2
    xi = rank_scale(w0)
    assert xi == pytest.approx(12 / 2)
    w = torch.diag(torch.tensor([1.0] * 1 + [0.6] + [0.0] * 10))  # srank 1.36 → 1 → ⌈6·1⌉ = 6
    assert scaled_stable_rank_rank(w, xi) == 6
    assert scaled_stable_rank_rank(torch.eye(12), xi) == 12  # ⌈6·12⌉ = 72 capped at full rank 12


# ---------------------------------------------------------------------------------------- Cuttlefish


def _with_srank(n: int, srank: float, seed: int) -> torch.Tensor:
    """An n×n matrix whose stable rank is `srank` (kept off integers so the floor is unambiguous)."""
    whole, frac = int(srank), srank - int(srank)
    s = torch.tensor([1.0] * whole + [math.sqrt(frac)] + [0.0] * (n - whole - 1), dtype=torch.float64)
    g = torch.Generator().manual_seed(seed)
    q1, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    q2, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    return (q1 * s) @ q2.T


def _net(n: int = 32, layers: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, n), *[nn.Linear(n, n) for _ in range(layers)], nn.Linear(n, 3))


def _set(net: nn.Sequential, index: int, srank: float, seed: int) -> None:
    with torch.no_grad():
        net[index].weight.copy_(_with_srank(net[index].weight.shape[0], srank, seed))


def _oracle_flat(history: list[int], limit: float, window: int = 15, tail: int = 11) -> bool:
    """Official rule re-derived: EMA by an IIR filter, slopes by hand-written differences."""
    if len(history) - 1 < window:
        return False
    a = 2 / (window + 1)
    x = np.asarray(history, dtype=float)
    ema, _ = lfilter([a], [1, a - 1], x, zi=[(1 - a) * x[0]])
    slope = np.empty_like(ema)
    slope[0], slope[-1] = ema[1] - ema[0], ema[-1] - ema[-2]
    slope[1:-1] = (ema[2:] - ema[:-2]) / 2
    return np.abs(slope)[-tail:].mean() <= limit


def test_tracker_waits_min_rounds_on_a_constant_curve():
    net = _net()
    _set(net, 1, 10.5, seed=0)
    tracker = CuttlefishTracker(net)
    assert tracker.names == ["1"]
    switched = [tracker.update(net) for _ in range(20)]
    # official: epoch ≥ 15 with epoch 0 the first point → the 16th update (index 15) is the first that may switch
    assert switched == [False] * 15 + [True] * 5


def test_tracker_switches_only_once_the_curve_flattens():
    net = _net(n=32)
    _set(net, 1, 16.5, seed=0)  # ⌊srank⌋ = 16 at init → ξ = 32/16 = 2
    tracker = CuttlefishTracker(net)
    assert tracker.xi == [pytest.approx(2.0)]
    changing = [16.25 - 0.5 * t for t in range(20)]  # 16.25 → 6.75, one unit every two rounds
    flat = [6.5] * 40
    decisions, history = [], []
    for t, s in enumerate(changing + flat):
        _set(net, 1, s, seed=t + 1)
        history.append(math.floor(s))
        decisions.append(tracker.update(net))
        assert decisions[-1] == any(_oracle_flat(history[: k + 1], 0.2) for k in range(len(history)))
    assert tracker.history == [history]
    assert not any(decisions[: len(changing)])  # never while the rank is moving
    first = decisions.index(True)
    assert len(changing) < first < len(changing) + 40 and all(decisions[first:])
    assert tracker.ranks() == {"1": math.ceil(2.0 * 6)}  # ⌈ξ·⌊6.5⌋⌉ = 12


def test_tracker_caps_ranks_at_full_rank():
    net = _net(n=16)
    _set(net, 1, 2.5, seed=0)  # ξ = 16/2 = 8
    tracker = CuttlefishTracker(net)
    _set(net, 1, 5.5, seed=1)
    tracker.update(net)
    assert tracker.ranks() == {"1": 16}  # ⌈8·5⌉ = 40 → 16
    _set(net, 1, 1.5, seed=2)
    tracker.update(net)
    assert tracker.ranks() == {"1": 8}


def test_tracker_threshold_loosens_when_few_layers_remain():
    """Layer A is constant; B climbs one unit every 5 rounds, a mean slope between 0.1 and 0.2.

    With both unstable the limit is 0.1; once only B is left it is 0.1·2·scaler (scaler 1.0 → 0.2).
    """
    b_curve = [10.5 + (t // 5) for t in range(40)]
    b_hist = [math.floor(s) for s in b_curve]
    slope_15 = _oracle_flat(b_hist[:16], 0.2), _oracle_flat(b_hist[:16], 0.1)
    assert slope_15 == (True, False)  # the premise: B passes 0.2 but not 0.1 at round 15

    net = _net(n=24, layers=2)
    _set(net, 1, 8.5, seed=0)
    _set(net, 2, 10.5, seed=1)
    tracker = CuttlefishTracker(net)
    assert tracker.names == ["1", "2"]
    decisions = []
    for t, s in enumerate(b_curve[:17]):
        _set(net, 1, 8.5, seed=100 + t)
        _set(net, 2, s, seed=200 + t)
        decisions.append(tracker.update(net))
    # round 15: A stable, B tested against 0.1 (2 remained) → not yet; round 16: B alone → 0.2
    assert decisions[15] is False and tracker.stable == [True, True] and decisions[16] is True

    lone = CuttlefishTracker(net, layers=["2"])
    lone_decisions = []
    for t, s in enumerate(b_curve[:16]):
        _set(net, 2, s, seed=300 + t)
        lone_decisions.append(lone.update(net))
    assert lone_decisions[15] is True


def test_tracker_state_round_trips_through_json():
    net = _net(n=16, layers=2)
    _set(net, 1, 3.5, seed=0)
    _set(net, 2, 5.5, seed=1)
    a = CuttlefishTracker(net)
    curve = [3.5 + 0.25 * min(t, 12) for t in range(35)]
    for t in range(10):
        _set(net, 1, curve[t], seed=10 + t)
        a.update(net)
    b = CuttlefishTracker(_net(n=16, layers=2))
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert b.state_dict() == a.state_dict()
    for t in range(10, 35):
        _set(net, 1, curve[t], seed=10 + t)
        assert a.update(net) == b.update(net)
        assert a.ranks() == b.ranks()
    assert a.should_switch()


def test_tracker_without_layers_never_switches():
    model = mlp((1, 8, 8), 10, MlpParams(hidden=[16]))
    tracker = CuttlefishTracker(model)
    assert tracker.names == [] and tracker.ranks() == {}
    assert not any(tracker.update(model) for _ in range(20))


# --------------------------------------------------------------------------- layers and architectures


def test_factorizable_layers_keep_first_and_last():
    assert factorizable_layers(_mlp()) == ["3"]  # Flatten, [1] Linear, ReLU, [3] Linear, ReLU, [5] Linear
    assert factorizable_layers(mlp((1, 8, 8), 10, MlpParams(hidden=[16]))) == []
    assert factorizable_layers(_lenet()) == ["conv2", "fc1"]
    assert factorizable_layers(_lenet(), skip_first=2) == ["fc1"]
    assert factorizable_layers(_lenet(), skip_first=False, skip_last=False) == ["conv1", "conv2", "fc1", "fc2"]
    # VGG-9 Sequential: conv at 0,3,6,8,11,13,16,18 (pools and ReLUs between), FC at 23
    assert factorizable_layers(_vgg9()) == ["3", "6", "8", "11", "13", "16", "18"]
    assert factorizable_layers(factorize(_lenet(), {"conv2": 4, "fc1": 8})) == []  # u/v are not layers


@pytest.mark.parametrize("builder,shape", [(_mlp, (2, 1, 8, 8)), (_lenet, (2, 1, 28, 28)), (_vgg9, (2, 3, 32, 32))])
def test_client_architecture_loads_server_weights(builder, shape):
    server_model = builder()
    ranks = {n: rank_for_ratio(server_model.get_submodule(n)) for n in factorizable_layers(server_model)}
    server = factorize(server_model, ranks)
    client = build_factorized(builder, ranks)
    s_state, c_state = server.state_dict(), client.state_dict()
    assert [(k, v.shape) for k, v in s_state.items()] == [(k, v.shape) for k, v in c_state.items()]
    client.load_state_dict(s_state)
    x = torch.randn(*shape)
    with torch.no_grad():
        torch.testing.assert_close(client.eval()(x), server(x))


# ------------------------------------------------------------------------------------------- counts


def test_lenet_parameter_counts_by_hand():
    model = _lenet()
    conv1, conv2 = 32 * 1 * 9 + 32, 64 * 32 * 9 + 64  # 320, 18496
    fc1, fc2 = 128 * 9216 + 128, 10 * 128 + 10  # 1179776, 1290
    full = conv1 + conv2 + fc1 + fc2
    assert parameter_count(model) == full == 1_199_882
    # ratio 1/4: conv2 rank 64/4 = 16 → 16·(32·9) + 64·16 + 64; fc1 rank 128/4 = 32 → 32·9216 + 128·32 + 128
    conv2_low = 16 * 288 + 64 * 16 + 64  # 5696
    fc1_low = 32 * 9216 + 128 * 32 + 128  # 299136
    low = conv1 + conv2_low + fc1_low + fc2
    assert low == 306_442
    ranks = {"conv2": rank_for_ratio(model.conv2, 0.25), "fc1": rank_for_ratio(model.fc1, 0.25)}
    assert ranks == {"conv2": 16, "fc1": 32}
    assert parameter_count(factorize(model, ranks)) == low
    assert compression_of(model, ranks) == pytest.approx(low / full)
