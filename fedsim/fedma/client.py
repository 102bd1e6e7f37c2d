"""The client's half of FedMA's layer-wise protocol (§2.3).

Each round is several exchanges with the server:

* step "local": train the whole model (round 1: from an independently initialised model, as the
  official code does, for `federation.local_epochs` at `federation.lr`; later rounds: from the
  global model sliced back to this client's own neurons, for `retrain_epochs` at `retrain_lr`),
  then upload layer 0's neurons and the class counts (for the per-class output average).
* step "retrain", layer l (1..K): the server sends matched layer l-1 and this client's assignment
  into it. The client installs the matched layer, re-indexes its layer l inputs to the global
  order (zero weights from neurons it does not own, so its function is unchanged), freezes layers
  < l, retrains the rest, and uploads layer l. When only the output layer is left it trains 3x
  the epochs at lr/10 with weight decay 1e-4, as the official code does.

Between exchanges the model lives in `Context.state` (the device's own memory, persisted by
Flower in simulation and deployment alike); every shape change arrives in the messages.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict

from fedsim.fedma.arch import ChainArch, State, state_of
from fedsim.seeding import INIT, TRAIN, derive_seed
from fedsim.training import TrainConfig, train

MODEL_STATE, STEP_STATE = "fedma-model", "fedma-step"


@functools.lru_cache(maxsize=4)
def _arch(model_name, input_shape, num_classes, params_json, params_type) -> ChainArch:
    return ChainArch.of(model_name, input_shape, num_classes, params_type.model_validate_json(params_json))


def arch_for(rt) -> ChainArch:
    """The scenario model's chain (cached per process)."""
    spec = rt.scenario.model
    return _arch(spec.name, tuple(rt.data.input_shape), rt.data.num_classes, spec.model_dump_json(), type(spec))


def record_to_state(record: ArrayRecord) -> State:
    return {k: np.array(v.numpy(), dtype=np.float32) for k, v in record.items()}


def state_to_record(state: State) -> ArrayRecord:
    return ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in state.items()})


def client_training_data(rt, pid: int, attacking: bool) -> tuple[np.ndarray, np.ndarray]:
    """This client's data; a data-poisoning attacker trains on its attack set (checked at validation)."""
    if attacking:
        return rt.attack.training_set(rt, pid)
    return rt.client_data(pid)


def class_counts(y: np.ndarray, num_classes: int) -> np.ndarray:
    return np.bincount(y.astype(np.int64), minlength=num_classes)[:num_classes].astype(np.int64)


def fedma_train(call) -> tuple[Message, str]:
    """The `fedma` protocol's client step: one FedMA exchange; returns the reply carrying the layer the
    server matches next. FedMA trains on the scenario's partitions: a device's own data is refused."""
    from fedsim.client.steps import LOCAL_DATA, local_data_path

    if local_data_path(call.context) is not None:
        raise ValueError(f"{LOCAL_DATA} {local_data_path(call.context)}: FedMA's client protocol trains on the "
                         "scenario's partitions; it does not take a device's own data")
    step = call.msg.content["config"].get("fedma-step", "?")
    return fedma_exchange(call.rt, call.pid, call.msg, call.context), f"fedma {step} step"


def fedma_exchange(rt, pid: int, msg: Message, context: Context) -> Message:
    """Handle one FedMA exchange; returns the reply carrying the layer the server matches next."""
    config = msg.content["config"]
    step, rnd = str(config["fedma-step"]), int(config["server-round"])
    arch, fed, params = arch_for(rt), rt.scenario.federation, rt.scenario.aggregator
    attacking = pid in rt.attackers and rt.attack is not None and rt.attack.side == "client"
    x, y = client_training_data(rt, pid, attacking)
    if step == "local":
        layer = 0
        if "arrays" in msg.content:
            state = record_to_state(msg.content["arrays"])
        else:  # an independent initialisation per client, seeded by the scenario and the client
            torch.manual_seed(derive_seed(rt.scenario.seed, INIT, pid))
            state = state_of(rt.build_model())
        first = rnd == 1
        cfg = TrainConfig(
            fed.local_epochs if first else params.retrain_epochs,
            fed.batch_size,
            rt.lr(rnd) if first else params.retrain_lr,
            fed.momentum if first else 0.9,
            fed.weight_decay if first else 0.0,
        )
    elif step == "retrain":
        layer = int(config["fedma-layer"])
        state = _resume_state(context, rnd, layer)
        arrays = msg.content["arrays"]
        matched = arch.layers[layer - 1]
        state[matched.weight] = np.array(arrays["weight"].numpy(), dtype=np.float32)
        state[matched.bias] = np.array(arrays["bias"].numpy(), dtype=np.float32)
        assignment = arrays["assignment"].numpy().astype(np.int64)
        arch.permute_into_global(state, layer - 1, assignment, state[matched.weight].shape[0])
        last_only = layer == arch.num_matched
        cfg = TrainConfig(
            params.retrain_epochs * (3 if last_only else 1),
            fed.batch_size,
            params.retrain_lr / (10 if last_only else 1),
            0.9,
            1e-4 if last_only else 0.0,
        )
    else:
        raise ValueError(f"unknown fedma-step {step!r}")
    model = arch.model(state)
    arch.trainable_from(model, layer)
    seed = derive_seed(rt.scenario.seed, TRAIN, rnd, pid, layer)
    stats = train(model, x, y, cfg, seed) if len(x) and cfg.epochs else {"loss": 0.0}
    state = state_of(model)
    context.state[MODEL_STATE] = state_to_record(state)
    context.state[STEP_STATE] = ConfigRecord({"round": rnd, "layer": layer})
    up = arch.layers[layer]
    out = {"weight": state[up.weight], "bias": state[up.bias]}
    if step == "local":
        out["class-counts"] = class_counts(y, rt.data.num_classes)
    metrics = MetricRecord({"num-examples": int(len(x)), "train-loss": float(stats["loss"]), "partition-id": pid})
    return Message(RecordDict({"layer": state_to_record(out), "metrics": metrics}), reply_to=msg)


def _resume_state(context: Context, rnd: int, layer: int) -> State:
    """The model this client left after the previous exchange of the same round, or a clear error."""
    tag = context.state.get(STEP_STATE) if hasattr(context.state, "get") else None
    if tag is None or MODEL_STATE not in context.state:
        raise RuntimeError(f"FedMA round {rnd} layer {layer}: this node has no model from the round's previous exchange")
    if (int(tag["round"]), int(tag["layer"])) != (rnd, layer - 1):
        raise RuntimeError(
            f"FedMA round {rnd} layer {layer}: this node's last exchange was round {tag['round']} layer {tag['layer']}"
        )
    return record_to_state(context.state[MODEL_STATE])
