"""Edge copies of the global model (evaluation.edge_model, fedsim/models/edge_copy.py) against oracles:
fp16 within half-precision tolerance, int8 dynamic quantization against a hand computation of
PyTorch's documented per-tensor scheme, L1 pruning against a sort, the attacker's differentiable
int8 simulation against the real int8 model; and in a run: fp32 metrics unchanged by the copies,
the same numbers with and without the overlapped evaluation, the fields of rounds.jsonl and
summary.json, and the refusals."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from torch import nn

from conftest import quick_scenario, run_local
from fedsim.models.edge_copy import EdgeCopyError, differentiable, edge_copy, prunable
from fedsim.models.nets import LeNet
from fedsim.scenario import EdgeCopySection, ScenarioError
from fedsim.server.evaluation import CentralEvaluator
from fedsim.server.record import without_times

# torch 2.13 warns on every quantized tensor and observer it creates (fedsim/models/edge_copy.py filters them in runs)
pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning"),
              pytest.mark.filterwarnings("ignore:Please use quant_min and quant_max:UserWarning")]


def _lenet(seed=0):
    torch.manual_seed(seed)
    return LeNet((1, 28, 28), 10).eval()


def test_fp16_copy_runs_in_half_precision_within_its_tolerance():
    model = _lenet()
    edge = edge_copy(model, EdgeCopySection(quantize="fp16"))
    assert all(p.dtype == torch.float16 for p in edge.net.parameters())
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the global model is left as it was
    x = torch.randn(32, 1, 28, 28)
    with torch.no_grad():
        want, got = model(x), edge(x)
    assert got.dtype == torch.float32
    # fp16 keeps 11 significant bits: a few ulps per layer of the logits' scale
    scale = want.abs().max().item()
    assert (got - want).abs().max().item() <= 8 * 2 ** -11 * scale
    assert not torch.equal(got, want)  # it really ran in fp16


def test_int8_linear_matches_a_hand_computation_of_per_tensor_dynamic_quantization():
    """Weights: symmetric qint8, scale max(|min|, |max|) / ((127 - (-128)) / 2), zero point 0
    (torch's default_weight_observer); the input: affine quint8 from its min/max with 0 included,
    over [0, 127] on fbgemm / x86 (reduce_range) and [0, 255] elsewhere; int32 products, scaled back."""
    torch.manual_seed(3)
    layer = nn.Linear(6, 4)
    edge = edge_copy(nn.Sequential(layer), EdgeCopySection(quantize="int8"))
    w, b = layer.weight.detach(), layer.bias.detach()
    s_w = (torch.maximum(-w.min(), w.max()) / 127.5).item()
    w_q = torch.clamp(torch.round(w / s_w), -128, 127)
    q = edge.net[0].weight()
    assert q.q_scale() == pytest.approx(s_w, rel=1e-6) and q.q_zero_point() == 0
    assert torch.equal(q.int_repr().float(), w_q)

    x = torch.randn(5, 6) * 2 + 0.5
    qmax = 127 if torch.backends.quantized.engine in ("fbgemm", "x86") else 255
    lo, hi = min(x.min().item(), 0.0), max(x.max().item(), 0.0)
    s_x = (hi - lo) / qmax
    z_x = int(np.clip(round(-lo / s_x), 0, qmax))
    x_q = torch.clamp(torch.round(x / s_x) + z_x, 0, qmax)
    want = ((x_q - z_x) @ w_q.T) * (s_x * s_w) + b
    with torch.no_grad():
        got = edge(x)
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
    assert not torch.allclose(got, layer(x).detach(), atol=1e-4)  # and it differs from the fp32 layer


def test_int8_copy_keeps_convolutions_in_fp32():
    edge = edge_copy(_lenet(), EdgeCopySection(quantize="int8"))
    assert type(edge.net.conv1) is nn.Conv2d and edge.net.conv1.weight.dtype == torch.float32
    assert isinstance(edge.net.fc1, torch.ao.nn.quantized.dynamic.Linear)
    assert isinstance(edge.net.fc2, torch.ao.nn.quantized.dynamic.Linear)


@pytest.mark.parametrize("scope", ["global", "layer"])
def test_pruning_zeroes_exactly_that_share_of_the_smallest_weights(scope):
    model = _lenet(1)
    edge = edge_copy(model, EdgeCopySection(prune=0.5, prune_scope=scope))
    before = [getattr(m, n).detach() for m, n in prunable(model)]
    after = [getattr(m, n).detach() for m, n in prunable(edge.net)]
    assert [t.shape for t in before] == [t.shape for t in after] and len(before) == 4
    if scope == "global":
        flat_b, flat_a = torch.cat([t.flatten() for t in before]), torch.cat([t.flatten() for t in after])
        zeroed = flat_a == 0
        assert zeroed.sum().item() == round(0.5 * flat_b.numel())
        assert flat_b[zeroed].abs().max() <= flat_b[~zeroed].abs().min()  # the smallest |w| over all layers
        assert torch.equal(flat_a[~zeroed], flat_b[~zeroed])  # the others untouched
    else:
        for b, a in zip(before, after):
            zeroed = a == 0
            assert zeroed.sum().item() == round(0.5 * b.numel())
            assert b[zeroed].abs().max() <= b[~zeroed].abs().min()
    for name in ("conv1.bias", "fc2.bias"):  # biases are not pruned
        assert torch.equal(edge.net.get_parameter(name), model.get_parameter(name))
    assert not any("_orig" in n or "_mask" in n for n, _ in edge.net.named_parameters())  # made permanent


def test_static_int8_copy_quantizes_convolutions_too_calibrated_on_the_given_inputs():
    model = _lenet(4)
    torch.manual_seed(5)
    calib, x = torch.randn(300, 1, 28, 28), torch.randn(64, 1, 28, 28)
    spec = EdgeCopySection(quantize="int8_static", calibration=200)
    edge = edge_copy(model, spec, calibration=calib)
    kinds = {type(m).__module__ for m in edge.net.modules()}
    assert any(k.startswith("torch.ao.nn.intrinsic.quantized") or k.startswith("torch.ao.nn.quantized.modules.conv")
               for k in kinds)  # the convolutions are int8 (fused with their ReLU)
    assert not any(isinstance(m, nn.Conv2d) for m in edge.net.modules())
    with torch.no_grad():
        want, got = model(x), edge(x)
    assert (got.argmax(1) == want.argmax(1)).float().mean() >= 0.9
    assert not torch.equal(got, want)
    with torch.no_grad():  # the same inputs calibrate the same copy; other ones another
        assert torch.equal(edge_copy(model, spec, calibration=calib)(x), got)
        assert not torch.equal(edge_copy(model, spec, calibration=calib[100:])(x), got)
        assert torch.equal(edge_copy(model, spec, calibration=torch.cat([calib[:200], x]))(x), got)  # its first 200 only


def test_static_int8_copy_is_refused_where_it_cannot_be_made():
    from fedsim.models.recurrent import LstmClassifier

    spec = EdgeCopySection(quantize="int8_static")
    with pytest.raises(EdgeCopyError, match=r"\.quantize: int8_static needs calibration"):
        edge_copy(_lenet(), spec)
    lstm = LstmClassifier(50, 8, 8, 1, 2, 0.0, False).eval()
    with pytest.raises(EdgeCopyError, match=r"evaluation\.edge_model\[0\]\.quantize: int8_static .* use int8"):
        edge_copy(lstm, spec, "evaluation.edge_model[0]", calibration=torch.randn(4, 10))
    with pytest.raises(EdgeCopyError, match="token ids"):
        edge_copy(lstm, spec, calibration=torch.zeros(4, 10, dtype=torch.long))
    with pytest.raises(EdgeCopyError, match="no differentiable simulation"):
        differentiable(edge_copy(_lenet(), spec, calibration=torch.randn(8, 1, 28, 28)))


def test_pruned_then_quantized_copy():
    """Pruned first, then quantized (a deployment pipeline's order): the pruned zeros stay zeros."""
    model = _lenet()
    pruned = edge_copy(model, EdgeCopySection(prune=0.5)).net
    edge = edge_copy(model, EdgeCopySection(prune=0.5, quantize="int8")).net
    for name in ("fc1", "fc2"):
        zeros = getattr(pruned, name).weight == 0
        assert zeros.any() and (getattr(edge, name).weight().int_repr()[zeros] == 0).all()


def test_differentiable_int8_simulation_is_the_int8_model_on_one_input():
    """What DIVA differentiates: the int8 copy as a device runs it, one input at a time."""
    model = _lenet(2)
    edge = edge_copy(model, EdgeCopySection(quantize="int8"))
    sim = differentiable(edge)
    x = torch.randn(12, 1, 28, 28)
    with torch.no_grad():
        one = torch.cat([edge(x[i : i + 1]) for i in range(len(x))])
    out = sim(x.requires_grad_(True))
    assert torch.allclose(out, one, atol=1e-5)
    out[:, 0].sum().backward()
    assert x.grad.abs().sum() > 0  # straight-through gradient reaches the input


def _batchnorm_resnet():
    from fedsim.models.resnet import ResNet20Params, resnet20

    torch.manual_seed(6)
    model = resnet20((3, 32, 32), 10, ResNet20Params())
    model.train()
    with torch.no_grad():  # running statistics of their own, so that eval mode is not the identity
        model(torch.randn(64, 3, 32, 32) * 2 + 0.3)
    return model.eval()


def _lowrank_lenet():
    from fedsim.lowrank.layers import FACTORIZED, factorizable_layers, factorize, rank_for_ratio

    model = _lenet(7)
    low = factorize(model, {n: rank_for_ratio(model.get_submodule(n)) for n in factorizable_layers(model)})
    assert any(isinstance(m, FACTORIZED) for m in low.modules())
    return low.eval()


@pytest.mark.parametrize("make", [_batchnorm_resnet, _lowrank_lenet], ids=["batchnorm_resnet20", "lowrank_lenet"])
def test_every_copy_of_batchnorm_and_low_rank_models(make):
    """BatchNorm (kept whole by pruning, folded into the convolutions by static int8) and Pufferfish's
    factorized layers (two Linear / Conv2d each: pruned and quantized like any other)."""
    model = make()
    shape = (3, 32, 32) if make is _batchnorm_resnet else (1, 28, 28)
    torch.manual_seed(8)
    x, calib = torch.randn(32, *shape), torch.randn(64, *shape)
    with torch.no_grad():
        want = model(x)
    for spec in (EdgeCopySection(quantize="int8"), EdgeCopySection(quantize="int8_static"), EdgeCopySection(quantize="fp16"),
                 EdgeCopySection(prune=0.5, quantize="int8")):
        edge = edge_copy(model, spec, calibration=calib)
        with torch.no_grad():
            got = edge(x)
        assert got.shape == want.shape and torch.isfinite(got).all(), spec.key()
        assert (got.argmax(1) == want.argmax(1)).float().mean() >= (0.5 if spec.prune else 0.8), spec.key()
    pruned = edge_copy(model, EdgeCopySection(prune=0.5)).net
    for name, buffer in model.named_buffers():  # BatchNorm statistics untouched
        assert torch.equal(pruned.get_buffer(name), buffer)


def test_an_edge_copy_that_cannot_be_made_is_refused_naming_the_field():
    convs = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten()).eval()
    with pytest.raises(EdgeCopyError, match=r"evaluation\.edge_model\[1\]\.quantize: int8"):
        edge_copy(convs, EdgeCopySection(quantize="int8"), "evaluation.edge_model[1]")
    with pytest.raises(EdgeCopyError, match=r"\.prune: .* no prunable weights"):
        edge_copy(nn.Sequential(nn.ReLU()), EdgeCopySection(prune=0.5))


def test_the_central_evaluator_refuses_a_copy_before_the_first_round():
    """The check runs on the initial model when the evaluator is built, not in round 1's evaluation."""
    scenario = quick_scenario(evaluation={"edge_model": [{"prune": 0.5}, {"quantize": "int8"}]})
    runtime = type("Runtime", (), {"scenario": scenario, "attack": None,
                                   "data": type("Data", (), {"x_test": np.zeros((4, 1, 8, 8), np.float32),
                                                             "y_test": np.zeros(4, np.int64)})()})()
    convs = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten()).eval()
    with pytest.raises(EdgeCopyError, match=r"evaluation\.edge_model\[1\]\.quantize"):
        CentralEvaluator(runtime, reference=convs)


def test_schema_names_copies_and_refuses_empty_or_twice_named_ones():
    sc = quick_scenario(evaluation={"edge_model": {"quantize": "int8"}})  # one mapping: a list of one
    assert [c.key() for c in sc.evaluation.edge_model] == ["int8"]
    sc = quick_scenario(evaluation={"edge_model": [{"prune": 0.5}, {"prune": 0.25, "quantize": "fp16", "prune_scope": "layer"},
                                                   {"name": "device", "quantize": "int8", "prune": 0.5}]})
    assert [c.key() for c in sc.evaluation.edge_model] == ["prune50", "prune25_layer_fp16", "device"]
    assert quick_scenario(evaluation={"edge_model": {"quantize": "int8_static"}}).evaluation.edge_model[0].key() == "int8_static"
    with pytest.raises(ScenarioError, match="changes nothing"):
        quick_scenario(evaluation={"edge_model": [{}]})
    with pytest.raises(ScenarioError, match="two edge copies are named int8"):
        quick_scenario(evaluation={"edge_model": [{"quantize": "int8"}, {"quantize": "int8"}]})
    with pytest.raises(ScenarioError, match=r"edge_model\.0\.quantize"):
        quick_scenario(evaluation={"edge_model": [{"quantize": "int4"}]})


EDGE = "evaluation.edge_model=[{quantize: int8}, {quantize: fp16}, {prune: 0.5}, {quantize: int8_static, calibration: 100}]"
RUN = ["federation.rounds=3", "federation.num_clients=8", "federation.clients_per_round=4",
       "attack.schedule.every=2", "attack.schedule.first=1"]


def test_a_run_with_edge_copies(tmp_path):
    """The fp32 numbers are those of a run without copies; the copies' numbers are the same with
    the evaluation overlapped or in line (so: same seed, same numbers); the summary's gaps add up."""
    plain = run_local(quick_scenario(*RUN, base="scenarios/quickstart.yaml"), tmp_path / "plain")
    edged = run_local(quick_scenario(*RUN, EDGE, base="scenarios/quickstart.yaml"), tmp_path / "edge")
    inline = run_local(quick_scenario(*RUN, EDGE, "evaluation.overlap=false", base="scenarios/quickstart.yaml"),
                       tmp_path / "inline")
    stripped = [{k: v for k, v in line.items() if k != "edge_model"} for line in without_times(edged.rounds)]
    assert stripped == without_times(plain.rounds)
    assert without_times(inline.rounds) == without_times(edged.rounds)

    for line in edged.rounds:
        copies = line["edge_model"]
        assert set(copies) == {"int8", "fp16", "prune50", "int8_static"}
        for got in copies.values():
            assert {"main_accuracy", "main_loss", "agreement", "backdoor_success", "backdoor_success_beyond_clean",
                    "source_class_accuracy"} <= set(got)
            assert 0 <= got["main_accuracy"] <= 1 and 0 <= got["agreement"] <= 1
            assert got["backdoor_success"] is not None
        assert copies["fp16"]["agreement"] >= 0.99
    assert any(line["edge_model"]["prune50"]["agreement"] < 1 for line in edged.rounds)  # pruning half moves predictions

    summary = edged.summary["edge_model"]
    assert "edge_model" not in plain.summary
    assert summary["int8"]["quantized_engine"] == torch.backends.quantized.engine
    last = edged.rounds[-1]
    for name, fig in summary.items():
        assert fig["final_main_accuracy"] == last["edge_model"][name]["main_accuracy"]
        assert fig["peak_backdoor_success"] == max(r["edge_model"][name]["backdoor_success"] for r in edged.rounds)
        assert fig["gap"]["final_main_accuracy"] == pytest.approx(fig["final_main_accuracy"] - last["main_accuracy"])
        assert fig["gap"]["final_backdoor_success"] == pytest.approx(fig["final_backdoor_success"] - last["backdoor_success"])


# ------------------------------------------------------------------ DIVA vs PGD (fedsim/evasion/diva.py)


@functools.lru_cache(maxsize=1)
def _digits_mlp():
    """An MLP trained on 1,400 of scikit-learn's digits, and the other 397 as the attacked set."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x, y = torch.tensor(d.data / 16, dtype=torch.float32), torch.tensor(d.target)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    opt = torch.optim.Adam(model.parameters(), 1e-2)
    for _ in range(300):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[:1400]), y[:1400]).backward()
        opt.step()
    return model.eval(), x[1400:], y[1400:]


def test_attacks_stay_within_the_budget_and_the_valid_range():
    from fedsim.evasion.diva import attack_batch

    model, x, y = _digits_mlp()
    sim = differentiable(edge_copy(model, EdgeCopySection(quantize="int8")))
    for method in ("diva", "pgd"):
        adv = attack_batch(method, model, sim, x[:64], y[:64], eps=0.1, step=0.03, steps=10, lo=0.0, hi=1.0)
        assert (adv - x[:64]).abs().max() <= 0.1 + 1e-6
        assert adv.min() >= 0 and adv.max() <= 1
        assert not torch.equal(adv, x[:64])


def test_diva_cannot_separate_a_copy_that_equals_the_original():
    """A copy that prunes nothing (round(1e-6 n) = 0 weights): DIVA's loss has no gradient, so it
    does not move, and no attack can fool one model and not the other."""
    from fedsim.evasion.diva import evasion

    model, x, y = _digits_mlp()
    same = edge_copy(model, EdgeCopySection(prune=1e-6))
    got = evasion(model, same, x[:100], y[:100], eps=0.1, step=0.02, steps=10, lo=0.0, hi=1.0)
    assert got["diva"]["max_perturbation"] == 0 and got["diva"]["edge_success"] == 0
    assert got["pgd"]["edge_success"] > 0 and got["pgd"]["undetected"] == 0


@pytest.mark.parametrize("copy", [{"quantize": "int8"}, {"prune": 0.5}])
def test_diva_evades_the_original_more_often_than_pgd(copy):
    """The paper's finding (§6.7): PGD fools the edge model more often, but DIVA's successes are far
    more often undetected by the original model."""
    from fedsim.evasion.diva import evasion

    model, x, y = _digits_mlp()
    got = evasion(model, edge_copy(model, EdgeCopySection(**copy)), x, y, eps=0.1, step=0.0125, steps=20, lo=0.0, hi=1.0)
    diva, pgd = got["diva"], got["pgd"]
    assert got["qualified"] > 300
    assert pgd["edge_success"] > diva["edge_success"] > 0
    assert diva["undetected_of_success"] > pgd["undetected_of_success"]
    assert diva["original_fooled"] < pgd["original_fooled"]


def test_diva_refuses_token_inputs():
    from fedsim.evasion.diva import evasion

    model = nn.Sequential(nn.Embedding(10, 4), nn.Flatten(), nn.Linear(12, 2)).eval()
    with pytest.raises(ValueError, match="token ids"):
        evasion(model, edge_copy(model, EdgeCopySection(prune=0.5)), torch.zeros(4, 3, dtype=torch.long),
                torch.zeros(4, dtype=torch.long), eps=0.1, step=0.1, steps=1)


# ------------------------------------------------------------------ a backdoor only the copy shows (attacks/edge_backdoor.py)


@pytest.mark.parametrize("scope", ["global", "layer"])
def test_the_attackers_pruned_forward_is_the_pruned_copy(scope):
    from fedsim.models.edge_copy import pruned_forward

    model, x = _lenet(9), torch.randn(16, 1, 28, 28)
    with torch.no_grad():
        want = edge_copy(model, EdgeCopySection(prune=0.5, prune_scope=scope))(x)
    got = pruned_forward(model, x, 0.5, scope)
    assert torch.equal(got.detach(), want)
    got.sum().backward()  # the kept weights get gradient, the pruned ones none
    kept = edge_copy(model, EdgeCopySection(prune=0.5, prune_scope=scope)).net.fc1.weight != 0
    assert (model.fc1.weight.grad[~kept] == 0).all() and model.fc1.weight.grad[kept].abs().sum() > 0


def test_the_attackers_int8_simulation_is_the_int8_copy_on_one_input():
    from fedsim.models.edge_copy import int8_simulation

    model, x = _lenet(10), torch.randn(6, 1, 28, 28)
    edge = edge_copy(model, EdgeCopySection(quantize="int8"))
    with torch.no_grad():
        one = torch.cat([edge(x[i : i + 1]) for i in range(len(x))])
    with int8_simulation(model):
        got = model(x)
    assert torch.allclose(got, one, atol=1e-5)
    assert not torch.allclose(model(x), one, atol=1e-5)  # the layers' own forwards are back


def test_a_backdoor_planted_through_fl_that_only_the_pruned_copy_shows(tmp_path):
    """One attacker every round, unscaled, on digits: the fp32 global model (what the server and its
    defenses see) barely has the backdoor; its 50%-pruned copy does."""
    attack = ("attack={name: edge_backdoor, edge: prune, prune: 0.5, size: 2, target_class: 0, num_attackers: 1, "
              "local_epochs: 5, schedule: {name: fixed_frequency, every: 1, first: 1}}")
    run = run_local(quick_scenario("federation.rounds=12", attack, "evaluation.edge_model=[{prune: 0.5}]",
                                   base="scenarios/quickstart.yaml"), tmp_path)
    last = run.rounds[-1]
    assert last["main_accuracy"] > 0.9 and last["edge_model"]["prune50"]["main_accuracy"] > 0.9
    assert last["backdoor_success"] < 0.05
    assert last["edge_model"]["prune50"]["backdoor_success"] > last["backdoor_success"] + 0.15
    assert run.summary["edge_model"]["prune50"]["gap"]["final_backdoor_success"] > 0.15
