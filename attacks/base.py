"""Attack interfaces, kept in two kinds.

* Client-side attacks (`side = "client"`) change what an attacker client trains on and how
  (edge-case data, triggers, PGD, model replacement). They run inside the ClientApp.
* Server-side omniscient model poisoning (`side = "server"`, simulation only) replaces the
  malicious clients' updates after seeing the honest ones, just before the defenses run:
  `craft(honest [h, d], num_malicious, ctx) -> Crafted(rows [m, d], log)`.

Every attack's parameter model extends `AttackParams`, which says who the attackers are and when
they take part.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from pydantic import Field, model_validator

from fedsim.attacks.schedules import FixedFrequency, Schedule
from fedsim.registry import Params
from fedsim.updates import RoundContext


class Attack(ABC):
    """What every attack offers the server besides its own mechanics (defaults: nothing to add)."""

    side = "client"

    def __init__(self, params) -> None:
        self.params = params

    def backdoor_test_set(self, runtime, shared: dict[str, np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray] | None:
        """(inputs, attacker's labels) on which success is measured: the share of inputs the global
        model assigns the attacker's label (backdoor success rate), or None when not applicable.
        `shared`: the latest `shared_state` an attacker reported (None before any attack round)."""
        return None

    def source_class(self) -> int | None:
        """The class whose inputs the backdoor turns (an edge-case set's source), if the attack has one:
        the server reports the global model's clean accuracy on it beside the backdoor's success."""
        return None

    def honest_extra_data(self, runtime, partition_id: int) -> tuple[np.ndarray, np.ndarray] | None:
        """Extra correctly labelled data an *honest* client holds in this scenario (normal-case variants)."""
        return None

    def report(self, runtime) -> dict:
        """Facts about the attack worth keeping in summary.json (e.g. the edge set's density check)."""
        return {}


@dataclass(frozen=True)
class Crafted:
    """What a server-side attack made of one round: the malicious updates `rows` [m, d], and `log`,
    the scalars it chose on the way (γ, z, λ, noise std...) for the round log."""

    rows: torch.Tensor
    log: dict = field(default_factory=dict)


class ServerAttack(Attack):
    """Base of the omniscient model-poisoning attacks run by the simulated server (simulation only)."""

    side = "server"

    @abstractmethod
    def craft(self, honest: torch.Tensor, num_malicious: int, ctx: RoundContext) -> Crafted:
        """The malicious updates `[num_malicious, d]` given the honest ones `[h, d]`, with what was chosen."""


class AttackParams(Params):
    """Who the attackers are and when they take part; every attack's parameters extend this.

    Attackers are client (partition) ids: `attacker_ids` if given, else `num_attackers` ids drawn
    once from the scenario seed.
    """

    num_attackers: int = Field(1, ge=1)
    attacker_ids: list[int] | None = None
    schedule: Schedule = Field(default_factory=FixedFrequency)

    @model_validator(mode="after")
    def _ids_match(self) -> "AttackParams":
        if self.attacker_ids is not None:
            if len(set(self.attacker_ids)) != len(self.attacker_ids):
                raise ValueError("attacker_ids has duplicates")
            if any(i < 0 for i in self.attacker_ids):
                raise ValueError("attacker_ids must be >= 0")
        return self

    def resolve_attackers(self, num_clients: int, seed: int) -> list[int]:
        if self.attacker_ids is not None:
            bad = [i for i in self.attacker_ids if i >= num_clients]
            if bad:
                raise ValueError(f"attack.attacker_ids {bad} are not client ids (0..{num_clients - 1})")
            return sorted(self.attacker_ids)
        if self.num_attackers >= num_clients:
            raise ValueError(f"attack.num_attackers={self.num_attackers} must be < federation.num_clients={num_clients}")
        rng = np.random.default_rng([seed, 0xA77AC])
        return sorted(rng.choice(num_clients, size=self.num_attackers, replace=False).tolist())


@dataclass
class AttackerRound:
    """One attacker's local training in one round, as the ClientApp hands it to the attack.

    `model` holds the global model on arrival and the attacker's trained model on return; `train`
    is the honest clients' training settings for this round (the attack's own `local_epochs` / `lr`
    already applied, no FedProx term); `config` is the round's config from the server. `memory`
    is what this attacker kept from its previous attack round (e.g. a trigger it keeps optimising):
    the attack updates it in place and the ClientApp keeps it in the client's own state (and state
    folder), as a device would keep it on its disk.
    """

    runtime: object
    partition_id: int
    round: int
    model: torch.nn.Module
    global_vec: torch.Tensor
    layout: object
    train: object  # fedsim.training.TrainConfig
    seed: int
    config: dict = field(default_factory=dict)
    memory: dict[str, np.ndarray] = field(default_factory=dict)  # this attacker's own arrays from its last attack round


class ClientAttack(Attack):
    """Base of the attacks that run on a malicious client, as a real compromised device would.

    The ClientApp hands the attack its round (`local_train`); by default the attacker trains on
    `training_set` with a hook after each step (`after_step`, e.g. PGD projection), and an attack
    that needs the global model first (a trigger optimised against it) or its own objective
    overrides `local_train`. `finish_update` then transforms the finished update (e.g.
    model-replacement scaling) before it is encoded for upload. The server asks for the backdoor
    test set (`backdoor_test_set`) to measure the backdoor success rate.
    """

    side = "client"

    def local_train(self, job: AttackerRound) -> tuple[int, dict, dict]:
        """Train `job.model` as this attacker; returns (examples trained on, training stats, info for
        `finish_update`: the round's config plus `num_examples`)."""
        from fedsim.training import train

        x, y = self.training_set(job.runtime, job.partition_id)
        info = {"num_examples": len(x), **job.config}
        after = lambda b, last: self.after_step(job.model, job.global_vec, job.layout, b, last, info)  # noqa: E731
        stats = train(job.model, x, y, job.train, job.seed, after) if len(x) else {"loss": 0.0}
        return len(x), stats, info

    @abstractmethod
    def training_set(self, runtime, partition_id: int) -> tuple[np.ndarray, np.ndarray]:
        """The (x, y) this attacker trains on."""

    def shared_state(self, job: AttackerRound) -> dict[str, np.ndarray] | None:
        """What the attacker reports beside its update after training so the simulated server can
        measure the backdoor it planted this round (a trigger optimised this round: A3FL, IBA), or
        None when the backdoor test set is fixed. The server passes the latest report to
        `backdoor_test_set(runtime, shared)`; it is a measurement channel, not counted in bytes_up."""
        return None

    def after_step(
        self, model: torch.nn.Module, global_vec: torch.Tensor, layout, batch: int, last: bool, info: dict
    ) -> None:
        """Called after each optimizer step of the attacker's local training; `info` is the round's config."""

    def finish_update(self, delta: torch.Tensor, info: dict) -> torch.Tensor:
        """Transform the attacker's finished update; `info` carries the round's config."""
        return delta

    def poisons_data_only(self) -> bool:
        """True when the attack only changes the training data (no training hook, no update
        transform): such an attacker can follow any protocol, FedMA's layer-wise one included."""
        cls = type(self)
        return (cls.after_step is ClientAttack.after_step and cls.finish_update is ClientAttack.finish_update
                and cls.local_train is ClientAttack.local_train)


def attacker_train_config(params, honest, round_lr_decay: float):
    """The honest TrainConfig with an attack's own `local_epochs` / `lr` (decayed like the honest lr)
    and no FedProx term: the proximal term is the server's prescription, an attacker ignores it."""
    epochs = getattr(params, "local_epochs", None) or honest.epochs
    lr = getattr(params, "lr", None)
    return replace(honest, epochs=epochs, lr=lr * round_lr_decay if lr else honest.lr, proximal_mu=0.0)
