"""The scenario's `systems:` section: devices, networks, availability and the round's policy on the clock.

Without a `systems:` section a run is what it always was: every sampled client answers, time is
this machine's. With one, each client gets a device (training speed) and a network (downlink,
uplink, latency) drawn once from the seed, may be offline or drop out, and every round is timed
on a simulated clock from the real bytes each client received and sent and the samples it really
trained on (fedsim/clock/clock.py). The round policy is a round protocol chosen by
`systems.round` (`wait_for_all`, `deadline`, `over_selection`); its exchange is the plain one
wrapped by the clock (fedsim/server/clocked.py).

Where the default figures come from (docs/clock.md says the same, with what is assumed):
- networks: Ookla's Speedtest Global Index, September 2020, global averages: mobile 35.96 Mbit/s
  down, 11.22 up, 40 ms latency; fixed broadband 85.73 down, 45.74 up, 21 ms (a phone on Wi-Fi);
  Ookla, "Growing and Slowing: The State of 5G Worldwide in 2021", Q3 2021 global 5G medians:
  166.13 down, 21.08 up (5G's latency is not given there: 4G's 40 ms is assumed);
- compute: effective fp32 training throughput of three phone classes (20, 8 and 2 GFLOP/s) is an
  assumption, not a measurement: no published training-throughput figures were found to cite.
  FedScale (Lai et al., ICML 2022) times a client's computation the same way, as work per sample
  times samples, with per-device speeds from AI Benchmark's inference latencies;
- availability: Bonawitz et al. (MLSys 2019) report 6-10% of devices dropping out during a round
  and strong diurnal availability (devices train when idle, charging and on an unmetered network:
  at night); both are off by default and on in scenarios/systems/bonawitz.yaml;
- over-selection: Bonawitz et al. select about 130% of the target count.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from fedsim.clock.asynchrony import ASYNCHRONOUS, FedAsync, FedBuff, asynchronous_problems
from fedsim.registry import PROTOCOLS, Params


class _Part(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class DeviceClass(_Part):
    """A class of devices: its share of clients and its training speed (a client's own speed is the
    median times exp(spread · N(0, 1)), a log-normal draw)."""

    name: str = Field(..., pattern=r"^[A-Za-z0-9_.-]+$")
    share: float = Field(..., gt=0, description="relative share of clients of this class")
    gflops: float = Field(..., gt=0, description="median effective training throughput, GFLOP/s")
    spread: float = Field(0.3, ge=0, le=5, description="σ of the log-normal spread around the median")


class NetworkClass(_Part):
    """A class of network connections: its share of clients, its median bandwidths and latency."""

    name: str = Field(..., pattern=r"^[A-Za-z0-9_.-]+$")
    share: float = Field(..., gt=0, description="relative share of clients of this class")
    down_mbps: float = Field(..., gt=0, description="median downlink, Mbit/s")
    up_mbps: float = Field(..., gt=0, description="median uplink, Mbit/s")
    latency_ms: float = Field(..., ge=0, description="one-way latency added to each transfer, ms")
    spread: float = Field(0.5, ge=0, le=5, description="σ of the log-normal spread of both bandwidths")


DEFAULT_DEVICES = (  # assumed figures (module docstring)
    DeviceClass(name="high_end", share=0.25, gflops=20.0),
    DeviceClass(name="mid_range", share=0.5, gflops=8.0),
    DeviceClass(name="low_end", share=0.25, gflops=2.0),
)
DEFAULT_NETWORKS = (  # Ookla's figures (module docstring)
    NetworkClass(name="wifi", share=0.5, down_mbps=85.73, up_mbps=45.74, latency_ms=21.0),
    NetworkClass(name="4g", share=0.35, down_mbps=35.96, up_mbps=11.22, latency_ms=40.0),
    NetworkClass(name="5g", share=0.15, down_mbps=166.13, up_mbps=21.08, latency_ms=40.0),
)


class Diurnal(_Part):
    """Devices check in only during a daily window of local time (idle, charging, on Wi-Fi): each
    client lives in one of `timezones` evenly spaced time zones, drawn once."""

    start_hour: float = Field(22.0, ge=0, lt=24, description="local hour the window opens")
    hours: float = Field(8.0, gt=0, le=24, description="length of the window, hours")
    timezones: int = Field(24, ge=1, le=24, description="time zones the clients are spread over (1: all in one)")


class Availability(_Part):
    offline: float = Field(0.0, ge=0, lt=1, description="probability a client is not checked in at a round's start "
                           "(drawn each round, beside the diurnal window)")
    dropout: float = Field(0.0, ge=0, lt=1, description="probability a selected client disappears during the round "
                           "(Bonawitz et al.: 6-10%); its work is lost")
    diurnal: Diurnal | None = Field(None, description="a daily availability window in each client's local time")


class AttackerProfile(_Part):
    """What the attackers' devices are: by default the fastest class's medians and always on (a
    strong attacker chooses its hardware and stays available)."""

    device: Literal["fastest", "drawn"] = Field("fastest", description="fastest: the fastest device and network "
                                                "classes' medians; drawn: like every other client")
    always_on: bool = Field(True, description="never offline, outside no diurnal window, never drops out")
    reporting: Literal["eager", "fresh_only", "buffer_timed"] = Field(
        "eager", description="asynchronous protocols (fedasync, fedbuff): what an attacker does with a finished update. "
        "eager: reports it and, in an attacker's slot, starts again at once (reports as often as its device allows); "
        "fresh_only: drops it if the model moved while it trained, and starts again from the new model; "
        "buffer_timed: fresh_only, and holds a fresh update until the attackers' updates complete one buffer together")


class AdaComm(_Part):
    """AdaComm (Wang & Joshi, MLSys 2019): the local period τ (SGD steps between averagings) starts
    large and shrinks as the training loss falls, τ_l = ⌈sqrt(F_l / F_0) · τ0⌉, re-evaluated at
    every multiple of `interval` seconds of simulated time (fedsim/clock/adacomm.py)."""

    tau0: int = Field(..., ge=1, le=100_000, description="τ0: the first local period, SGD steps")
    interval: float = Field(..., gt=0, description="T0: simulated seconds between re-evaluations of τ")
    lr_coupled: bool = Field(False, description="the paper's variant with the learning rate folded in: "
                             "τ_l = ⌈sqrt(η_0 F_l / (η_l F_0)) · τ0⌉ (τ grows back as the lr decays)")


# --- the round policies: round protocols chosen by `systems.round` --------------------------------
class WaitForAll(Params):
    """On the clock (`systems:`): the round closes when the last selected client has reported."""

    name: Literal["wait_for_all"] = "wait_for_all"

    def selected(self, target: int) -> int:
        return target

    def close(self, finish: list[float], target: int) -> float | None:
        """Seconds after the round's start at which it closes, given the clients' finish times
        (seconds after the start); None when nobody reports and nothing bounds the wait."""
        return max(finish) if finish else None


class Deadline(Params):
    """On the clock: a reporting deadline; a client still working at it is a straggler, discarded.

    The round closes at the last report or at `seconds`, whichever comes first."""

    name: Literal["deadline"] = "deadline"
    seconds: float = Field(120.0, gt=0, description="the reporting deadline, simulated seconds after the round's start")

    def selected(self, target: int) -> int:
        return target

    def close(self, finish: list[float], target: int) -> float | None:
        return min(max(finish), self.seconds) if finish else self.seconds


class OverSelection(Params):
    """On the clock: Bonawitz et al.'s over-selection; the round closes at the target count's report.

    Selects `factor` × the target count (federation.clients_per_round), closes the round as soon as
    the target count has reported (or at the deadline) and discards the rest as stragglers."""

    name: Literal["over_selection"] = "over_selection"
    factor: float = Field(1.3, ge=1, le=10, description="clients selected per target client (Bonawitz et al.: about 1.3)")
    deadline: float | None = Field(None, gt=0, description="also close at this many simulated seconds after the start")

    def selected(self, target: int) -> int:
        return math.ceil(self.factor * target - 1e-9)

    def close(self, finish: list[float], target: int) -> float | None:
        done = sorted(finish)
        at = done[min(target, len(done)) - 1] if done else None
        if self.deadline is not None:
            at = self.deadline if at is None else min(at, self.deadline)
        return at


RoundPolicy = Annotated[Union[WaitForAll, Deadline, OverSelection, FedAsync, FedBuff], Field(discriminator="name")]


def _policy_shorthand(value: Any) -> Any:
    return {"name": value} if isinstance(value, str) else value


class SystemsSection(_Part):
    devices: tuple[DeviceClass, ...] = Field(DEFAULT_DEVICES, min_length=1, description="device classes (training speed)")
    networks: tuple[NetworkClass, ...] = Field(DEFAULT_NETWORKS, min_length=1, description="network classes")
    availability: Availability = Field(default_factory=Availability)
    attackers: AttackerProfile = Field(default_factory=AttackerProfile)
    round: Annotated[RoundPolicy, BeforeValidator(_policy_shorthand)] = Field(
        default_factory=WaitForAll, description="the round's policy on the clock: wait_for_all, deadline, over_selection, or "
        "asynchronous: fedasync, fedbuff (fedsim/clock/asynchrony.py)")
    server_seconds: float | Literal["measured"] = Field(
        0.0, description="the server's time per round between the close and the next round: a modelled constant "
        "(seconds, reproducible), or `measured` (this machine's decode and aggregation seconds: not reproducible)")
    jitter: float = Field(0.0, ge=0, le=5, description="σ of a log-normal factor, drawn per client and round, on "
                          "each client-round's compute and transfer times: random straggling (AdaComm's runtime model) "
                          "beside the fixed differences between devices")
    idle_seconds: float = Field(60.0, gt=0, description="how long a round in which no client reported lasts (nobody "
                                "checked in, or all dropped out): the server waits this long before the next round")
    adacomm: AdaComm | None = Field(None, description="adapt the local period τ on the clock (AdaComm)")
    start_hour: float = Field(0.0, ge=0, lt=24, description="the simulated clock's start, as an hour of day at time zone 0")
    targets: tuple[float, ...] = Field((0.5, 0.8, 0.9), description="main accuracies whose first simulated time "
                                       "summary.json reports (time to accuracy)")

    @field_validator("targets")
    @classmethod
    def _accuracies(cls, value):
        if any(not 0 < t <= 1 for t in value):
            raise ValueError(f"accuracies are in (0, 1], got {list(value)}")
        return tuple(sorted(set(value)))

    @field_validator("server_seconds")
    @classmethod
    def _non_negative(cls, value):
        if not isinstance(value, str) and value < 0:
            raise ValueError(f"must be at least 0 (seconds) or 'measured', got {value}")
        return value

    @model_validator(mode="after")
    def _distinct_names(self) -> "SystemsSection":
        for kind, classes in (("devices", self.devices), ("networks", self.networks)):
            names = [c.name for c in classes]
            twice = sorted({n for n in names if names.count(n) > 1})
            if twice:
                raise ValueError(f"{kind}: {', '.join(twice)} named more than once")
        return self


def systems_problems(sc) -> list[tuple[str, str, Any]]:
    """What a scenario with `systems:` cannot run, as (field path, reason, value)."""
    out: list[tuple[str, str, Any]] = []
    systems = sc.systems
    if systems.adacomm is not None and sc.federation.local_steps is not None:
        out.append(("systems.adacomm", "AdaComm sets each round's local steps itself; drop federation.local_steps",
                    sc.federation.local_steps))
    policy = systems.round
    if isinstance(policy, ASYNCHRONOUS):
        return out + asynchronous_problems(sc)
    if systems.attackers.reporting != "eager":
        out.append(("systems.attackers.reporting", f"{systems.attackers.reporting} times an attacker's reports "
                    f"against an asynchronous server; systems.round={policy.name} waits for its cohort",
                    systems.attackers.reporting))
    if isinstance(policy, OverSelection) and policy.selected(sc.federation.clients_per_round) > sc.federation.num_clients:
        out.append(("systems.round.factor", f"selects {policy.selected(sc.federation.clients_per_round)} clients a round, "
                    f"more than federation.num_clients={sc.federation.num_clients}", policy.factor))
    return out


for _policy in (WaitForAll, Deadline, OverSelection):
    PROTOCOLS.register(_policy.model_fields["name"].default, _policy, exchange="fedsim.server.clocked:ClockedExchange",
                       client_step="fedsim.client.steps:plain_train", chosen_by="systems.round",
                       scenario_check=systems_problems, cohort_training=True)(_policy)
for _policy in ASYNCHRONOUS:
    PROTOCOLS.register(_policy.model_fields["name"].default, _policy,
                       exchange="fedsim.server.asynchronous:AsynchronousExchange",
                       client_step="fedsim.client.steps:plain_train", chosen_by="systems.round",
                       scenario_check=systems_problems, cohort_training=True, opens_rounds=True)(_policy)
