"""A feed-forward chain of layers as FedMA sees it: which layers are matched, how each layer feeds
the next, and how to rebuild the network at other hidden widths.

FedMA (§2.3) matches the neurons of every layer but the last, one layer at a time, and the global
layer may hold more neurons than any client's. Everything here works on plain state dicts
(`name -> numpy array`), so the same code runs in the ServerApp and in a ClientApp on a device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from fedsim.fedma.matching import Kind, neurons_of, permute_next_layer, slice_next_layer, slice_to_client, split_neurons
from fedsim.models.nets import resizable, resized

State = dict[str, np.ndarray]


@dataclass(frozen=True)
class Layer:
    weight: str
    bias: str
    kind: Kind  # "fc" or "conv": how its neurons are read


@dataclass(frozen=True)
class ChainArch:
    """Layers in forward order; `links[l]` says how layer l+1 consumes layer l's neurons."""

    model_name: str
    input_shape: tuple[int, ...]
    num_classes: int
    params: object
    layers: tuple[Layer, ...]
    links: tuple[tuple[Kind, int], ...]  # (kind, spatial block per input unit) for l = 0..K-1

    @classmethod
    def of(cls, model_name: str, input_shape, num_classes: int, params) -> "ChainArch":
        """Read the chain off the registered net at its default widths."""
        if model_name not in resizable():
            raise ValueError(f"FedMA needs a model it can resize; model.name={model_name!r} is not one of {resizable()}")
        model = resized_default(model_name, input_shape, num_classes, params)
        named = list(model.state_dict().items())
        if len(named) % 2 or not named:
            raise ValueError("FedMA needs every layer to have a weight and a bias")
        layers, links = [], []
        for (wn, w), (bn, b) in zip(named[::2], named[1::2]):
            if not (wn.endswith("weight") and bn.endswith("bias") and b.shape[0] == w.shape[0]):
                raise ValueError(f"FedMA needs (weight, bias) pairs in order, got {wn}, {bn}")
            layers.append(Layer(wn, bn, "conv" if w.dim() == 4 else "fc"))
        shapes = [tuple(model.state_dict()[layer.weight].shape) for layer in layers]
        for below, above in zip(shapes, shapes[1:]):
            units, inputs = below[0], above[1]
            if len(below) == 4 and len(above) == 4:
                links.append(("conv", 1))
            elif len(below) == 4:
                if inputs % units:
                    raise ValueError(f"an FC layer with {inputs} inputs cannot follow {units} channels")
                links.append(("conv_to_fc", inputs // units))
            elif len(above) == 2:
                links.append(("fc", 1))
            else:
                raise ValueError("FedMA does not handle a conv layer after an FC layer")
        return cls(model_name, tuple(input_shape), num_classes, params, tuple(layers), tuple(links))

    @property
    def num_matched(self) -> int:
        """K: every layer but the last (the output layer is averaged per class, not matched)."""
        return len(self.layers) - 1

    def widths(self, state: State) -> tuple[int, ...]:
        return tuple(int(state[layer.weight].shape[0]) for layer in self.layers[:-1])

    def build(self, widths: Sequence[int]) -> torch.nn.Module:
        return resized(self.model_name, self.input_shape, self.num_classes, self.params, tuple(widths))

    def model(self, state: State) -> torch.nn.Module:
        """A module at the state's widths holding the state's weights."""
        model = self.build(self.widths(state))
        model.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32)) for k, v in state.items()})
        return model

    # --- one layer ------------------------------------------------------------------------------
    def neurons(self, state: State, l: int) -> np.ndarray:
        """[L, D] rows to match: each neuron's incoming weights then its bias."""
        layer = self.layers[l]
        return neurons_of(state[layer.weight], state[layer.bias], layer.kind)

    def set_neurons(self, state: State, l: int, theta: np.ndarray) -> None:
        """Write matched [L, D] rows back as layer l's weight and bias (in place)."""
        layer = self.layers[l]
        in_shape = state[layer.weight].shape[1:]
        weight, bias = split_neurons(theta, in_shape if layer.kind == "conv" else int(in_shape[0]), layer.kind)
        state[layer.weight], state[layer.bias] = weight.astype(np.float32), bias.astype(np.float32)

    def expected_row_dim(self, state: State, l: int) -> int:
        """D of layer l's neurons given the width of the layer below it in `state`."""
        shape = state[self.layers[l].weight].shape
        return int(np.prod(shape[1:])) + 1

    def permute_into_global(self, state: State, l: int, assignment: np.ndarray, global_size: int) -> None:
        """After layer l is matched: re-index layer l+1's inputs to the global neuron order (in place)."""
        kind, spatial = self.links[l]
        above = self.layers[l + 1].weight
        state[above] = permute_next_layer(state[above], assignment, global_size, kind, spatial).astype(np.float32)

    def slice_for_client(self, global_state: State, assignments: Sequence[np.ndarray]) -> State:
        """`reconstruct_local_net`: the global model cut back to one client's own neurons.

        `assignments[l]` maps the client's neurons of layer l to global ones (from the last matching).
        """
        if len(assignments) != self.num_matched:
            raise ValueError(f"need one assignment per matched layer ({self.num_matched}), got {len(assignments)}")
        state = {k: v.copy() for k, v in global_state.items()}
        for l, idx in enumerate(assignments):
            layer = self.layers[l]
            state[layer.weight] = slice_to_client(state[layer.weight], idx)
            state[layer.bias] = slice_to_client(state[layer.bias], idx)
            kind, spatial = self.links[l]
            above = self.layers[l + 1].weight
            state[above] = slice_next_layer(state[above], idx, kind, spatial).astype(np.float32)
        return state

    def trainable_from(self, model: torch.nn.Module, first: int) -> None:
        """Freeze layers 0..first-1 (requires_grad False), train the rest."""
        frozen = {name for layer in self.layers[:first] for name in (layer.weight, layer.bias)}
        for name, p in model.named_parameters():
            p.requires_grad_(name not in frozen)


def resized_default(model_name: str, input_shape, num_classes: int, params) -> torch.nn.Module:
    """The registered net at its own default widths."""
    from fedsim.registry import MODELS

    return MODELS.get(model_name).obj(tuple(input_shape), num_classes, params)


def state_of(model: torch.nn.Module) -> State:
    return {k: v.detach().cpu().numpy().astype(np.float32, copy=True) for k, v in model.state_dict().items()}


def num_params(state: State) -> int:
    return int(sum(v.size for v in state.values()))
