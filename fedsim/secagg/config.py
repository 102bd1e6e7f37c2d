"""The scenario's `secure_aggregation:` section and what it refuses up front.

Under secure aggregation the server learns the (weighted) sum of a round's updates and nothing
about any single one. Whatever needs an individual update on the server therefore cannot run,
and a scenario asking for it is refused at validation, naming the field and why:

- aggregators other than `fedavg` (the weighted sum the protocol computes) and `detox` with
  `redundancy: false` (each group is securely aggregated on its own; the robust inner rule runs
  across the group means, which the server does see). DETOX's majority vote compares the members'
  individual updates and is refused;
- every server-side defense (norm clipping, FLAME, DP-FedAvg, ...): each one's `before` reads the
  rows. Norm clipping moves to the clients instead: `secure_aggregation.clip_norm` clips every
  honest update before it is quantised and masked;
- upload codecs other than `none`: masks are added to the dense quantised update;
- server-side (omniscient) attacks, which replace the attackers' rows on the server;
- protocols with their own exchanges (FedMA) and low-rank switching.

The protocols: Flower's SecAgg+ (`flwr.server.workflow.SecAggPlusWorkflow` with
`flwr.client.mod.secaggplus_mod`, Bell et al. 2020), and LightSecAgg (So et al. 2022; fedsim's core in
this folder, run as messages by fedsim/server/lightsecagg.py); see docs/secure_aggregation.md.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import ConfigDict, Field, model_validator

from fedsim.registry import AGGREGATORS, ATTACKS, COMPRESSORS, DEFENSES, PROTOCOLS, Params


LIGHTSECAGG_RECORD = "lightsecagg"  # the ConfigRecord naming a LightSecAgg message's `stage`
LIGHTSECAGG_STAGES = ("keys", "shares", "upload", "aggregate")
SECAGG_TIMING = "secagg-timing"  # the MetricRecord of a client's protocol seconds (a measurement, not protocol bytes)


class SecAggPlusSection(Params):
    """Flower's SecAgg+, chosen by `secure_aggregation: secaggplus`: the server learns only the round's sum.

    `SecAggPlusWorkflow`: pairwise masks from Diffie-Hellman keys, Shamir shares of each client's
    mask seed and key among `num_shares` neighbours, any `reconstruction_threshold` of which recover
    a dropped client's masks."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, allow_inf_nan=False)

    name: Literal["secaggplus"] = "secaggplus"
    num_shares: int | float = Field(
        1.0, gt=0, description="neighbours each client shares its secrets with: an int > 2, or a share of the "
        "round's clients (1.0: everyone, the SecAgg of Bonawitz et al.)")
    reconstruction_threshold: int | float = Field(
        0.5, gt=0, description="shares that recover a secret: an int < num_shares, or a share of num_shares "
        "(privacy against that many colluding clients minus one; dropouts up to num_shares - threshold)")
    clipping_range: float = Field(
        8.0, gt=0, description="c: each weighted coordinate is clipped to [-c, c] before quantisation")
    quantization_range: int = Field(
        2**22, gt=0, description="Q: [-c, c] is quantised to integers 0..Q (stochastic rounding, step 2c/Q)")
    modulus_range: int = Field(
        2**32, gt=0, le=2**32, description="M: masks and sums live modulo M (a power of 2, at most 2^32)")
    max_weight: float | None = Field(
        None, gt=0, description="W: the largest example count a client may report (weights are quantised as "
        "round(Q·w/W)/Q); default: the largest partition of the run")
    timeout: float | None = Field(
        None, gt=0, description="seconds each of the protocol's four exchanges waits for replies; default: "
        "federation.round_timeout")
    clip_norm: float | None = Field(
        None, gt=0, description="client-side L2 norm clipping: every honest client clips its update to this norm "
        "before masking (the norm-clipping defense that survives secure aggregation)")
    clip_attackers: bool = Field(
        True, description="with clip_norm: attackers clip too (the clipping runs in protocol code they do not control: "
        "a data-poisoning threat model or attested clients); false: they skip it, as a client that controls its own "
        "code would (enforcing the bound then needs zero-knowledge proofs, which Flower's SecAgg+ does not have)")

    @model_validator(mode="after")
    def _flower_checks(self) -> "SecAggPlusSection":
        """SecAggPlusWorkflow's own parameter checks, as validation errors instead of a failed round."""
        if isinstance(self.num_shares, int) and not isinstance(self.num_shares, bool) and self.num_shares != 1 \
                and self.num_shares <= 2:
            raise ValueError(f"num_shares as an integer must be greater than 2, got {self.num_shares}")
        if isinstance(self.num_shares, float) and self.num_shares > 1:
            raise ValueError(f"num_shares as a share of the round's clients must be at most 1.0, got {self.num_shares}")
        t = self.reconstruction_threshold
        if isinstance(t, float) and not 0 < t <= 1:
            raise ValueError(f"reconstruction_threshold as a share of num_shares must lie in (0, 1], got {t}")
        if isinstance(t, int) and isinstance(self.num_shares, int) and t != 1 and t >= self.num_shares:
            raise ValueError(f"reconstruction_threshold={t} must be less than num_shares={self.num_shares}")
        if self.modulus_range <= self.quantization_range:
            raise ValueError(f"modulus_range={self.modulus_range} must exceed quantization_range={self.quantization_range}")
        if bin(self.modulus_range).count("1") != 1:
            raise ValueError(f"modulus_range must be a power of 2, got {self.modulus_range}")
        return self

    def shares_for(self, n: int) -> tuple[int, int]:
        """(num_shares, threshold) for a round of n clients, as SecAggPlusWorkflow.setup_stage derives them."""
        if isinstance(self.num_shares, float) or self.num_shares == 1:
            frac = float(self.num_shares)
            shares = round(frac * n)
            if shares < n and shares & 1 == 0:
                shares += 1
            if shares <= 2:
                shares = n
        else:
            shares = self.num_shares
        t = self.reconstruction_threshold
        threshold = max(round(float(t) * shares), 2) if isinstance(t, float) or t == 1 else t
        if n != shares and shares & 1 == 0:  # the workflow makes it odd after sending the setup config
            shares += 1
        return shares, threshold

    def group_facts(self, n: int) -> dict:
        shares, threshold = self.shares_for(n)
        return {"num_shares": shares, "threshold": threshold}

    def group_problem(self, n: int) -> tuple[str, str, Any] | None:
        """Why a secure sum of n clients cannot run (field, reason, value), or None."""
        if n < 3:
            return ("federation.clients_per_round", f"Flower's SecAgg+ needs at least 3 clients per secure sum "
                    f"(threshold >= 2 of at least 3 shares), a round would aggregate {n}", n)
        shares, threshold = self.shares_for(n)
        if threshold > shares or shares > n:
            return ("secure_aggregation.num_shares", f"{n} clients per secure sum give num_shares={shares}, "
                    f"threshold={threshold}: every share count must lie in threshold..clients", self.num_shares)
        if n * (self.quantization_range + 1) >= self.modulus_range:
            return ("secure_aggregation.quantization_range", f"{n} clients' quantised values (each up to "
                    f"{self.quantization_range}) would wrap modulo modulus_range={self.modulus_range}",
                    self.quantization_range)
        return None

    def error_bound(self, clients: int, weights: list[float], max_weight: float) -> float:
        """Largest |SecAgg+ aggregate - Σ ŵ_i x_i / Σ ŵ_i| per coordinate, with ŵ_i = round(Q w_i / W) the
        quantised weights: each client's stochastically rounded coordinate is off by less than one
        step 2c/Q, and the server divides the sum by Σ ŵ_i / Q (docs/secure_aggregation.md)."""
        q_total = sum(round(w / max_weight * self.quantization_range) for w in weights)
        return 2 * self.clipping_range * clients / q_total


class LightSecAggSection(Params):
    """LightSecAgg (So et al., MLSys 2022), chosen by `secure_aggregation: lightsecagg`: one-shot mask recovery.

    fedsim/secagg/lightsecagg.py, run as four exchanges on the grid
    (fedsim/server/lightsecagg.py): each client's mask is MDS-coded into N shares, sent to the others
    encrypted under pairwise keys (Flower's SecAgg+ key agreement and Fernet), and the server decodes
    the survivors' aggregate mask in one step from any U aggregated shares."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, allow_inf_nan=False)

    name: Literal["lightsecagg"] = "lightsecagg"
    privacy: int | float = Field(
        0.5, ge=0, description="T: colluding clients that learn nothing about one client's mask: an int, or a share of "
        "the secure sum's clients (rounded down)")
    dropout: int | float = Field(
        0.3, ge=0, description="D: dropouts the round survives: an int, or a share of the clients (rounded up)")
    scale: float = Field(2.0**16, gt=0, description="c: updates are quantised as round(c·w/W·x) in F_p (stochastic "
                         "rounding)")
    max_weight: float | None = Field(
        None, gt=0, description="W: the largest example count; default: the largest partition of the run")
    timeout: float | None = Field(None, gt=0, description="seconds each exchange waits; default: federation.round_timeout")
    clip_norm: float | None = Field(None, gt=0, description="client-side L2 norm clipping before masking")
    clip_attackers: bool = Field(True, description="with clip_norm: attackers clip too (see secaggplus)")

    def params(self, n: int):
        """LightSecAggParams(N, T, D) for a secure sum of n clients (U = N - D)."""
        import math

        from fedsim.secagg.lightsecagg import LightSecAggParams

        t = self.privacy if isinstance(self.privacy, int) else math.floor(self.privacy * n)
        d = self.dropout if isinstance(self.dropout, int) else math.ceil(self.dropout * n)
        return LightSecAggParams(n, t, d)

    def group_facts(self, n: int) -> dict:
        p = self.params(n)
        return {"privacy": p.privacy, "dropout": p.dropout, "target": p.target}

    def group_problem(self, n: int) -> tuple[str, str, Any] | None:
        try:
            self.params(n)
        except ValueError as err:
            return ("secure_aggregation", f"{n} clients per secure sum: {err}", {"privacy": self.privacy,
                                                                                "dropout": self.dropout})
        return None

    def error_bound(self, clients: int, weights: list[float], max_weight: float) -> float:
        """Largest |LightSecAgg aggregate - FedAvg| per coordinate: each client's stochastically rounded
        c·w_i/W·x_i is off by less than 1, the weights are summed exactly, so the mean is off by less
        than n·W / (c·Σ w_i)."""
        return clients * max_weight / (self.scale * sum(weights))


SecureAggregationSection = Annotated[Union[SecAggPlusSection, LightSecAggSection], Field(discriminator="name")]


def parse_section(value: Any) -> Any:
    if isinstance(value, str):
        value = {"name": value}
    return value


def secure_aggregation_problems(sc) -> list[tuple[str, str, Any]]:
    """What a scenario with `secure_aggregation` asks for that needs individual updates on the server:
    (field path, reason, value), as fedsim/scenario.py: consistency_problems reports them. Each
    component says what it needs in its registry entry: a rule its `secure_sum`, a codec whether it
    is `dense`, a defense its `secure_alternative`."""
    sa = sc.secure_aggregation
    if sa is None:
        return []
    out: list[tuple[str, str, Any]] = []
    hidden = "under secure aggregation the server sees only the sum of a round's updates"
    agg = sc.aggregator
    rule = AGGREGATORS.get(agg.name).traits
    if rule.secure_sum is None:
        allowed = [e.name for e in AGGREGATORS.entries() if e.traits.secure_sum is not None]
        out.append(("aggregator", f"aggregator {agg.name} needs every client's update; {hidden}. Allowed: "
                    f"{', '.join(allowed)} (fedavg: the secure weighted sum; a group rule: secure group sums, a robust "
                    "rule across groups)", agg.name))
    else:
        problem = rule.secure_sum(agg)
        if problem is not None:
            field, why, value = problem
            out.append((field, f"{why}; {hidden}", value))
    for i, d in enumerate(sc.defenses):
        if not DEFENSES.get(d.name).traits.reads_updates:
            continue
        alternative = DEFENSES.get(d.name).traits.secure_alternative
        hint = f" Use {alternative}" if alternative else ""
        out.append((f"defenses.{i}", f"defense {d.name} runs on the server over the individual updates; {hidden}.{hint}",
                    d.name))
    if not COMPRESSORS.get(sc.compression.name).traits.dense:
        out.append(("compression", f"codec {sc.compression.name} encodes an individual update; secure aggregation masks the "
                    "dense quantised update, so the upload cannot be compressed", sc.compression.name))
    if sc.attack is not None and getattr(sc.attack, "name", None) is not None:
        if getattr(ATTACKS.get(sc.attack.name).obj, "side", "client") == "server":
            out.append(("attack", f"attack {sc.attack.name} is simulated on the server by replacing the attackers' rows "
                        f"with updates crafted from the honest ones; {hidden}", sc.attack.name))
    if sc.lowrank is not None:
        out.append(("lowrank", "low-rank switching is not supported under secure aggregation", sc.lowrank.name))
    n = sc.federation.clients_per_round
    sizes = sorted(set([n] if not rule.needs_groups else _group_sizes(n, agg.group_size)))
    for size in sizes:  # every secure sum a round makes must be able to run
        problem = sa.group_problem(size)
        if problem is not None:
            field, reason, value = problem
            if rule.needs_groups and field == "federation.clients_per_round":
                field = "aggregator.group_size"
            out.append((field, reason, value))
            break
    return out


def _group_sizes(n: int, r: int) -> list[int]:
    count = max(1, n // r)
    return [r] * (count - 1) + [n - r * (count - 1)]


# The two protocols, chosen by the scenario's `secure_aggregation: {name: ...}`; the server runs their
# exchanges (fedsim/server/secure.py), the client its step (fedsim/client/secure.py).
PROTOCOLS.register("secaggplus", SecAggPlusSection, exchange="fedsim.server.secure:SecAggPlusExchange",
                   client_step="fedsim.client.secure:secure_train", chosen_by="secure_aggregation",
                   scenario_check=secure_aggregation_problems, individual_updates=False)(SecAggPlusSection)
PROTOCOLS.register("lightsecagg", LightSecAggSection, exchange="fedsim.server.secure:LightSecAggExchange",
                   client_step="fedsim.client.secure:secure_train", chosen_by="secure_aggregation",
                   scenario_check=secure_aggregation_problems, individual_updates=False)(LightSecAggSection)
