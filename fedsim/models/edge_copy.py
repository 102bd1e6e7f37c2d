"""Edge copies: the global model as a device would run it after its deployment pipeline prunes and
quantizes it ("A Tale of Two Models", Hao et al., MLSys 2022), made with PyTorch's own utilities.

- prune (first): `torch.nn.utils.prune` L1 unstructured — `global_unstructured` over all prunable
  weights together, or `l1_unstructured` per tensor — then `prune.remove`, so the zeros are plain
  weights. Prunable: the weight matrices of Linear, Conv1d/2d/3d and LSTM layers (low-rank factors
  are Linear / Conv2d layers, so they count). Biases, BatchNorm and embeddings are left whole. PyTorch
  prunes `round(share × n)` entries, the smallest |w| (`torch.topk`).
- quantize int8 (then): `torch.ao.quantization.quantize_dynamic` with torch's default dynamic mapping
  on {Linear, LSTM}: weights int8, per tensor, symmetric (scale max(|min w|, |max w|) / 127.5, zero
  point 0: `default_weight_observer`); activations quantized to uint8 at run time from the min/max of
  each input *tensor* — a batch: an int8 copy's prediction for an input depends on the batch it comes
  in. The central evaluation feeds it the same batches (`evaluation.batch_size`) every round.
  Convolutions stay fp32 (int8_static quantizes them). The int8 kernels are CPU only (fbgemm / x86 /
  qnnpack: `torch.backends.quantized.engine`, written beside the numbers): an int8 copy runs on the
  CPU whatever `evaluation.device` says.
- quantize int8_static (then): torch.fx graph-mode static quantization (`prepare_fx` with torch's
  default qconfig mapping for the quantized engine, calibration passes, `convert_fx`): every
  Linear and convolution int8 (weights per channel), activations uint8 with ranges fixed by the
  calibration inputs — the central evaluation passes a fixed seeded subset of its own test set
  (`calibration` examples), so the copy is the same every time for the same model. Conv-BN-ReLU
  are fused as the engine would run them. Models torch.fx cannot trace (the LSTMs: control flow on
  the input) are refused. CPU only, as int8.
- quantize fp16 (then): `.half()` on parameters and buffers; float inputs are cast to fp16 and the
  logits back to fp32. torch (2.13) has CPU half-precision kernels for every layer of fedsim's
  models (tests/test_edge_model.py runs LeNet, ResNet-20 and a low-rank LeNet), so fp16 runs as
  fp16, on CPU too.

PyTorch marks eager-mode quantization deprecated in favour of torchao; it is still what torch ships
(2.13), and torchao is not a fedsim dependency.

The attacker's views, differentiable: `differentiable(copy)` for DIVA (fedsim/evasion/diva.py) — the
int8 copy's weights dequantized into an fp32 model whose quantized layers fake-quantize their inputs
per example with a straight-through gradient; `int8_simulation(model)` and `pruned_forward(model,
...)` for a backdoor only the copy shows (attacks/edge_backdoor.py) — the copy's computation on the
model's own, trainable weights. Each equals the real copy (one input at a time for int8: tests).
"""

from __future__ import annotations

import copy
import warnings

import torch
from torch import nn
from torch.nn.utils import prune as torch_prune

# Raised on every quantize_dynamic / prepare_fx call (torch 2.13): the eager API's deprecation notice,
# the quantized-tensor one and the observers' reduce_range one. The copies are made each evaluated
# round: docs/edge_model.md says it once instead.
warnings.filterwarnings("ignore", message=r"torch\.ao\.quantization is deprecated", category=DeprecationWarning)
warnings.filterwarnings("ignore", message=r"Please use quant_min and quant_max to specify the range for observers")
warnings.filterwarnings("ignore", message=r"torch\.quantize_per_tensor, torch\.quantize_per_channel", category=UserWarning)

QUANTIZED_LAYERS = (nn.Linear, nn.LSTM)  # what quantize_dynamic's default mapping covers among fedsim's layers
PRUNED_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.LSTM)


class EdgeCopyError(ValueError):
    """An edge copy that cannot be made of this model; the message names the scenario field."""


class EdgeModel(nn.Module):
    """A copy as a device runs it: float inputs cast to the copy's precision, fp32 logits out."""

    def __init__(self, net: nn.Module, key: str, quantize: str | None, input_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.net, self.key, self.quantize, self.input_dtype = net, key, quantize, input_dtype

    @property
    def cpu_only(self) -> bool:
        return self.quantize in ("int8", "int8_static")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_floating_point():
            x = x.to(self.input_dtype)
        return self.net(x).float()


def prunable(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """(module, parameter name) of every prunable weight, in module order."""
    out = []
    for module in model.modules():
        if isinstance(module, nn.LSTM):
            out += [(module, n) for n, _ in module.named_parameters(recurse=False) if n.startswith("weight_")]
        elif isinstance(module, PRUNED_LAYERS):
            out.append((module, "weight"))
    return out


def prune_(model: nn.Module, share: float, scope: str = "global", field: str = "prune") -> nn.Module:
    """Zero `share` of `model`'s prunable weights by L1 magnitude, in place, permanently."""
    params = prunable(model)
    if not params:
        raise EdgeCopyError(f"{field}: {type(model).__name__} has no prunable weights (Linear, conv or LSTM)")
    if scope == "global":
        torch_prune.global_unstructured(params, pruning_method=torch_prune.L1Unstructured, amount=share)
    else:
        for module, name in params:
            torch_prune.l1_unstructured(module, name, amount=share)
    for module, name in params:
        torch_prune.remove(module, name)
    if any(isinstance(m, nn.LSTM) for m, _ in params):
        for m in {id(m): m for m, _ in params if isinstance(m, nn.LSTM)}.values():
            m.flatten_parameters()  # the pruned weights are new tensors: re-pack them for the fused kernel
    return model


def edge_copy(model: nn.Module, spec, field: str = "evaluation.edge_model",
              calibration: torch.Tensor | None = None, batch_size: int = 256) -> EdgeModel:
    """The copy `spec` (an EdgeCopySection: quantize, prune, prune_scope, calibration, key()) of `model`
    on the CPU in eval mode; `model` is left as it is. `field` names the spec in errors.
    `calibration`: the inputs an int8_static copy calibrates on (its first `spec.calibration`),
    in batches of `batch_size`."""
    net = copy.deepcopy(model).cpu().eval()
    for p in net.parameters():
        p.requires_grad_(False)
    if spec.prune is not None:
        prune_(net, spec.prune, spec.prune_scope, f"{field}.prune")
    if spec.quantize == "int8":
        if not any(isinstance(m, QUANTIZED_LAYERS) for m in net.modules()):
            raise EdgeCopyError(f"{field}.quantize: int8 dynamic quantization quantizes Linear and LSTM layers; "
                                f"{type(model).__name__} has none")
        net = torch.ao.quantization.quantize_dynamic(net, set(QUANTIZED_LAYERS), dtype=torch.qint8)
        return EdgeModel(net, spec.key(), "int8")
    if spec.quantize == "int8_static":
        return EdgeModel(_static_int8(net, spec, field, calibration, batch_size, type(model).__name__), spec.key(),
                         "int8_static")
    if spec.quantize == "fp16":
        return EdgeModel(net.half(), spec.key(), "fp16", torch.float16)
    return EdgeModel(net, spec.key(), None)


def _static_int8(net: nn.Module, spec, field: str, calibration: torch.Tensor | None, batch_size: int,
                 model_name: str) -> nn.Module:
    from torch.ao.quantization import get_default_qconfig_mapping
    from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

    if calibration is None or not len(calibration):
        raise EdgeCopyError(f"{field}.quantize: int8_static needs calibration inputs (the evaluated test set)")
    if not calibration.is_floating_point():
        raise EdgeCopyError(f"{field}.quantize: int8_static calibrates float inputs; {model_name} takes token ids: "
                            "use int8 (dynamic)")
    calibration = calibration[: spec.calibration]
    try:
        prepared = prepare_fx(net, get_default_qconfig_mapping(torch.backends.quantized.engine),
                              example_inputs=(calibration[:1],))
    except Exception as err:  # noqa: BLE001  (torch.fx raises several kinds for a model it cannot trace)
        raise EdgeCopyError(f"{field}.quantize: int8_static traces the model with torch.fx, which {model_name} does not "
                            f"allow ({type(err).__name__}: {str(err)[:120]}); use int8 (dynamic)") from None
    with torch.no_grad():
        for i in range(0, len(calibration), batch_size):
            prepared(calibration[i : i + batch_size])
    return convert_fx(prepared)


# --------------------------------------------------------------------------------------------------
# The attacker's differentiable view (DIVA)


def _fake_input(x: torch.Tensor, qmax: int) -> torch.Tensor:
    flat = x.reshape(x.shape[0], -1)
    lo, hi = flat.detach().amin(1).clamp(max=0), flat.detach().amax(1).clamp(min=0)
    scale = ((hi - lo) / qmax).clamp(min=torch.finfo(torch.float32).eps)
    zero = (-lo / scale).round().clamp(0, qmax).to(torch.int32)
    return torch.fake_quantize_per_channel_affine(x, scale, zero, 0, 0, qmax)


class FakeDynamicLinear(nn.Module):
    """A dynamically quantized Linear as an fp32 layer: its int8 weights dequantized, its input
    fake-quantized to uint8 per example (straight-through gradient: torch's fake_quantize op),
    with the affine scale and zero point that dynamic quantization computes from min/max (range
    including 0; `reduce_range` halves it on fbgemm / x86, as torch's dynamic observer does)."""

    def __init__(self, q: nn.Module, reduce_range: bool) -> None:
        super().__init__()
        self.register_buffer("weight", q.weight().dequantize())
        bias = q.bias()
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.qmax = 127 if reduce_range else 255

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(_fake_input(x, self.qmax), self.weight, self.bias)


def differentiable(edge: EdgeModel) -> nn.Module:
    """An fp32 module with the copy's forward as the attacker simulates it, differentiable in its input.

    int8: each dynamically quantized Linear becomes a FakeDynamicLinear (above), per example where the
    device quantizes per batch (a device classifies one input at a time); quantized LSTMs are refused.
    fp16: the fp16 weights in fp32 (what the device multiplies, in fp32 arithmetic). Pruned: the copy.
    """
    from torch.ao.nn.quantized import dynamic as qd

    net = copy.deepcopy(edge.net)
    if edge.quantize == "fp16":
        return net.float()
    if edge.quantize == "int8_static":
        raise EdgeCopyError(f"{edge.key}: no differentiable simulation of a static int8 copy here (DIVA supports int8, "
                            "fp16 and pruned copies)")
    if edge.quantize != "int8":
        return net
    reduce_range = torch.backends.quantized.engine in ("fbgemm", "x86")
    for name, module in list(net.named_modules()):
        if isinstance(module, qd.LSTM):
            raise EdgeCopyError(f"{edge.key}: the int8 LSTM has no differentiable simulation here (DIVA needs one)")
        if isinstance(module, qd.Linear):
            parent, _, leaf = name.rpartition(".")
            setattr(net.get_submodule(parent) if parent else net, leaf, FakeDynamicLinear(module, reduce_range))
    return net



# --------------------------------------------------------------------------------------------------
# Training against a copy (an attacker's view: a backdoor only the copy shows, attacks/edge_backdoor.py)


def _fake_int8_weight(w: torch.Tensor) -> torch.Tensor:
    """w through torch's int8 weight quantization (per tensor, symmetric: scale max|w| / 127.5, zero
    point 0, [-128, 127]) with a straight-through gradient: what quantize_dynamic stores, in fp32."""
    scale = (w.detach().abs().max() / 127.5).clamp(min=torch.finfo(torch.float32).eps).reshape(1)
    return torch.fake_quantize_per_tensor_affine(w, scale, torch.zeros(1, dtype=torch.int32), -128, 127)


class int8_simulation:
    """`with int8_simulation(model):` the model's Linear layers compute as their int8 dynamic copy
    would — weights fake-quantized per tensor, inputs per example — on the model's own parameters,
    with straight-through gradients (quantization-aware training of the copy, as Qu-ANTI-zation's
    attacker trains). The layers' own forwards come back on exit."""

    def __init__(self, model: nn.Module) -> None:
        self.layers = [m for m in model.modules() if type(m) is nn.Linear]
        self.qmax = 127 if torch.backends.quantized.engine in ("fbgemm", "x86") else 255

    def __enter__(self) -> "int8_simulation":
        for layer in self.layers:
            def forward(x, layer=layer):
                return nn.functional.linear(_fake_input(x, self.qmax), _fake_int8_weight(layer.weight), layer.bias)
            layer.forward = forward
        return self

    def __exit__(self, *exc) -> None:
        for layer in self.layers:
            del layer.forward


def pruned_forward(model: nn.Module, x: torch.Tensor, share: float, scope: str = "global") -> torch.Tensor:
    """`model(x)` as its pruned copy computes it (`prune_` at `share` and `scope`), on the model's own
    parameters: the pruned weights' masks from their current magnitudes (detached), so the gradient
    reaches the weights the copy keeps and the pruned ones get none."""
    names = {id(p): n for n, p in model.named_parameters()}
    weights = [getattr(m, n) for m, n in prunable(model)]
    if scope == "global":
        flat = torch.cat([w.detach().abs().flatten() for w in weights])
        k = int(round(share * flat.numel()))
        limits = [flat.kthvalue(k).values if k else flat.new_tensor(-1.0)] * len(weights)
    else:
        limits = []
        for w in weights:
            k = int(round(share * w.numel()))
            limits.append(w.detach().abs().flatten().kthvalue(k).values if k else w.new_tensor(-1.0))
    masked = {names[id(w)]: w * (w.detach().abs() > t) for w, t in zip(weights, limits)}
    return torch.func.functional_call(model, masked, (x,))
