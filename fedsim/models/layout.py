"""A model's parameters as one flat float32 vector with a fixed layout.

Updates travel and are aggregated as flat vectors (`[d]`, stacked to `[n, d]`); the layout maps
them back to named tensors. It covers the trainable parameters only (the models here have no
BatchNorm buffers), which is what the papers' distance-based rules compare.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

import torch


@dataclass(frozen=True)
class ModelLayout:
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, model: torch.nn.Module) -> "ModelLayout":
        items = list(model.state_dict().items())
        return cls(tuple(n for n, _ in items), tuple(tuple(t.shape) for _, t in items))

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
        model.load_state_dict({n: t.clone() for n, t in self.unflatten(vec).items()})
