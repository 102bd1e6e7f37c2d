"""What a privacy attack is given and what it gives back (issue #36).

A privacy attack measures what a curious (or malicious) server can learn about clients' data from
what crosses the wire. Two targets:

- `upload` / `aggregate`: gradient inversion. The server holds an `Observation`: the model it
  broadcast, the update it received (one client's decoded upload, or the round's released change
  of the global model: a secure sum, a DP-noised mean), and what it knows of how clients train
  (the scenario's federation section). The attack returns a `Reconstruction`: inputs (and labels).
  The harness (fedsim/server/leakage.py) alone holds the clients' true data, matches the
  reconstructions to it and scores them (leakage/metrics.py); an attack never sees the truth.
- `model`: membership inference against the global model (`MembershipQuery` -> per-example scores).

Attacks run after the fact on copies: they never change what honest clients compute. (The one
malicious-server attack, the imprint module, changes the *model* the server sends, through the
scenario's `model: {name: imprint, ...}`; its attack only reads the aggregate.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Literal

import torch
from pydantic import Field

from fedsim.models.layout import ModelLayout
from fedsim.registry import Params


class PrivacyAttackParams(Params):
    """Fields every privacy attack shares: when it runs; its own budget fields follow."""

    rounds: list[int] = Field(
        [1], min_length=1, description="rounds whose uploads (or, for membership inference, whose new global model) "
        "are attacked")


class InversionParams(PrivacyAttackParams):
    """Fields every gradient-inversion attack shares besides the schedule: what it reads, on whom."""

    observe: Literal["upload", "aggregate"] = Field(
        "upload", description="upload: each attacked client's decoded update (a curious server; not under secure "
        "aggregation); aggregate: the round's aggregated update, what a secure-aggregation server (or anyone who "
        "sees two global models) gets")
    clients: list[int] | None = Field(
        None, description="upload: the client ids attacked when sampled (default: the lowest-id sampled honest "
        "clients, `per_round` of them)")
    per_round: int = Field(1, ge=1, le=1000, description="upload: how many sampled clients are attacked per round")
    grid: int = Field(8, ge=0, le=64, description="reconstructions saved in the run folder's image grid (0: none)")


@dataclass(frozen=True)
class LocalTraining:
    """What the server knows of a client's local training: the scenario's federation section and
    the example count the client reported (its reply's `num_examples`)."""

    lr: float
    epochs: int
    batch_size: int
    max_steps: int | None  # federation.local_steps (None: whole epochs)
    momentum: float
    weight_decay: float
    num_examples: int

    @property
    def steps(self) -> int:
        """SGD steps the client took: ceil(n / B) per epoch, capped at max_steps."""
        per_epoch = -(-self.num_examples // self.batch_size)
        total = per_epoch * self.epochs
        return total if self.max_steps is None else min(total, self.max_steps)

    @property
    def examples_used(self) -> int:
        """Distinct examples the client's steps touched (all of them once an epoch is complete)."""
        return min(self.num_examples, self.steps * self.batch_size)


@dataclass
class Observation:
    """What the server saw of one upload or one round's aggregate, and what it knows around it."""

    round: int
    kind: Literal["upload", "aggregate"]
    model: torch.nn.Module  # the broadcast model (its weights = `weights`), on `device`, in eval mode
    layout: ModelLayout  # how `weights` and `update` map onto the model's state dict
    weights: torch.Tensor  # [d] the global vector the clients trained from
    update: torch.Tensor  # [d] local − global as the server decoded it (upload), or the applied change (aggregate)
    training: LocalTraining
    input_shape: tuple[int, ...]
    num_classes: int
    bounds: tuple[float, float]  # the dataset's input range (min, max): the prior a reconstruction is clamped to
    generator: torch.Generator  # seeded by (scenario seed, round, client): restarts and inits are reproducible
    device: torch.device
    clients: tuple[int, ...] = ()  # whose data produced the update (one for an upload)
    images: int | None = None  # how many inputs to reconstruct (None: the attack's own rule, from `training`)


@dataclass
class Reconstruction:
    """What an inversion attack recovered: inputs in the dataset's scale, labels if it inferred them."""

    inputs: torch.Tensor  # [m, *input_shape]
    labels: torch.Tensor | None = None  # [m] int64
    info: dict = field(default_factory=dict)  # the attack's own numbers: final loss, iterations, restarts


@dataclass
class MembershipQuery:
    """A membership-inference game: the global model, the targets and what the attacker may use.

    `targets` are half members (examples some client trained on), half non-members (held out);
    `is_member` is for the harness's scoring only. `population` is data from the same
    distribution that is in neither half (the offline attacks' shadow data)."""

    round: int
    model: torch.nn.Module
    x: torch.Tensor  # [N, ...] the targets
    y: torch.Tensor  # [N]
    population: tuple[torch.Tensor, torch.Tensor]  # (x, y) the attacker's own data, disjoint from the targets
    build_model: Callable[[], torch.nn.Module]  # a fresh model of the federation's architecture (shadow models)
    training: LocalTraining  # how the federation trains (shadow models may imitate it)
    generator: torch.Generator
    device: torch.device


def functional_forward(obs: Observation, vec: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The model's output on `x` with its state set to the flat vector `vec` (differentiable in both)."""
    return torch.func.functional_call(obs.model, obs.layout.unflatten(vec), (x,))
