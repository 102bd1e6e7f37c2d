"""`RoundRecord`: one line of `rounds.jsonl`, field by field. This class *is* the file's schema.

A line is written when its round closes (after the central evaluation), so an interrupted run
keeps every completed round. Client ids are partition ids (0..num_clients-1); in JSON, dict keys
are strings. A field left `UNSET` is absent from the line (see each field for when); a field set
to None is written as null.

Which fields a line has:
- round 0 (the initial model, with `evaluation.initial`): round, sampled, attackers, bytes_up,
  bytes_down, the evaluation fields, wall_seconds;
- a trained round: everything from `round` to `honest_update_norm_median` (`attacker_train_seconds`
  when a client-side attacker took part, `rounds_since_attack` when the scenario has an attack), plus, once its updates
  reached the defenses and rule, `detection`, and, when it was aggregated (`skipped` is null),
  `aggregated`, `global_norm` and `model_params`;
- with `evaluation.edge_model`, on evaluated rounds, `edge_model`; with a certifying defense (CRFL), on its rounds, `certification`; with `federation.local_dp`, `local_privacy`;
  with `privacy_attacks`, in their rounds, `privacy_attack` and `privacy_attack_seconds`;
- with a server-side attack in a round it crafted updates, `attack`; with a group rule (DETOX) `groups`, with a rule that reports its choice (Krum, Multi-Krum,
  DETOX) `aggregator`, with a low-rank switch in this round `lowrank`, with FedMA its four fields; under secure aggregation `secure_aggregation` and `secure_aggregation_seconds`;
- on the federation clock (`systems:`, docs/clock.md), on trained rounds: `sim_start`, `sim_seconds`, `sim_time`,
  `unavailable` (and `unavailable_clients` up to 1,000 registered clients), `dropped_out`, `stragglers`, `client_seconds`, and with AdaComm `local_steps` and `start_loss`;
  under an asynchronous protocol (fedasync, fedbuff) a line is a server step: `sampled` is its buffer's clients, and
  `staleness`, `trained_from`, `arrived`, `started`, `discarded`, `in_flight` join `sim_start`, `sim_seconds`,
  `sim_time`, `dropped_out`, `stragglers` (clients given up at the timeout) and `client_seconds`.
  They are simulated, not measured: reproducible, so not among TIME_FIELDS.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields


class _Unset:
    """Marks a field that is not part of this round's line."""

    def __repr__(self) -> str:
        return "UNSET"


UNSET = _Unset()


@dataclass
class RoundRecord:
    round: int  # 1-based training round; 0 is the initial model's evaluation
    sampled: list[int] = field(default_factory=list)  # clients sent the model, in partition-id order
    attackers: list[int] = field(default_factory=list)  # the sampled clients that attack this round
    bytes_down: int = 0  # serialized bytes of every message sent to clients (model + config)
    bytes_down_per_client: dict | _Unset = UNSET  # client -> bytes sent to it (trained rounds)
    bytes_up: int = 0  # serialized bytes of every reply received, as they crossed the wire
    bytes_up_per_client: dict | _Unset = UNSET  # client -> bytes it uploaded
    groups: list | _Unset = UNSET  # group rules (DETOX): the sampled clients' groups
    rejected: dict | _Unset = UNSET  # client -> why its upload was not used (malformed, error, timeout)
    defenses: dict | _Unset = UNSET  # defense name -> what it reported (removed, clipped, scores, ...)
    skipped: str | None | _Unset = UNSET  # why the round was not aggregated (the global model stays), or null
    train_loss: float | None | _Unset = UNSET  # mean reported training loss of the accepted uploads
    attacker_update_norms: dict | _Unset = UNSET  # attacker -> L2 norm of its decoded update (as a server-side attack crafted it)
    attack: dict | _Unset = UNSET  # a server-side attack's choices this round (γ, z, λ, mimicked client, ...)
    attacker_train_seconds: dict | _Unset = UNSET  # client-side attacker -> seconds of its local training (its cost)
    local_privacy: dict | _Unset = UNSET  # with federation.local_dp: the most-sampled client's ε so far (fedsim/privacy/local.py)
    rounds_since_attack: int | None | _Unset = UNSET  # with an attack: rounds since the last round with an attacker
    #   (0 in an attack round, null before the first): the x axis of a durability curve
    honest_update_norm_median: float | None | _Unset = UNSET  # median L2 norm of the honest decoded updates
    sim_start: float | _Unset = UNSET  # with `systems:`: simulated seconds since the run's start when the round opened
    sim_seconds: float | _Unset = UNSET  # with `systems:`: the round's simulated duration, from its start to the next
    #   round's (the policy's close plus the server's time)
    sim_time: float | _Unset = UNSET  # with `systems:`: simulated seconds since the run's start when the round closed
    unavailable: int | _Unset = UNSET  # with `systems:`: registered clients not checked in at the round's start
    unavailable_clients: list[int] | _Unset = UNSET  # with `systems:` and at most 1,000 registered clients: which ones
    dropped_out: list[int] | _Unset = UNSET  # with `systems:`: selected clients that disappeared during the round
    stragglers: list[int] | _Unset = UNSET  # with `systems:`: clients still working when the round closed (discarded,
    #   not a failure: absent from `rejected`, their uploads not counted in bytes_up)
    client_seconds: dict | _Unset = UNSET  # with `systems:`: client -> [download, compute, upload] simulated seconds
    staleness: dict | _Unset = UNSET  # asynchronous protocols: client -> server steps applied since its update's task
    #   started (the buffer's clients are `sampled`, in partition-id order)
    trained_from: dict | _Unset = UNSET  # asynchronous protocols: client -> the model version (server step) it trained from
    arrived: dict | _Unset = UNSET  # asynchronous protocols: client -> simulated time its update entered the buffer
    started: list[int] | _Unset = UNSET  # asynchronous protocols: clients that started training during this step
    discarded: list[int] | _Unset = UNSET  # asynchronous protocols: attackers that dropped a stale update (not sent)
    in_flight: int | _Unset = UNSET  # asynchronous protocols: clients training when the step closed
    local_steps: int | _Unset = UNSET  # with systems.adacomm: this round's local period τ
    start_loss: float | None | _Unset = UNSET  # with systems.adacomm: the clients' mean loss at the round's global model
    #   (each one's first batch): AdaComm's F
    aggregator: dict | _Unset = UNSET  # what a choosing rule reported (selected / voters / outvoted), by client id
    aggregated: list[int] | _Unset = UNSET  # clients whose updates reached the rule after the defenses
    detection: dict | _Unset = UNSET  # what the defenses and rule did to the attackers: flagged, tp/fp/fn/tn, tpr, fpr,
    #   precision, f1, attacker_weight_share, clipped (fedsim/runs/detection.py); rounds that reached the pipeline
    global_norm: float | _Unset = UNSET  # L2 norm of the new global model
    lowrank: dict | _Unset = UNSET  # the low-rank switch made this round (layers factorized, ranks)
    model_params: int | _Unset = UNSET  # parameters of the global model after the round
    exchanges: int | _Unset = UNSET  # FedMA: message exchanges this round (matched layers + 1)
    global_widths: list[int] | _Unset = UNSET  # FedMA: hidden widths of the global model
    model_growth: float | _Unset = UNSET  # FedMA: global parameters / initial parameters
    match_seconds: float | _Unset = UNSET  # FedMA: seconds spent in BBP-MAP matching
    pipeline_seconds: float | _Unset = UNSET  # seconds in the round's pipeline: server-side attack, defenses, rule
    secure_aggregation: dict | _Unset = UNSET  # under secure aggregation: protocol, groups (members, summed, num_shares,
    #   threshold, halted), summed clients, bytes per protocol stage, max_weight, the quantisation error bound
    secure_aggregation_seconds: dict | _Unset = UNSET  # under secure aggregation: the server's own protocol seconds and
    #   each client's (outside its training)
    main_accuracy: float | None | _Unset = UNSET  # accuracy on the (subsampled) test set, on evaluated rounds
    main_loss: float | None | _Unset = UNSET  # cross-entropy on that test set
    backdoor_success: float | None | _Unset = UNSET  # share of the attack's test set sent to its target; null without attack
    backdoor_success_beyond_clean: float | _Unset = UNSET  # the same over the inputs the clean initial model did not
    #   already send to the target (what the attack added; NaN when the clean model sends all of them there)
    source_class_accuracy: float | None | _Unset = UNSET  # edge-case attacks: clean accuracy on the source class
    inputs_rejected: dict | _Unset = UNSET  # with a defense that refuses low-confidence inputs at inference (FLIP): the share of
    #   the test set (`main`) and of the backdoor set (`backdoor`, when measured) the deployed model does not answer
    edge_model: dict | _Unset = UNSET  # with evaluation.edge_model, on evaluated rounds: copy name -> its main_accuracy,
    #   main_loss, backdoor_success (+ _beyond_clean, source_class_accuracy when the fp32 line has them) and agreement
    #   (share of test inputs where it predicts the fp32 model's class) (fedsim/models/edge_copy.py, docs/edge_model.md)
    certification: dict | _Unset = UNSET  # certifying defenses (CRFL) on their rounds: name -> certified accuracy, radii, ...
    privacy_attack: list | _Unset = UNSET  # with `privacy_attacks`, in their rounds: one entry per attacked upload, aggregate
    #   or membership game: attack, round, target (upload / aggregate / model), clients, images, psnr_mean, psnr_max,
    #   ssim_mean, label_accuracy, grid (a PNG in the run folder), info; membership: auc, tpr_at_1pct_fpr, ...
    #   (fedsim/server/leakage.py, docs/leakage.md)
    privacy_attack_seconds: dict | _Unset = UNSET  # with `privacy_attacks`: seconds each attack took this round (its cost)
    wall_seconds: float | _Unset = UNSET  # seconds since the previous line (its own start for round 1): they add up

    def update(self, values: dict) -> None:
        """Set several fields at once (e.g. the evaluation's metrics); an unknown name is an error."""
        for key, value in values.items():
            if key not in _NAMES:
                raise KeyError(f"RoundRecord has no field {key!r}")
            setattr(self, key, value)

    def to_json(self) -> dict:
        """The line as a dict, fields in schema order, UNSET fields left out."""
        return {f.name: v for f in fields(self) if (v := getattr(self, f.name)) is not UNSET}


_NAMES = frozenset(f.name for f in fields(RoundRecord))
# Wall-clock fields: they differ from run to run; everything else in a line is reproducible.
TIME_FIELDS = frozenset({"wall_seconds", "match_seconds", "pipeline_seconds", "attacker_train_seconds",
                         "secure_aggregation_seconds", "privacy_attack_seconds"})


def without_times(lines: list[dict]) -> list[dict]:
    """The lines without their wall-clock fields (what must be equal between two runs of one seed)."""
    return [{k: v for k, v in line.items() if k not in TIME_FIELDS} for line in lines]
