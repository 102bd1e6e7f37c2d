"""When attackers take part, and who they are.

* `fixed_frequency` (Attack of the Tails' "fixed-freq"): in rounds first, first+every, ... one
  attacker replaces one of the sampled clients; in other rounds no attacker is sampled.
* `every_round`: the same, every round.
* `rounds`: the same, in an explicit list of rounds.
* `fixed_pool` (Attack of the Tails' "fixed-pool"): the attacker pool is fixed once; clients are
  sampled uniformly from everyone each round and every sampled pool member attacks.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

import numpy as np
from pydantic import BeforeValidator, Field, model_validator

from fedsim.registry import Params


class FixedFrequency(Params):
    """Attack of the Tails' fixed-freq: from round `first`, every `every` rounds attackers replace sampled clients."""

    name: Literal["fixed_frequency"] = "fixed_frequency"
    every: int = Field(10, ge=1, description="attack every k rounds")
    first: int = Field(1, ge=1, description="first attack round")
    attackers_per_round: int = Field(1, ge=1)

    def is_attack_round(self, rnd: int) -> bool:
        return rnd >= self.first and (rnd - self.first) % self.every == 0


class EveryRound(Params):
    """Attackers replace sampled clients in every round."""

    name: Literal["every_round"] = "every_round"
    attackers_per_round: int = Field(1, ge=1)

    def is_attack_round(self, rnd: int) -> bool:
        return True


class ExplicitRounds(Params):
    """Attackers replace sampled clients in the listed rounds only."""

    name: Literal["rounds"] = "rounds"
    rounds: list[int] = Field(min_length=1)
    attackers_per_round: int = Field(1, ge=1)

    @model_validator(mode="after")
    def _positive(self) -> "ExplicitRounds":
        if any(r < 1 for r in self.rounds):
            raise ValueError("rounds are numbered from 1")
        return self

    def is_attack_round(self, rnd: int) -> bool:
        return rnd in self.rounds


class FixedPool(Params):
    """Attack of the Tails' fixed-pool: clients sampled uniformly from all; every sampled attacker attacks."""

    name: Literal["fixed_pool"] = "fixed_pool"

    def is_attack_round(self, rnd: int) -> bool:
        return True


Schedule = Annotated[
    Union[FixedFrequency, EveryRound, ExplicitRounds, FixedPool],
    Field(discriminator="name"),
    BeforeValidator(lambda v: {"name": v} if isinstance(v, str) else v),  # `schedule: every_round` shorthand
]


def sample_round(
    schedule, rnd: int, population, per_round: int, attackers: list[int], rng: np.random.Generator
) -> tuple[list[int], list[int]]:
    """This round's sampled client ids (sorted) and the attackers among them.

    `population`: the number of registered clients (all of them may be sampled), or the ids of
    those that may (checked in on the federation clock); at most that many are sampled. Honest
    clients are drawn without replacement from the non-attackers; under a replacing schedule the
    attackers (taken round-robin from the attacker list) replace sampled honest clients, those of
    them in the population.
    """
    pool = np.arange(population) if isinstance(population, (int, np.integer)) else np.asarray(population, dtype=np.int64)
    if isinstance(schedule, FixedPool):
        picked = rng.choice(len(pool), size=min(per_round, len(pool)), replace=False)
        sampled = sorted(pool[picked].tolist())
        attacker_set = set(attackers)
        return sampled, [c for c in sampled if c in attacker_set]
    honest = pool[~np.isin(pool, np.asarray(attackers, dtype=np.int64))]
    k = min(schedule.attackers_per_round, len(attackers), per_round) if schedule.is_attack_round(rnd) else 0
    picked = rng.choice(len(honest), size=min(per_round - k, len(honest)), replace=False)
    chosen = sorted(honest[picked].tolist())
    if k:
        # which attackers strike this round: round-robin over the attack rounds seen so far
        start = (rnd - 1) * k
        strikers = [attackers[(start + i) % len(attackers)] for i in range(k)]
        if not isinstance(population, (int, np.integer)):  # a striker that is not checked in does not strike
            strikers = [a for a, there in zip(strikers, np.isin(strikers, pool)) if there]
        return sorted(chosen + strikers), sorted(strikers)
    return chosen, []
