"""The scenario YAML schema: pydantic models per section, built from the component registries.

Component sections (`model`, `aggregator`, `defenses`, `attack`, `compression`, `data.dataset`,
`data.partition`) take `name:` plus that component's own parameters, validated by the
component's parameter model; `name: krum` may also be written as the plain string `krum`.
Unknown keys are errors everywhere. `load_scenario` reads a file with `yaml.safe_load`, applies
`--set a.b=value` overrides, and raises `ScenarioError` listing every problem by field path.
"""

import functools
import hashlib
import json
import reprlib
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator

from fedsim.devices import DeviceName, GpuShare
from fedsim.registry import (AGGREGATORS, ATTACKS, COMPRESSORS, DATASETS, DEFENSES, MODELS, PARTITIONERS,
                             PRIVACY_ATTACKS, PROTOCOLS, TRACKING_SINKS, Registry, chooses, load, protocol_for)
from fedsim.clock.config import SystemsSection
from fedsim.secagg.config import SecureAggregationSection
from fedsim.secagg.config import parse_section as parse_secure_aggregation


MAX_CLIENTS = 1_000_000  # registered clients a scenario may name (far beyond what one machine simulates)


class Section(BaseModel):
    # allow_inf_nan=False: `.inf`/`.nan` learning rates, weight decays, CPU shares... are refused
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, allow_inf_nan=False)


def _name_shorthand(default: str | None, value: Any) -> Any:
    if isinstance(value, str):
        return {"name": value}
    if isinstance(value, dict) and "name" not in value and default is not None:
        return {"name": default, **value}  # `--set model.hidden=[8]` keeps the default model
    return value


def component(registry: Registry, default: str | None = None, also: list | None = None) -> Any:
    """The type of a YAML component section: a union of the registry's specs, told apart by `name`.

    A plain string is shorthand for `{name: ...}`; a mapping without `name` means the default.
    `also`: entries of another kind the section may name too (the round protocols chosen by the
    `aggregator` section: `aggregator: fedma`).
    """
    models = [e.spec_model() for e in [*registry.entries(), *(also or [])]]
    if not models:
        return Annotated[dict, AfterValidator(functools.partial(_none_registered, registry.kind))]
    inner: Any = models[0] if len(models) == 1 else Annotated[Union[tuple(models)], Field(discriminator="name")]
    return Annotated[inner, BeforeValidator(functools.partial(_name_shorthand, default))]


def _none_registered(kind: str, value: Any) -> Any:
    raise ValueError(f"no {kind} is registered")


def distinct_sinks(sinks: list) -> list:
    """The scenario's `tracking` list, each sink named once: a run has one run per library, and
    tracking.json keeps its ids by sink name."""
    names = [s.name for s in sinks]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"{', '.join(twice)} listed more than once; list each sink once")
    return sinks


class LocalDPSection(Section):
    """Local differential privacy (fedsim/privacy/local.py): every honest client clips its update to
    L2 norm `clip` and adds N(0, (noise_multiplier·clip)²) to each coordinate before sending it."""

    clip: float = Field(..., gt=0, description="C: the L2 bound of a client's update")
    noise_multiplier: float = Field(..., ge=0, le=1e4, description="z: the noise std is z·C on every coordinate")
    delta: float | None = Field(
        None, gt=0, lt=1, description="δ of the per-client ε the server reports; default: the largest power of ten below 1/num_clients")


class FederationSection(Section):
    num_clients: int = Field(20, ge=1, le=MAX_CLIENTS, description="registered clients (one partition each)")
    clients_per_round: int = Field(10, ge=1, le=MAX_CLIENTS, description="clients sampled per round (<= num_clients)")
    rounds: int = Field(15, ge=1, le=1_000_000, description="training rounds (asynchronous protocols: server steps)")
    local_epochs: int = Field(2, ge=1, le=100_000)
    batch_size: int = Field(32, ge=1, le=10_000_000, description="examples per local SGD step (at most 10 million)")
    lr: float = Field(0.1, gt=0)
    lr_decay: float = Field(1.0, gt=0, le=1, description="lr in round t is lr * lr_decay**(t-1)")
    momentum: float = Field(0.0, ge=0, lt=1)
    weight_decay: float = Field(0.0, ge=0)
    proximal_mu: float = Field(0.0, ge=0, le=1e6, description="FedProx's μ: honest clients add μ/2·‖w − w_global‖² to their loss (0: FedAvg)")
    local_steps: int | None = Field(
        None, ge=1, le=10_000_000, description="stop local training after this many SGD steps (1 with batch_size >= a partition: FedSGD)")
    client_cpus: float = Field(
        1.0, gt=0, description="CPUs per Ray client actor (1 on 2 cores gives 2 actors); a client trains with that many torch threads (at least 1)"
    )
    client_gpus: GpuShare = Field(
        0.0, ge=0, le=64, description="GPU share of each Ray client actor (0.25: four clients per GPU); 0: no GPU "
        "for the simulation's clients (docs/gpu.md)")
    client_memory_gb: float | None = Field(
        None, gt=0, le=1_000_000, description="the most memory (GB) a client's process may hold while it runs a message, "
        "its resident set measured as it runs: over it the message fails with the limit and the peak as the reason, and "
        "the run goes on; also each Ray client actor's `memory` resource (default: no limit; docs/performance.md)")
    device: DeviceName = Field(
        "auto", description="where honest clients train: auto (CUDA when the client has a GPU, else CPU), cpu, cuda, "
        "cuda:N; attackers train on CPU (docs/gpu.md)")
    precision: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32", description="honest clients' training precision: fp32, or bf16 / fp16 autocast (fp16 with loss scaling)")
    round_timeout: float = Field(600.0, gt=0, description="seconds to wait for a round's replies")
    min_replies: int = Field(1, ge=1, description="skip the round (logged) when fewer valid updates arrive")
    ray_address: str | None = Field(
        None, description="attach to this running Ray cluster ('auto', 'HOST:6379'; default: $RAY_ADDRESS, else start one)"
    )
    local_dp: LocalDPSection | None = Field(
        None, description="local differential privacy on the clients: {clip, noise_multiplier} (docs/privacy.md)")
    vectorize: Literal["auto", "on", "off"] = Field(
        "auto", description="train a worker's cohort of honest clients as one torch.func computation: auto (where the "
        "model and protocol allow, else one by one with the reason logged), on (refused at validation where they do "
        "not), off (one by one); docs/performance.md")
    @field_validator("vectorize", mode="before")
    @classmethod
    def _yaml_on_off(cls, value):
        """YAML 1.1 reads a bare `on` / `off` as true / false: take them as the words they were."""
        return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value

    cohort_size: int | None = Field(
        None, ge=1, le=MAX_CLIENTS, description="at most this many clients in one vectorised computation (memory bound; "
        "default: what keeps a step's activations in the CPU's last-level cache, or fits half the GPU's memory)")


class InitSection(Section):
    """Where the global model starts. The papers start attacks from a pre-trained model
    (Attack of the Tails loads a checkpoint trained for 10 epochs), not from random weights."""

    checkpoint: str | None = Field(None, description="a state-dict file (torch.save), read with weights_only=True")
    pretrain_epochs: int = Field(0, ge=0, description="central SGD epochs on the clean training set before round 1")
    pretrain_share: float = Field(1.0, gt=0, le=1, description="share of the training set used for pre-training")
    pretrain_lr: float = Field(0.05, gt=0)
    pretrain_batch_size: int = Field(64, ge=1)


class Pufferfish(Section):
    """Pufferfish (Wang et al., MLSys 2021): train factorized layers W = U V^T at rank
    floor(rank_ratio * full rank), after `warmup_rounds` of full-rank training (hybrid warm-up);
    the factors start from a truncated SVD of the warmed-up weights."""

    name: Literal["pufferfish"] = "pufferfish"

    def start(self, switch, vec):  # the server's switch (fedsim/lowrank/switch.py) runs this scheme's rule
        return switch.pufferfish_start(vec)

    def after_round(self, switch, rnd: int, vec):
        return switch.pufferfish_after_round(rnd, vec)

    rank_ratio: float = Field(0.25, gt=0, le=1, description="rank = floor(ratio * full rank) (official: 1/4)")
    warmup_rounds: int = Field(0, ge=0, description="full-rank rounds before factorizing")
    skip_first: int = Field(1, ge=0, description="leading layers kept full rank")
    skip_last: int = Field(1, ge=0, description="trailing layers kept full rank")


class Cuttlefish(Section):
    """Cuttlefish (Wang et al., MLSys 2023): start full rank, track each layer's stable rank on the
    server every round, switch to factorized layers at the scaled stable rank once every layer's
    smoothed rank curve is flat (the official rule, with rounds in place of epochs)."""

    name: Literal["cuttlefish"] = "cuttlefish"

    def start(self, switch, vec):  # the server's switch (fedsim/lowrank/switch.py) runs this scheme's rule
        return switch.cuttlefish_start(vec)

    def after_round(self, switch, rnd: int, vec):
        return switch.cuttlefish_after_round(rnd, vec)

    window: int = Field(15, ge=2, description="EMA window of the rank curves (official: 15)")
    min_rounds: int | None = Field(None, ge=0, description="no switch before this round (default: window)")
    tail: int = Field(11, ge=2, description="rounds whose mean slope must be under the threshold (official: 11)")
    threshold: float = Field(0.1, gt=0, description="flatness threshold on the mean |slope| (official: 0.1)")
    threshold_scaler: float = Field(1.0, gt=0, description="looser threshold for the last 1-2 layers (official: 1.0; 2.5 for ResNet-18/VGG-19)")
    skip_first: int = Field(1, ge=0)
    skip_last: int = Field(1, ge=0)


class EdgeCopySection(Section):
    """One edge copy of the global model (fedsim/models/edge_copy.py, docs/edge_model.md): pruned, then quantized,
    as a device's deployment pipeline would, with PyTorch's own utilities."""

    name: str | None = Field(
        None, pattern=r"^[A-Za-z][A-Za-z0-9_]*$", max_length=40,
        description="the copy's key in rounds.jsonl and summary.json; default from the settings: int8, fp16, prune50, "
        "prune50_int8, ...")
    quantize: Literal["int8", "int8_static", "fp16"] | None = Field(
        None, description="int8: torch.ao.quantization.quantize_dynamic (Linear and LSTM weights int8 per tensor, "
        "activations quantized per batch at run time; conv layers stay fp32); int8_static: torch.fx static "
        "quantization of every layer, activations calibrated (image models); fp16: the model in half precision")
    calibration: int = Field(
        256, ge=1, le=100_000, description="int8_static: test examples whose activation ranges calibrate the copy "
        "(a fixed seeded subset of the evaluated test set)")
    prune: float | None = Field(
        None, gt=0, lt=1, description="share of the prunable weights (Linear, conv, LSTM weight matrices; no bias, "
        "BatchNorm or embedding) set to zero by L1 magnitude with torch.nn.utils.prune, made permanent")
    prune_scope: Literal["global", "layer"] = Field(
        "global", description="global: the smallest |w| over all prunable weights together (global_unstructured); "
        "layer: that share in each weight tensor (l1_unstructured)")

    def key(self) -> str:
        """The copy's name: its own, or one made from its settings (prune 0.5 + int8 -> prune50_int8)."""
        if self.name is not None:
            return self.name
        parts = [] if self.prune is None else [f"prune{self.prune * 100:g}".replace(".", "_")
                                               + ("" if self.prune_scope == "global" else "_layer")]
        return "_".join(parts + ([self.quantize] if self.quantize else []))


def _one_or_many(value: Any) -> Any:
    return [value] if isinstance(value, dict) else value


def _edge_copies(copies: list[EdgeCopySection]) -> list[EdgeCopySection]:
    for i, c in enumerate(copies):
        if c.quantize is None and c.prune is None:
            raise ValueError(f"edge copy {i} changes nothing: give it quantize (int8, fp16), prune (0 < share < 1) or both")
    keys = [c.key() for c in copies]
    twice = sorted({k for k in keys if keys.count(k) > 1})
    if twice:
        raise ValueError(f"two edge copies are named {', '.join(twice)}: give each its own `name`")
    return copies


class EvaluationSection(Section):
    every: int = Field(1, ge=1, description="central evaluation every k rounds (and always the last)")
    initial: bool = Field(False, description="also evaluate the initial model (round 0)")
    device: DeviceName = Field("auto", description="where the central evaluation runs: auto, cpu, cuda, cuda:N (docs/gpu.md)")
    batch_size: int = Field(
        64, ge=1,
        description="images per forward pass; 64 keeps a conv net's activations in cache (LeNet on MNIST, one thread: "
        "~1.4x faster than 256 on CPU; see docs/performance.md)",
    )
    overlap: bool = Field(
        True,
        description="evaluate round t in a background thread while round t+1 trains (metrics unchanged; "
        "see docs/performance.md)",
    )
    threads: int | None = Field(
        None, ge=1,
        description="torch threads of the central evaluation; default: 1 when overlapped (the client actors "
        "have the cores), torch's default when in line",
    )
    test_subset: int | None = Field(
        None, ge=1, description="evaluate main accuracy on this many test images (a fixed seeded subset); default: all"
    )
    implant_threshold: float = Field(
        0.5, gt=0, le=1, description="backdoor success that counts as implanted / still alive (the lifecycle in summary.json)"
    )
    edge_model: Annotated[list[EdgeCopySection], BeforeValidator(_one_or_many), AfterValidator(_edge_copies)] = Field(
        default_factory=list, max_length=8,
        description="edge copies of the global model (a list, or one mapping): each central evaluation also measures "
        "main accuracy and backdoor success on each, as a device would run it (docs/edge_model.md)")


class ServerSection(Section):
    optimizer: Literal["sgd", "adam", "yogi", "adagrad"] = Field(
        "sgd", description="how the aggregate moves the global model: sgd (FedAvg, FedAvgM with momentum) or FedOpt's "
        "adam / yogi / adagrad (Reddi et al. 2021, Flower's maths)")
    lr: float = Field(1.0, gt=0, le=1000, description="server learning rate η (1 with sgd: FedAvg; a lower one is itself a defense)")
    momentum: float = Field(0.0, ge=0, lt=1, description="sgd: server momentum β (FedAvgM)")
    beta_1: float = Field(0.9, ge=0, lt=1, description="adam / yogi / adagrad: first-moment decay (Flower's default)")
    beta_2: float = Field(0.99, ge=0, lt=1, description="adam / yogi: second-moment decay (Flower's default)")
    tau: float = Field(1e-3, gt=0, le=1, description="adam / yogi / adagrad: adaptivity τ (Reddi et al.; Flower's default)")
    device: DeviceName = Field(
        "auto", description="where the defenses and the aggregation rule run on the round's updates: auto, cpu, cuda, "
        "cuda:N (docs/gpu.md)")


class OutputSection(Section):
    dir: str = Field("results", description="parent folder of the run folders")
    checkpoints: bool = Field(True, description="save server and client state every round, so `--resume` works")


def consistency_problems(sc) -> list[tuple[str, str, Any]]:
    """What each section allows alone but the scenario as a whole cannot run: every scenario that
    validates must be able to aggregate a round (field path, message naming both settings, value)."""
    fed, out = sc.federation, []
    if fed.clients_per_round > fed.num_clients:
        out.append(("federation.clients_per_round",
                    f"exceeds federation.num_clients={fed.num_clients}: a round cannot sample more clients than exist",
                    fed.clients_per_round))
    if fed.min_replies > fed.clients_per_round:
        out.append(("federation.min_replies",
                    f"exceeds federation.clients_per_round={fed.clients_per_round}: every round would be skipped",
                    fed.min_replies))
    problem = sc.aggregator.round_problem(min(fed.clients_per_round, fed.num_clients))
    if problem:
        out.append((f"aggregator.{problem[0]}" if problem[0] else "aggregator",
                    f"{problem[1]} (federation.clients_per_round={fed.clients_per_round}): every round would be skipped",
                    problem[2]))
    if sc.attack is not None:
        try:
            sc.attack.resolve_attackers(fed.num_clients, sc.seed)
        except ValueError as err:
            out.append(("attack", str(err), sc.attack.attacker_ids if sc.attack.attacker_ids is not None else sc.attack.num_attackers))
    named = [e.name for e in PROTOCOLS.entries() if chooses(sc, e)]
    if len(named) > 1:
        out.append(("secure_aggregation", f"the scenario names two round protocols ({' and '.join(named)}); a round "
                    "runs one: drop one of them", named))
        return out
    protocol = protocol_for(sc)
    check = load(protocol.traits.scenario_check)
    if check is not None:  # the round protocol's own refusals (FedMA: no codecs, defenses, low rank, ...)
        out += check(sc)
    if fed.local_dp is not None:  # what local DP's per-client noise cannot serve
        why = None
        if not protocol.traits.update_pipeline:
            why = "runs its own client protocol, whose messages local DP does not privatize"
        elif getattr(sc.aggregator, "redundancy", False):
            why = "votes on the bit-identical updates of a redundant group, which per-client noise makes differ"
        if why:
            out.append(("federation.local_dp", f"aggregator {sc.aggregator.name} {why}; drop one of the two", sc.aggregator.name))
    for i, d in enumerate(sc.defenses):  # a defense's own refusals (DP-FedAvg: the mean, and last)
        defense_check = DEFENSES.get(d.name).traits.scenario_check
        if defense_check is not None:
            out += defense_check(sc, i)
    out += privacy_attack_problems(sc, protocol)
    if sc.systems is None:  # simulated time as a tracking step needs the federation clock
        for i, sink in enumerate(sc.tracking):
            if getattr(sink, "step", "round") == "sim_ms":
                out.append((f"tracking.{i}.step", "sim_ms needs the federation clock: add a `systems:` section or "
                            "log by round", "sim_ms"))
    if sc.lowrank is not None:
        # defenses that declare they rely on the model's tensors staying as they are (a per-layer
        # history, named layers): fixed_layers(spec) -> bool in their registry entry
        fixed = [d.name for d in sc.defenses if DEFENSES.get(d.name).traits.fixed_layers(d)]
        if fixed:
            out.append(("lowrank", f"lowrank.name={sc.lowrank.name} changes the model's layers mid-run, which defenses={fixed} "
                        "cannot follow (their per-layer history or named layers would no longer fit); drop one of the two",
                        sc.lowrank.name))
    return out


def privacy_attack_problems(sc, protocol) -> list[tuple[str, str, Any]]:
    """What the scenario's privacy attacks need of the rest of it: rounds that run, clients that
    exist, the model they rely on, and a protocol that shows the server what they read."""
    out, fed = [], sc.federation
    for i, spec in enumerate(sc.privacy_attacks):
        entry, where = PRIVACY_ATTACKS.get(spec.name), f"privacy_attacks.{i}"
        late = [r for r in spec.rounds if not 1 <= r <= fed.rounds]
        if late:
            out.append((f"{where}.rounds", f"rounds {late} never run (federation.rounds={fed.rounds})", spec.rounds))
        unknown = [c for c in (getattr(spec, "clients", None) or []) if not 0 <= c < fed.num_clients]
        if unknown:
            out.append((f"{where}.clients", f"no such clients (federation.num_clients={fed.num_clients})", spec.clients))
        if entry.traits.needs_model is not None and sc.model.name != entry.traits.needs_model:
            out.append((where, f"{spec.name} reads the layer the malicious server's model "
                        f"{entry.traits.needs_model!r} plants: set model.name={entry.traits.needs_model}", sc.model.name))
        if not protocol.traits.update_pipeline or protocol.traits.opens_rounds:
            why = ("its rounds end in no update batch" if not protocol.traits.update_pipeline else
                   "its updates were trained from older global models than the one the server holds")
            out.append((where, f"the round protocol {protocol.name} cannot be attacked this way: {why}", spec.name))
        elif getattr(spec, "observe", None) == "upload" and not protocol.traits.individual_updates:
            out.append((f"{where}.observe", f"under {protocol.name} the server never sees one client's upload, only "
                        "sums: observe the aggregate", "upload"))
    return out


def build_scenario_model() -> type[BaseModel]:
    """The Scenario model, with component unions over everything registered now."""

    Dataset, Partition = component(DATASETS, "digits"), component(PARTITIONERS, "dirichlet")
    by_aggregator = [e for e in PROTOCOLS.entries() if e.traits.chosen_by == "aggregator"]
    Model, Aggregator = component(MODELS, "mlp"), component(AGGREGATORS, "fedavg", also=by_aggregator)
    Defense, Attack, Compressor = component(DEFENSES), component(ATTACKS), component(COMPRESSORS, "none")
    TrackingSink = component(TRACKING_SINKS)
    PrivacyAttack = component(PRIVACY_ATTACKS)

    class DataSection(Section):
        dataset: Dataset = "digits"
        dir: str | None = Field(None, description="data directory; default: $FEDSIM_DATA_DIR")
        partition: Partition = "dirichlet"

    class Scenario(Section):
        name: str = Field("scenario", pattern=r"^[A-Za-z0-9_.-]+$", max_length=128,
                          description="names the run folder (with a timestamp): letters, digits, _ . -, at most 128")
        seed: int = Field(0, ge=0, le=2**32 - 1, description="fixes every random stream (a 32-bit seed, as torch and numpy take)")
        deterministic: bool = Field(
            False, description="PyTorch's switches for reproducible runs, on the server and around each client's training "
            "(docs/gpu.md)")
        data: DataSection = Field(default_factory=DataSection)
        model: Model = "mlp"
        init: InitSection = Field(default_factory=InitSection)
        federation: FederationSection = Field(default_factory=FederationSection)
        aggregator: Aggregator = "fedavg"
        defenses: list[Defense] = Field(default_factory=list)
        attack: Attack | None = None
        compression: Compressor = "none"
        lowrank: Annotated[
            Union[Pufferfish, Cuttlefish], Field(discriminator="name"), BeforeValidator(functools.partial(_name_shorthand, None))
        ] | None = None
        server: ServerSection = Field(default_factory=ServerSection)
        evaluation: EvaluationSection = Field(default_factory=EvaluationSection)
        output: OutputSection = Field(default_factory=OutputSection)
        secure_aggregation: Annotated[SecureAggregationSection, BeforeValidator(parse_secure_aggregation)] | None = Field(
            None, description="secure aggregation: {name: secaggplus, ...}; the server sees only the sum of a round's "
            "updates (docs/secure_aggregation.md)")
        systems: SystemsSection | None = Field(
            None, description="devices, networks, availability and a simulated clock; the round's policy on it "
            "(docs/clock.md)")
        privacy_attacks: Annotated[list[PrivacyAttack], BeforeValidator(_one_or_many)] = Field(
            default_factory=list, description="what a curious or malicious server recovers: gradient inversion on "
            "uploads or aggregates, membership inference on the global model (docs/leakage.md)")
        tracking: Annotated[list[TrackingSink], AfterValidator(distinct_sinks)] = Field(
            default_factory=list, description="copy the run into tensorboard / mlflow / wandb as it runs (docs/tracking.md)")

    return Scenario


@functools.cache
def scenario_model() -> type[BaseModel]:
    return build_scenario_model()


class ScenarioError(ValueError):
    """A scenario that does not validate; `problems` holds (field path, message, bad value)."""

    def __init__(self, source: str, problems: list[tuple[str, str, Any]]) -> None:
        self.source, self.problems = source, problems
        lines = [f"{excerpt(source, 200)}: {len(problems)} problem(s)"]
        lines += [f"  {excerpt(path, 200)}: {excerpt(msg, 2000)} (got {excerpt(value)})" for path, msg, value in problems[:MAX_PROBLEMS]]
        if len(problems) > MAX_PROBLEMS:
            lines.append(f"  ... and {len(problems) - MAX_PROBLEMS} more")
        super().__init__("\n".join(lines))


MAX_PROBLEMS = 50
_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxdict, _REPR.maxlist, _REPR.maxstring, _REPR.maxother = 3, 6, 6, 80, 80


def excerpt(value: Any, limit: int = 120) -> str:
    """A bounded rendering of a (possibly huge, deeply nested or alias-expanded) value for an error
    message: never more than `limit` characters, whatever the value is."""
    text = value if isinstance(value, str) and limit > 120 else _REPR.repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _problems(err: ValidationError) -> list[tuple[str, str, Any]]:
    out = []
    for e in err.errors(include_url=False):
        path = ".".join(str(p) for p in e["loc"]) or "<top>"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        elif e["type"] == "union_tag_invalid":
            msg = f"unknown name; allowed: {e['ctx']['expected_tags']}"
        out.append((path, msg, e.get("input")))
    return out


def parse_value(text: str) -> Any:
    """A `--set` value, read as YAML so numbers, booleans, lists and null work (`a.b=[1, 2]`)."""
    return yaml.safe_load(text) if text.strip() else ""


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """Apply `a.b.c=value` overrides to a nested dict (creating sections as needed)."""
    for item in overrides:
        if "=" not in item:
            raise ScenarioError("--set", [(item, "expected KEY.PATH=VALUE", item)])
        key, value = item.split("=", 1)
        node = raw
        parts = key.strip().split(".")
        for part in parts[:-1]:
            if isinstance(node.get(part), str):  # `aggregator: krum` then `--set aggregator.f=1`
                node[part] = {"name": node[part]}
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ScenarioError("--set", [(key, f"{part} is not a section", node)])
        try:
            parsed = parse_value(value)
        except yaml.YAMLError as err:
            raise ScenarioError("--set", [(key, f"not a YAML value: {excerpt(str(err), 300)}", value)]) from None
        check_size(parsed, "--set")
        node[parts[-1]] = parsed
    return raw


def validate_scenario(raw: Any, source: str = "<scenario>"):
    if not isinstance(raw, dict):
        raise ScenarioError(source, [("<top>", "a scenario must be a mapping of sections", raw)])
    try:
        scenario = scenario_model().model_validate(raw)
    except ValidationError as err:
        raise ScenarioError(source, _problems(err)) from None
    except RecursionError:
        raise ScenarioError(source, [("<file>", f"nested deeper than {MAX_DEPTH} levels", None)]) from None
    problems = consistency_problems(scenario)
    if problems:
        raise ScenarioError(source, problems)
    return scenario


MAX_FILE_BYTES = 1 << 20  # a scenario is a page of YAML; 1 MiB leaves room for generated sweeps
MAX_DEPTH = 40  # nesting of mappings and lists
MAX_VALUES = 100_000  # values after YAML aliases are expanded (an alias bomb expands to billions)


def read_yaml(path: str | Path) -> dict:
    """A scenario file as plain data, refusing anything that could hang or crash what reads it next:
    non-files, over MAX_FILE_BYTES, not UTF-8, not YAML, nested deeper than MAX_DEPTH, or
    expanding (through aliases) to more than MAX_VALUES values."""
    from fedsim.scenario_files import missing_file_message, resolve_scenario_path

    path = resolve_scenario_path(path)

    def bad(msg: str, value: Any = str(path)) -> ScenarioError:
        return ScenarioError(str(path), [("<file>", msg, value)])

    try:
        if path.is_dir():
            raise bad("is a directory, not a scenario file")
        with open(path, "rb") as fh:
            data = fh.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        raise bad(missing_file_message(path)) from None
    except OSError as err:  # also a name too long for the file system
        raise bad(f"cannot read: {err.strerror or err}", excerpt(str(path))) from None
    if len(data) > MAX_FILE_BYTES:
        raise bad(f"larger than {MAX_FILE_BYTES // 1024} KiB; a scenario file is a page of YAML")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise bad(f"not UTF-8 text (byte {err.start}); save it as UTF-8", data[:16]) from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise bad(f"not valid YAML: {excerpt(str(err), 500)}", None) from None
    except RecursionError:
        raise bad(f"nested deeper than {MAX_DEPTH} levels", None) from None
    check_size(raw, str(path))
    return {} if raw is None else raw


def check_size(raw: Any, source: str) -> None:
    """Refuse data nested deeper than MAX_DEPTH or holding more than MAX_VALUES values once YAML
    aliases are expanded; stops counting at the limit, so the check itself is bounded."""
    count, stack = 0, [(raw, 0)]
    while stack:
        node, depth = stack.pop()
        count += 1
        if count > MAX_VALUES:
            raise ScenarioError(source, [("<file>", f"expands to more than {MAX_VALUES} values (YAML aliases?)", None)])
        if depth > MAX_DEPTH:
            raise ScenarioError(source, [("<file>", f"nested deeper than {MAX_DEPTH} levels", None)])
        if isinstance(node, dict):
            stack += [(k, depth + 1) for k in node] + [(v, depth + 1) for v in node.values()]
        elif isinstance(node, list):
            stack += [(v, depth + 1) for v in node]


def load_scenario(path: str | Path, overrides: list[str] | None = None):
    raw = read_yaml(path)
    if isinstance(raw, dict):
        raw = apply_overrides(raw, list(overrides or []))
    return validate_scenario(raw, str(path))


def _name_first(node: Any) -> Any:
    if isinstance(node, dict):
        keys = sorted(node, key=lambda k: k != "name")
        return {k: _name_first(node[k]) for k in keys}
    if isinstance(node, list):
        return [_name_first(v) for v in node]
    return node


def scenario_dict(scenario) -> dict:
    """The resolved scenario as plain data, each component's `name` first."""
    return _name_first(scenario.model_dump(mode="json"))


def scenario_fingerprint(scenario) -> str:
    """A short SHA-256 of the scenario's values that differ from the defaults, less `output` (where
    results go, not what they are): a checkpoint written under one scenario is refused by a run of
    another, while a fedsim that adds a field with a default still resumes an older run."""
    data = {k: v for k, v in scenario.model_dump(mode="json", exclude_defaults=True).items() if k != "output"}
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def dump_scenario(scenario) -> str:
    """The resolved scenario (every default filled in) as YAML."""
    return yaml.safe_dump(scenario_dict(scenario), sort_keys=False)
