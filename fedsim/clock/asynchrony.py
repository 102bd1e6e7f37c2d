"""Asynchronous round protocols on the federation clock: FedAsync and FedBuff (`systems.round`).

Neither waits for a cohort. `concurrency` clients train at once, each from the model version
current when it started; when one finishes, another starts in its place. The server keeps a
buffer: FedBuff (Nguyen et al., AISTATS 2022) applies it when K updates have arrived, FedAsync
(Xie, Koyejo, Gupta 2019) after every single update (K = 1). Each server step is one line of
rounds.jsonl; `federation.rounds` counts server steps. The order of arrivals is the simulated
clock's (fedsim/clock/events.py), never this machine's.

Staleness: an update trained from version τ that reaches the server at version t has staleness
t − τ. The weight functions s(t − τ) are FedAsync's (its §5.2; APPFL's FedAsync server computes
α_t = α·s(t − τ) the same way, Plato's its polynomial as (staleness + 1)^(−a)):
    constant    s = 1
    polynomial  s = (t − τ + 1)^(−a)
    hinge       s = 1 if t − τ ≤ b, else 1 / (a · (t − τ − b) + 1)
FedBuff scales each buffered update by 1/sqrt(1 + staleness): polynomial with a = 0.5, its default.

FedAsync's server step: x_t = (1 − α_t)·x_{t−1} + α_t·x_new with α_t = α·s(t − τ), where x_new is
the client's model (its start version x_τ plus its update). FedBuff's: x ← x + η_g·(1/K)·Σ s(τ_k)·Δ_k,
with η_g the server optimizer's `server.lr` and the K updates averaged with equal weights.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BeforeValidator, Field

from fedsim.registry import Params


class ConstantStaleness(Params):
    """s(t − τ) = 1: staleness ignored."""

    name: Literal["constant"] = "constant"

    def weight(self, staleness: int) -> float:
        return 1.0


class PolynomialStaleness(Params):
    """s(t − τ) = (t − τ + 1)^(−a) (FedAsync's Poly; a = 0.5 is FedBuff's 1/sqrt(1 + staleness))."""

    name: Literal["polynomial"] = "polynomial"
    a: float = Field(0.5, ge=0, le=100, description="the exponent a")

    def weight(self, staleness: int) -> float:
        return float((staleness + 1.0) ** (-self.a))


class HingeStaleness(Params):
    """s(t − τ) = 1 up to b steps of staleness, then 1 / (a · (t − τ − b) + 1) (FedAsync's Hinge)."""

    name: Literal["hinge"] = "hinge"
    a: float = Field(10.0, ge=0, le=1e6, description="the slope a past the hinge")
    b: int = Field(4, ge=0, description="the staleness b up to which updates count fully")

    def weight(self, staleness: int) -> float:
        return 1.0 if staleness <= self.b else 1.0 / (self.a * (staleness - self.b) + 1.0)


Staleness = Annotated[
    Union[ConstantStaleness, PolynomialStaleness, HingeStaleness],
    Field(discriminator="name"),
    BeforeValidator(lambda v: {"name": v} if isinstance(v, str) else v),
]


class _Asynchronous(Params):
    concurrency: int | None = Field(None, ge=1, description="clients training at once; default: "
                                    "federation.clients_per_round")
    timeout: float = Field(600.0, gt=0, description="simulated seconds after a client's start at which the server "
                           "gives up on it (a straggler or a client that dropped out) and starts another")

    def in_flight(self, federation) -> int:
        return self.concurrency if self.concurrency is not None else federation.clients_per_round


class FedAsync(_Asynchronous):
    """Asynchronous: every arriving update moves the model at once, mixed in with weight α·s(staleness).

    FedAsync (Xie, Koyejo, Gupta 2019): x_t = (1 − α_t)·x_{t−1} + α_t·x_new, α_t = α·s(t − τ)."""

    name: Literal["fedasync"] = "fedasync"
    alpha: float = Field(0.6, gt=0, le=1, description="α: the mixing weight of a fresh update")
    staleness: Staleness = Field(default_factory=PolynomialStaleness,
                                 description="s(t − τ): constant, polynomial {a}, hinge {a, b}")

    @property
    def buffer_size(self) -> int:
        return 1


class FedBuff(_Asynchronous):
    """Buffered asynchronous: the model moves once K updates have arrived, by their staleness-scaled mean.

    FedBuff (Nguyen et al., AISTATS 2022): x ← x + η_g·(1/K)·Σ s(τ_k)·Δ_k, η_g = server.lr."""

    name: Literal["fedbuff"] = "fedbuff"
    buffer_size: int = Field(10, ge=1, le=100_000, description="K: updates per server step")
    staleness: Staleness = Field(default_factory=PolynomialStaleness,
                                 description="s(staleness) scaling each update (default: 1/sqrt(1 + staleness))")


ASYNCHRONOUS = (FedAsync, FedBuff)


def asynchronous_problems(sc) -> list[tuple[str, str, object]]:
    """What an asynchronous scenario cannot run, as (field path, reason, value)."""
    from fedsim.registry import AGGREGATORS

    policy, fed, out = sc.systems.round, sc.federation, []
    k, c = policy.buffer_size, policy.in_flight(fed)
    where = f"systems.round.name={policy.name}"
    if c > fed.num_clients:
        out.append(("systems.round.concurrency", f"{c} clients in flight, more than federation.num_clients="
                    f"{fed.num_clients}", c))
    if fed.min_replies > k:
        out.append(("federation.min_replies", f"exceeds the {k} updates a server step of {where} aggregates",
                    fed.min_replies))
    problem = sc.aggregator.round_problem(k)
    if problem:
        out.append((f"aggregator.{problem[0]}" if problem[0] else "aggregator",
                    f"{problem[1]} ({where} aggregates {k} update{'s' * (k != 1)} a step)", problem[2]))
    if AGGREGATORS.get(sc.aggregator.name).traits.needs_groups:
        out.append(("aggregator", f"{sc.aggregator.name} groups a round's sampled clients, which {where} does not "
                    "have (its buffer fills in order of arrival)", sc.aggregator.name))
    for i, d in enumerate(sc.defenses):
        problem = d.round_problem(k)
        if problem:
            out.append((f"defenses.{i}.{problem[0]}" if problem[0] else f"defenses.{i}",
                        f"{problem[1]} ({where} aggregates {k} update{'s' * (k != 1)} a step)", problem[2]))
    if any(d.name == "dp_fedavg" for d in sc.defenses):
        out.append(("defenses", f"dp_fedavg's accountant and noise assume rounds that sample federation.clients_per_round "
                    f"clients at once; {where} steps on a buffer of arrivals", "dp_fedavg"))
    if sc.systems.adacomm is not None:
        out.append(("systems.adacomm", f"AdaComm sets the local period of synchronous rounds; {where} has none",
                    "adacomm"))
    if sc.lowrank is not None:
        out.append(("lowrank", f"a low-rank switch changes the model's layers mid-run, and {where} still has "
                    "updates in flight for the old ones", sc.lowrank.name))
    attack = sc.attack
    if attack is not None:
        schedule = attack.schedule.name
        reporting = sc.systems.attackers.reporting
        count = len(attack.attacker_ids) if attack.attacker_ids is not None else attack.num_attackers
        slots = 0 if schedule == "fixed_pool" else min(attack.schedule.attackers_per_round, count)
        if slots >= c:
            out.append(("attack.schedule.attackers_per_round", f"the attackers' {slots} slots leave no honest "
                        f"client among the {c} in flight", slots))
        if reporting == "buffer_timed" and slots > k:
            out.append(("systems.attackers.reporting", f"buffer_timed attackers ({slots}) fill the last slots of one "
                        f"buffer of {k}; fewer attacker slots than K are needed", reporting))
    return out
