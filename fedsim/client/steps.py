"""A client's side of the round protocols that train an update: what a client does with one
training message, from the global model to the reply.

`plain_train` is the `plain` protocol's client step (fedsim.registry.PROTOCOLS): train (honestly or
as the scenario's attack prescribes), apply local DP, encode with the codec and its memory, reply.
Secure aggregation's step (fedsim/client/secure.py) shares `train_delta` and uploads the dense
update through the protocol instead; FedMA's (fedsim/fedma/client.py) is a protocol of its own.
Every step is called as `step(call)` with a `ClientCall`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from flwr.app import Context, Message, MetricRecord, RecordDict

from fedsim.attacks.base import AttackerRound, attacker_train_config
from fedsim.client.memory import ClientMemory
from fedsim.cohort.store import take_pretrained
from fedsim.data.local import NODE_CONFIG_KEY as LOCAL_DATA
from fedsim.devices import client_train_config
from fedsim.models.layout import ModelLayout
from fedsim.privacy.local import privatize_release
from fedsim.registry import DEFENSES
from fedsim.seeding import TRAIN, derive_seed
from fedsim.training import TrainConfig, train
from fedsim.wire import ATTACK_METRICS_RECORD, BACKDOOR_RECORD, WORK_RECORD, pack_payload, unpack_model


@dataclass(frozen=True)
class ClientCall:
    """One message to a client: what every protocol's client step is given."""

    rt: object  # the client's runtime (fedsim/runtime.py)
    pid: int  # its partition id
    msg: Message
    context: Context
    state_dir: str | None  # where it keeps its memory across restarts (None: in its context only)


class Trained(NamedTuple):
    """A client's update after local training and local DP, with what its reply reports."""

    delta: torch.Tensor
    result: "LocalResult"
    memory: ClientMemory
    train_seconds: float
    local_data: bool  # trained on the device's own data


def scenario_for_node(scenario, context: Context):
    """A device may hold its data in its own folder: `--node-config 'data-dir="..."'` overrides data.dir."""
    data_dir = context.node_config.get("data-dir")
    if not data_dir:
        return scenario
    return scenario.model_copy(update={"data": scenario.data.model_copy(update={"dir": str(data_dir)})})


def partition_id(context: Context) -> int:
    return int(context.node_config["partition-id"])


def local_data_path(context: Context) -> str | None:
    """The device's own data (node config `local-data`), or None to train on its partition."""
    own = context.node_config.get(LOCAL_DATA)
    return str(own) if own else None


def model_ranks(config) -> dict[str, int] | None:
    """The factorized layers' ranks the server broadcast (JSON in the config), or None for full rank."""
    text = config.get("model-ranks", "") if hasattr(config, "get") else ""
    return {str(k): int(v) for k, v in json.loads(text).items()} if text else None


def attacking(rt, pid: int) -> bool:
    """Whether this client runs the scenario's client-side attack (a server-side attack's clients train honestly)."""
    return pid in rt.attackers and rt.attack is not None and rt.attack.side == "client"


def own_data(rt, context: Context, pid: int, config) -> tuple[np.ndarray, np.ndarray] | None:
    """An honest device's own training set when its node config names one, else None (its partition).

    Refused under DETOX's redundancy, whose group members must all train on one shared shard."""
    path = local_data_path(context)
    if path is None or attacking(rt, pid):
        return None
    if "data-partition" in config:
        raise ValueError(
            f"{LOCAL_DATA} {path}: the server asks this node to train on partition {config['data-partition']}'s "
            "shard (redundant group aggregation), which a device holding its own data cannot do"
        )
    return rt.local_data(path)


class LocalResult(NamedTuple):
    delta: torch.Tensor
    num_examples: int
    stats: dict
    shared: dict[str, np.ndarray] | None = None  # what an attacker reports for the backdoor measurement


@dataclass(frozen=True)
class HonestTraining:
    """One honest client's training in one round, handed to a defense's client part (its registry
    entry's `client_training`: FLIP, Lockdown) in place of plain `train`. It trains `model` (the
    global model, loaded) on (x, y) with `cfg` and `seed`, as plain training would, and returns
    (update: the flat [d] vector uploaded, stats: at least `loss`)."""

    rt: object  # the client's runtime (fedsim/runtime.py)
    pid: int  # its partition id
    rnd: int
    model: torch.nn.Module
    global_vec: torch.Tensor
    layout: ModelLayout
    cfg: TrainConfig  # the client's training settings (federation and device)
    seed: int
    x: np.ndarray
    y: np.ndarray
    memory: dict[str, np.ndarray]  # the client's own arrays across rounds (fedsim/client/memory.py), updated in place


def client_defense(rt) -> tuple[object, object] | None:
    """(spec, function) of the scenario's defense that trains honest clients itself, or None
    (validation lets a scenario have at most one)."""
    def find():
        for spec in rt.scenario.defenses:
            fn = DEFENSES.get(spec.name).load("client_training")
            if fn is not None:
                return spec, fn
        return None
    return rt.cached(("client-training",), find)


def round_steps(config) -> int | None:
    """The local steps the server set for this round (AdaComm's τ on the federation clock), or None."""
    value = config.get("local-steps") if hasattr(config, "get") else None
    return int(value) if value is not None else None


def round_train_config(rt, rnd: int, local_steps: int | None = None) -> TrainConfig:
    """The federation's local training in round `rnd` (its lr decayed), before the device settings
    an honest client or an attacker adds (fedsim/devices.py client_train_config). `local_steps`: the
    round's local period the server set (each epoch takes at least one step, so that many epochs
    bound it), in place of federation.local_epochs / local_steps."""
    fed = rt.scenario.federation
    epochs, steps = (fed.local_epochs, fed.local_steps) if local_steps is None else (max(fed.local_epochs, local_steps), local_steps)
    return TrainConfig(epochs, fed.batch_size, rt.lr(rnd), fed.momentum, fed.weight_decay,
                       proximal_mu=fed.proximal_mu, max_steps=steps)


def local_update(rt, pid: int, global_vec: torch.Tensor, rnd: int, config, memory: dict | None = None,
                 data: tuple[np.ndarray, np.ndarray] | None = None) -> LocalResult:
    """Train from the global model on this client's data (or the attacker's) and return the update.

    Under redundant aggregation (DETOX) the server names a `data-partition`: every member of a
    group then trains on that shard with that shard's seed, so honest members agree bit for bit.
    `memory`: the client's own arrays from its previous rounds, updated in place: an attacker's
    attack's, or an honest client's under a defense with a client part (`client_defense`), which
    then trains it in place of `train`, never with its cohort.
    `data`: an honest device's own (x, y) in place of its partition; an attacker ignores it.
    """
    fed = rt.scenario.federation
    data_pid = int(config.get("data-partition", pid))
    ranks = model_ranks(config)
    layout = rt.layout_for(ranks)
    attack = rt.attack if attacking(rt, pid) else None
    defense = client_defense(rt) if attack is None else None  # attackers train as their attack says
    if attack is None and data is None and defense is None:
        done = take_pretrained(rt, rnd, pid, global_vec)  # trained with its cohort (fedsim/client/cohort.py)
        if done is not None:
            return done
    model = rt.build_model(ranks)
    layout.load_into(model, global_vec)
    cfg = round_train_config(rt, rnd, round_steps(config))
    seed = derive_seed(rt.scenario.seed, TRAIN, rnd, data_pid)
    if attack is not None:
        job = AttackerRound(rt, pid, rnd, model, global_vec, layout,
                            attacker_train_config(attack.params, client_train_config(cfg, rt.scenario, attacker=True), fed.lr_decay ** (rnd - 1)), seed, dict(config),
                            memory if memory is not None else {})
        n, stats, info = attack.local_train(job)
        delta = attack.finish_update(layout.flatten_model(model) - global_vec, info)
        return LocalResult(delta, n, stats, attack.shared_state(job))
    x, y = data if data is not None else rt.client_data(data_pid)
    if defense is not None and len(x):
        spec, client_training = defense
        job = HonestTraining(rt, pid, rnd, model, global_vec, layout, client_train_config(cfg, rt.scenario), seed, x, y,
                             memory if memory is not None else {})
        delta, stats = client_training(spec, job)
        return LocalResult(delta, len(x), stats)
    stats = train(model, x, y, client_train_config(cfg, rt.scenario), seed) if len(x) else {"loss": 0.0}
    return LocalResult(layout.flatten_model(model) - global_vec, len(x), stats)


def train_delta(call: ClientCall, global_vec: torch.Tensor, config) -> Trained:
    """Train from `global_vec` as this client (honest or attacker), then apply local DP to an
    honest update: the part of a training step every update protocol shares."""
    rt, pid = call.rt, call.pid
    rnd = int(config["server-round"])
    data = own_data(rt, call.context, pid, config)
    memory = ClientMemory.recall(call.context, pid, rnd, call.state_dir)
    started = time.perf_counter()
    own = memory.attack if attacking(rt, pid) else memory.defense  # an attacker's arrays, or a client-side defense's
    result = local_update(rt, pid, global_vec, rnd, config, own, data)
    train_seconds = time.perf_counter() - started
    delta = result.delta
    if not attacking(rt, pid):  # local DP: an honest update is clipped and noised before it leaves (docs/privacy.md)
        delta = privatize_release(delta, rt.scenario.federation.local_dp, rt.scenario.seed, rnd, pid)
    return Trained(delta, result, memory, train_seconds, data is not None)


def samples_trained(rt, result: LocalResult) -> int:
    """Samples the client's training processed: what training counted, else its steps of full
    batches (an attack's own loop that counts no samples), else one pass over its examples."""
    stats = result.stats
    if "samples" in stats:
        return int(stats["samples"])
    if "steps" in stats:
        return int(stats["steps"]) * rt.scenario.federation.batch_size
    return int(result.num_examples)


def reply_records(call: ClientCall, trained: Trained, content: RecordDict) -> RecordDict:
    """Reports to the experimenter beside the upload, not counted in its bytes: the samples trained
    (the federation clock's compute time), an attacker's cost and the trigger it planted."""
    content[WORK_RECORD] = MetricRecord({"samples": samples_trained(call.rt, trained.result)})
    if attacking(call.rt, call.pid):
        content[ATTACK_METRICS_RECORD] = MetricRecord({"train-seconds": trained.train_seconds})
    if trained.result.shared is not None:
        content[BACKDOOR_RECORD] = pack_payload(trained.result.shared)
    return content


def describe(call: ClientCall, trained: Trained) -> str:
    """The step's one line in the client's log."""
    who = "attacker" if attacking(call.rt, call.pid) else "honest"
    return f"{who}: {trained.result.num_examples} examples" + (" (local data)" if trained.local_data else "")


def plain_train(call: ClientCall) -> tuple[Message, str]:
    """The `plain` protocol's client step: train, encode with the codec and its memory, reply."""
    config = call.msg.content["config"]
    layout = call.rt.layout_for(model_ranks(config))
    global_vec = unpack_model(call.msg.content["arrays"], layout)
    trained = train_delta(call, global_vec, config)
    payload, codec_state = call.rt.codec.encode(trained.delta, layout, trained.memory.codec_state(layout.dim))
    trained.memory.keep(call.context, call.pid, int(config["server-round"]), call.state_dir, codec_state, layout.dim)
    metrics = MetricRecord({"num-examples": int(trained.result.num_examples),
                            "train-loss": float(trained.result.stats["loss"]), "partition-id": call.pid})
    systems = call.rt.scenario.systems
    if systems is not None and systems.adacomm is not None and "start_loss" in trained.result.stats:
        metrics["start-loss"] = float(trained.result.stats["start_loss"])  # AdaComm's F at the round's model
    content = reply_records(call, trained, RecordDict({"update": pack_payload(payload), "metrics": metrics}))
    return Message(content, reply_to=call.msg), describe(call, trained)
