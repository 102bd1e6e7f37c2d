"""Low-rank factorized layers and the Pufferfish / Cuttlefish rank rules (spec §4.1, §4.2).

A dense weight W [out, in·k·k] is replaced by U Vᵀ with U [out, r] and V [in·k·k, r]:
- FC: `v = Linear(in, r, bias=False)` then `u = Linear(r, out, bias)`, so y = (x V) Uᵀ + b.
- Conv: a k×k conv in → r (no bias, the original stride/padding/dilation) then a 1×1 conv r → out
  (with the original bias), as in Pufferfish. Pufferfish's optional BatchNorm between the two convs
  ("extra BNs") is not used: the networks here have no BatchNorm, and Cuttlefish's recipe turns it off.
  (The official code calls the k×k conv `_u` and the 1×1 conv `_v`; here `v` is the one that reads the
  input and `u` the one that writes the output, matching W ≈ U Vᵀ.)

Everything here is pure: the server decides the ranks and when to switch, and broadcasts the ranks so
that clients rebuild the same architecture with `build_factorized` and load the broadcast weights.
"""

from __future__ import annotations

import copy
import math
from fractions import Fraction
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

DENSE = (nn.Linear, nn.Conv2d)


# --------------------------------------------------------------------------------------------------
# Layers


class FactorizedLinear(nn.Module):
    """y = (x V) Uᵀ + b: two plain Linear layers, so the state dict holds ordinary tensors."""

    def __init__(self, in_features: int, out_features: int, rank: int, bias: bool = True) -> None:
        super().__init__()
        _check_rank(rank, min(in_features, out_features))
        self.in_features, self.out_features, self.rank = in_features, out_features, rank
        self.v = nn.Linear(in_features, rank, bias=False)
        self.u = nn.Linear(rank, out_features, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.u(self.v(x))


class FactorizedConv2d(nn.Module):
    """k×k conv in → r (no bias) then 1×1 conv r → out (with bias), Pufferfish's conv factorization."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | tuple[int, int],
        rank: int,
        stride: int | tuple[int, int] = 1,
        padding: int | tuple[int, int] | str = 0,
        bias: bool = True,
        dilation: int | tuple[int, int] = 1,
    ) -> None:
        super().__init__()
        kh, kw = (kernel_size, kernel_size) if isinstance(kernel_size, int) else kernel_size
        _check_rank(rank, min(out_channels, in_channels * kh * kw))
        self.in_channels, self.out_channels, self.rank = in_channels, out_channels, rank
        self.v = nn.Conv2d(in_channels, rank, (kh, kw), stride, padding, dilation, bias=False)
        self.u = nn.Conv2d(rank, out_channels, 1, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.u(self.v(x))


FACTORIZED = (FactorizedLinear, FactorizedConv2d)


def _check_rank(rank: int, full: int) -> None:
    if not 1 <= rank <= full:
        raise ValueError(f"rank {rank} outside [1, {full}] (the layer's full rank)")


# --------------------------------------------------------------------------------------------------
# Ranks


def _as_matrix(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] or [out, in, k, k] -> [out, in·k·k], the reshape both papers factorize."""
    return weight.detach().reshape(weight.shape[0], -1)


def _tall(matrix: torch.Tensor) -> torch.Tensor:
    """The matrix or its transpose, whichever has more rows: LAPACK's SVD is several times faster so."""
    return matrix if matrix.shape[0] >= matrix.shape[1] else matrix.T.contiguous()


def dense_weight(module: nn.Module) -> torch.Tensor:
    """The layer's weight as a dense [out, in·k·k] matrix (U Vᵀ for a factorized layer)."""
    if isinstance(module, FACTORIZED):
        return _as_matrix(module.u.weight) @ _as_matrix(module.v.weight)
    if isinstance(module, DENSE):
        return _as_matrix(module.weight)
    raise TypeError(f"not a Linear/Conv2d layer: {type(module).__name__}")


def full_rank(module: nn.Module | torch.Tensor) -> int:
    """min(out, in·k·k): the largest rank the layer's weight matrix can have."""
    if isinstance(module, FACTORIZED):
        w = module.v.weight
        return min(module.u.weight.shape[0], w[0].numel())
    weight = module if isinstance(module, torch.Tensor) else module.weight
    return min(weight.shape[0], weight[0].numel())


def stable_rank(weight: torch.Tensor) -> float:
    """srank(W) = ‖W‖_F² / ‖W‖₂² = Σσ² / σ_max² on the [out, in·k·k] reshape.

    Uses torch.linalg.svdvals in float64; the official Cuttlefish code calls scipy's svdvals on the same
    reshape, which gives the same singular values to float precision. A zero matrix has srank 0.
    """
    s = torch.linalg.svdvals(_tall(_as_matrix(weight).to(torch.float64)))
    top = float(s.max()) if s.numel() else 0.0
    return float((s**2).sum()) / top**2 if top > 0 else 0.0


def estimated_rank(weight: torch.Tensor) -> int:
    """⌊srank(W)⌋: Cuttlefish rounds the stable rank down (`int(...)`) before using it anywhere."""
    return math.floor(stable_rank(weight))


def rank_scale(weight_init: torch.Tensor) -> float:
    """ξ = full_rank / ⌊srank(W_init)⌋, computed once on the initial weights (random init has a low srank)."""
    return full_rank(weight_init) / max(estimated_rank(weight_init), 1)


def scaled_stable_rank_rank(weight: torch.Tensor, xi: float) -> int:
    """Cuttlefish's rank r = min(full_rank, ⌈ξ · ⌊srank(W)⌋⌉), at least 1.

    The floor inside follows the official code (it floors srank before scaling). The official cap test is
    `int(ξ·s) > full`, which lets ⌈ξ·s⌉ = full + 1 through when full < ξ·s < full + 1; here the rank is
    simply capped at full rank, as the paper states.
    """
    return _scaled_rank(full_rank(weight), xi, estimated_rank(weight))


def _scaled_rank(full: int, xi: float, est: int) -> int:
    return max(1, min(full, math.ceil(xi * est)))


def rank_for_ratio(module: nn.Module | torch.Tensor, ratio: float = 0.25) -> int:
    """Pufferfish's fixed rank ⌊full_rank · ratio⌋ (ratio 1/4 = `--rank-factor 4`), at least 1.

    The ratio is read as an exact fraction so that, e.g., 1/3 of 9 is 3 and not 2.999… floored to 2.
    """
    if not 0 < ratio <= 1:
        raise ValueError(f"rank ratio must be in (0, 1], got {ratio}")
    exact = Fraction(ratio).limit_denominator(1_000_000)
    return max(1, math.floor(full_rank(module) * exact))


# --------------------------------------------------------------------------------------------------
# Which layers, and building factorized models


def factorizable_layers(model: nn.Module, skip_first: int | bool = True, skip_last: int | bool = True) -> list[str]:
    """Names of the Linear/Conv2d layers to factorize, in registration order (= forward order here).

    Both papers keep the first and last layers full rank (factorizing them saves little and costs
    accuracy). `skip_first`/`skip_last` may also be an int K: keep the first/last K layers, which is
    Cuttlefish's "first K layers stay full rank". Grouped convs are never factorized.
    """
    names = [
        name
        for name, m in model.named_modules()
        if isinstance(m, DENSE) and not _inside_factorized(model, name) and getattr(m, "groups", 1) == 1
    ]
    first, last = int(skip_first), int(skip_last)
    return names[first : len(names) - last] if first + last < len(names) else []


def _inside_factorized(model: nn.Module, name: str) -> bool:
    parts = name.split(".")
    return any(isinstance(model.get_submodule(".".join(parts[:i])), FACTORIZED) for i in range(1, len(parts)))


def _fresh_factorized(module: nn.Module, rank: int) -> nn.Module:
    """A randomly initialised factorized layer with the same shape, bias and conv geometry as `module`."""
    bias = module.bias is not None
    if isinstance(module, nn.Linear):
        return FactorizedLinear(module.in_features, module.out_features, rank, bias)
    if isinstance(module, nn.Conv2d):
        if module.groups != 1 or module.padding_mode != "zeros":
            raise ValueError("only plain convs (groups=1, zero padding) can be factorized")
        return FactorizedConv2d(
            module.in_channels, module.out_channels, module.kernel_size, rank,
            module.stride, module.padding, bias, module.dilation,
        )
    raise TypeError(f"cannot factorize {type(module).__name__}; only nn.Linear and nn.Conv2d")


def _svd_factors(weight: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """U = Ũ_r Σ_r^{1/2} [out, r], V = Ṽ_r Σ_r^{1/2} [in·k·k, r]: the §4.1 warm-up initialisation.

    U Vᵀ is then the best rank-r approximation of W (Eckart–Young). Computed in float64.
    """
    w = _as_matrix(weight).to(torch.float64)
    if w.shape[0] >= w.shape[1]:
        u, s, vh = torch.linalg.svd(w, full_matrices=False)
        left, right = u, vh.T
    else:  # W = (Wᵀ)ᵀ = (Ũ Σ Ṽᵀ)ᵀ = Ṽ Σ Ũᵀ
        u, s, vh = torch.linalg.svd(_tall(w), full_matrices=False)
        left, right = vh.T, u
    root = s[:rank].sqrt()
    return left[:, :rank] * root, right[:, :rank] * root


def factorized_from(module: nn.Module, rank: int) -> nn.Module:
    """The factorized layer whose U Vᵀ is the truncated SVD of `module`'s weight; bias copied."""
    new = _fresh_factorized(module, rank).to(device=module.weight.device, dtype=module.weight.dtype)
    u, v = _svd_factors(module.weight, rank)
    with torch.no_grad():
        new.v.weight.copy_(v.T.reshape(new.v.weight.shape))
        new.u.weight.copy_(u.reshape(new.u.weight.shape))
        if module.bias is not None:
            new.u.bias.copy_(module.bias)
    return new.train(module.training)


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    """Swap a submodule in place (same slot in its parent, so state-dict key order is kept)."""
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


def factorize(model: nn.Module, ranks: dict[str, int]) -> nn.Module:
    """A deep copy of `model` with each named layer factorized at its rank by truncated SVD."""
    out = copy.deepcopy(model)
    for name, rank in ranks.items():
        _replace(out, name, factorized_from(out.get_submodule(name), int(rank)))
    return out


def build_factorized(builder: Callable[[], nn.Module], ranks: dict[str, int]) -> nn.Module:
    """A fresh factorized architecture from ranks alone, for clients that then load broadcast weights.

    Same state-dict keys and shapes as `factorize(builder(), ranks)`.
    """
    model = builder()
    for name, rank in ranks.items():
        old = model.get_submodule(name)
        _replace(model, name, _fresh_factorized(old, int(rank)).train(old.training))
    return model


# --------------------------------------------------------------------------------------------------
# Sizes


def parameter_count(model: nn.Module) -> int:
    """Number of trainable scalars (what travels each round)."""
    return sum(p.numel() for p in model.parameters())


def _factorized_count(module: nn.Module, rank: int) -> int:
    fan_in = module.weight[0].numel()
    bias = module.bias.numel() if module.bias is not None else 0
    return rank * fan_in + module.weight.shape[0] * rank + bias


def compression_of(model: nn.Module, ranks: dict[str, int]) -> float:
    """Parameters of the factorized model / parameters of the full one (counted, nothing is built)."""
    total = parameter_count(model)
    saved = 0
    for name, rank in ranks.items():
        layer = model.get_submodule(name)
        saved += sum(p.numel() for p in layer.parameters()) - _factorized_count(layer, int(rank))
    return (total - saved) / total


# --------------------------------------------------------------------------------------------------
# Cuttlefish's switching rule


def exponential_moving_average(signal: list[float] | np.ndarray, points: int, smoothing: float = 2.0) -> np.ndarray:
    """N-point EMA with weight smoothing/(points+1), started at the first value (as the official code)."""
    weight = smoothing / (points + 1)
    ema = np.zeros(len(signal))
    ema[0] = signal[0]
    for i in range(1, len(signal)):
        ema[i] = signal[i] * weight + ema[i - 1] * (1 - weight)
    return ema


class CuttlefishTracker:
    """Per-round rank estimates of the factorizable layers and Cuttlefish's "ranks have flattened" test.

    Official rule (`utils.layer_rank_stable_detector`), with epochs read as FL rounds:
    - ξ = full_rank / ⌊srank(W_init)⌋ per layer, from the model given to the constructor.
    - `update(model)` appends each layer's ⌊srank(W_t)⌋ (the unscaled stable rank, as the official
      history does) and re-tests every layer not yet stable. A layer is stable once the round index
      t = len(history) − 1 is ≥ `min_rounds` (official: epoch ≥ 15, with the first history point taken
      on the untrained model at epoch 0) and the mean of the last `tail` (11) values of
      |np.gradient(EMA_window(history))| is ≤ the threshold. Stability is sticky.
    - The threshold is `threshold` (0.1), × `threshold_scaler` when 2 layers remain unstable and
      × 2·`threshold_scaler` when 1 remains (counted before this update's tests). The official scaler is
      2.5 for ResNet-18/VGG-19 and 1.0 for every other architecture; 1.0 is the default here.
    - `should_switch()` is True once all layers are stable (official: switch at the next epoch, re-estimate
      there and factorize). `ranks()` gives min(full, ⌈ξ·⌊srank(W_t)⌋⌉) from the latest update, so the
      server can call `update` once more in the switch round and factorize with `ranks()`.
    A model with no factorizable layer never switches (there is nothing to factorize).
    """

    def __init__(
        self,
        model: nn.Module,
        layers: list[str] | None = None,
        window: int = 15,
        min_rounds: int | None = None,
        tail: int = 11,
        threshold: float = 0.1,
        threshold_scaler: float = 1.0,
        smoothing: float = 2.0,
        skip_first: int | bool = True,
        skip_last: int | bool = True,
    ) -> None:
        if window < 1 or tail < 1:
            raise ValueError("window and tail must be at least 1")
        self.window, self.tail, self.smoothing = window, tail, smoothing
        self.min_rounds = window if min_rounds is None else max(int(min_rounds), 1)
        self.threshold, self.threshold_scaler = threshold, threshold_scaler
        self.names = list(layers) if layers is not None else factorizable_layers(model, skip_first, skip_last)
        weights = [self._weight(model, n) for n in self.names]
        self.full = [full_rank(w) for w in weights]
        self.xi = [rank_scale(w) for w in weights]
        self.initial = [estimated_rank(w) for w in weights]
        self.history: list[list[int]] = [[] for _ in self.names]
        self.stable = [False for _ in self.names]

    @staticmethod
    def _weight(model: nn.Module, name: str) -> torch.Tensor:
        return dense_weight(model.get_submodule(name))

    def update(self, model: nn.Module) -> bool:
        """Record this round's stable ranks and re-test the unstable layers; returns should_switch()."""
        remaining = self.stable.count(False)
        for i, name in enumerate(self.names):
            self.history[i].append(estimated_rank(self._weight(model, name)))
            if not self.stable[i]:
                self.stable[i] = self._flat(self.history[i], remaining)
        return self.should_switch()

    def _limit(self, remaining: int) -> float:
        if remaining == 2:
            return self.threshold * self.threshold_scaler
        if remaining == 1:
            return self.threshold * self.threshold_scaler * 2
        return self.threshold

    def _flat(self, history: list[int], remaining: int) -> bool:
        if len(history) - 1 < self.min_rounds:
            return False
        smooth = exponential_moving_average(history, self.window, self.smoothing)
        slope = np.abs(np.gradient(smooth))
        return bool(np.mean(slope[-self.tail :]) <= self._limit(remaining))

    @property
    def rounds(self) -> int:
        """How many updates have been recorded."""
        return len(self.history[0]) if self.history else 0

    def should_switch(self) -> bool:
        return bool(self.names) and all(self.stable)

    def ranks(self) -> dict[str, int]:
        """Scaled-stable-rank ranks min(full, ⌈ξ·⌊srank⌋⌉) from the latest update (the init weights before any)."""
        latest = [h[-1] if h else e for h, e in zip(self.history, self.initial)]
        return {n: _scaled_rank(f, xi, e) for n, f, xi, e in zip(self.names, self.full, self.xi, latest)}

    def state_dict(self) -> dict[str, Any]:
        """Plain lists and numbers, for the server's checkpoints."""
        return {
            "names": list(self.names),
            "full": list(self.full),
            "xi": list(self.xi),
            "initial": list(self.initial),
            "history": [list(h) for h in self.history],
            "stable": list(self.stable),
            "window": self.window,
            "min_rounds": self.min_rounds,
            "tail": self.tail,
            "threshold": self.threshold,
            "threshold_scaler": self.threshold_scaler,
            "smoothing": self.smoothing,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.names = list(state["names"])
        self.full = [int(x) for x in state["full"]]
        self.xi = [float(x) for x in state["xi"]]
        self.initial = [int(x) for x in state["initial"]]
        self.history = [[int(x) for x in h] for h in state["history"]]
        self.stable = [bool(x) for x in state["stable"]]
        self.window, self.min_rounds, self.tail = int(state["window"]), int(state["min_rounds"]), int(state["tail"])
        self.threshold, self.threshold_scaler = float(state["threshold"]), float(state["threshold_scaler"])
        self.smoothing = float(state["smoothing"])
