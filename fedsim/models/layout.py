"""A model's parameters as one flat float32 vector with a fixed layout.

Updates travel and are aggregated as flat vectors (`[d]`, stacked to `[n, d]`); the layout maps
them back to named tensors. It covers the model's state dict: the trainable parameters and the
floating-point buffers (BatchNorm's running_mean / running_var), so running statistics travel with
the update and are averaged like weights (FedAvg on the state dict, as BackFed and FLPoison do).
`trainable` marks which entries are parameters: the server pipeline gives defenses and rules those
only (fedsim/server/pipeline.py). Integer buffers (BatchNorm's `num_batches_tracked`, a step
counter that only matters with `momentum=None`) are left out: a float mean of counters means
nothing, and each model keeps its own. Models without buffers (mlp, lenet, vgg9, the LSTMs) have
the same layout as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

import torch


@dataclass(frozen=True)
class ModelLayout:
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    trainable: tuple[bool, ...] | None = None  # per entry: a parameter (True) or a buffer; None: all parameters

    @classmethod
    def of(cls, model: torch.nn.Module) -> "ModelLayout":
        params = {n for n, _ in model.named_parameters()}
        items = [(n, t) for n, t in model.state_dict().items() if n in params or t.is_floating_point()]
        trainable = tuple(n in params for n, _ in items)
        return cls(tuple(n for n, _ in items), tuple(tuple(t.shape) for _, t in items),
                   None if all(trainable) else trainable)

    @property
    def has_buffers(self) -> bool:
        return self.trainable is not None and not all(self.trainable)

    @property
    def trainable_mask(self) -> torch.Tensor:
        """Boolean `[dim]`: True at the coordinates of trainable parameters, False at buffers'."""
        flags = self.trainable or (True,) * len(self.names)
        return torch.cat([torch.full((s,), f, dtype=torch.bool) for s, f in zip(self.sizes, flags)]) if self.names \
            else torch.zeros(0, dtype=torch.bool)

    def trainable_only(self) -> "ModelLayout":
        """The layout of the trainable entries alone (what `vec[trainable_mask]` follows)."""
        if not self.has_buffers:
            return self
        keep = [i for i, f in enumerate(self.trainable) if f]
        return ModelLayout(tuple(self.names[i] for i in keep), tuple(self.shapes[i] for i in keep))

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(prod(s) for s in self.shapes)

    @property
    def offsets(self) -> tuple[int, ...]:
        out, acc = [], 0
        for s in self.sizes:
            out.append(acc)
            acc += s
        return tuple(out)

    @property
    def dim(self) -> int:
        return sum(self.sizes)

    def slice(self, name: str) -> slice:
        i = self.names.index(name)
        return slice(self.offsets[i], self.offsets[i] + self.sizes[i])

    def flatten(self, state: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.cat([state[n].detach().reshape(-1).to(torch.float32) for n in self.names])

    def unflatten(self, vec: torch.Tensor) -> dict[str, torch.Tensor]:
        if vec.shape != (self.dim,):
            raise ValueError(f"vector of shape {tuple(vec.shape)} does not fit layout of size {self.dim}")
        return {
            n: vec[o : o + s].view(shape)
            for n, shape, o, s in zip(self.names, self.shapes, self.offsets, self.sizes)
        }

    def flatten_model(self, model: torch.nn.Module) -> torch.Tensor:
        return self.flatten(model.state_dict())

    def load_into(self, model: torch.nn.Module, vec: torch.Tensor) -> None:
        """`vec` into `model`; the integer buffers the layout leaves out keep the model's values."""
        state = model.state_dict()
        extra = [n for n in self.names if n not in state]
        missing = [n for n in state if n not in self.names and state[n].is_floating_point()]
        if extra or missing:
            raise ValueError(f"layout does not fit the model: unknown {extra}, missing {missing}")
        new = {n: t.clone() for n, t in self.unflatten(vec).items()}
        model.load_state_dict({n: new.get(n, t) for n, t in state.items()})
