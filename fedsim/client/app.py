"""The ClientApp: local training for honest clients and attackers, then the encoded upload.

A client's partition comes from `context.node_config["partition-id"]` (set by the simulation
engine, or by `--node-config` on a real SuperNode); whether it is an attacker follows from the
scenario's attacker ids. Codec memory (error feedback) and an attacker's own memory (a trigger it
keeps optimising) live in `context.state`, so they persist across rounds in simulation and
deployment alike; with a state folder (`state_dir`, or a SuperNode's `--node-config
'state-dir="..."'`) they are also saved there each round, on the client's own disk, so a resumed
run or a restarted device continues with them (fedsim/runs/checkpoint.py).

A device holding its own data sets `local-data` in its node config (`--node-config
'local-data="/path"'`): an honest client then trains on those files (fedsim/data/local.py) instead
of its partition, and reports their size as `num-examples`; nodes without it keep their
partition, so one run can mix both. An attacker keeps building its own training set from the
scenario's data as its attack prescribes, whatever `local-data` says. Each message is logged as
one line on the "fedsim.client" logger.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedsim.engine.flower_compat import flower_log as flwr_log
from fedsim.engine.flower_compat import is_legacy_fit_ins, legacy_fit_ins, legacy_fit_res
from fedsim.client.lightsecagg import lightsecagg_mod
from fedsim.client.secure import clip_before_masking, model_from_arrays, secure_aggregation_mod
from fedsim.attacks.base import AttackerRound, attacker_train_config
from fedsim.data.local import NODE_CONFIG_KEY as LOCAL_DATA
from fedsim.runs.checkpoint import load_client, save_client
from fedsim.privacy.local import privatize_release
from fedsim.registry import AGGREGATORS
from fedsim.runtime import runtime_for
from fedsim.seeding import TRAIN, derive_seed
from fedsim.devices import client_train_config
from fedsim.training import TrainConfig, train
from fedsim.wire import ATTACK_METRICS_RECORD, BACKDOOR_RECORD, pack_payload, unpack_model

CLIENT_STATE = "client-state"  # codec memory (error feedback) and an attacker's own arrays
ATTACK_MEMORY = "attack."  # prefix of an attacker's own arrays in the client's saved state

log = logging.getLogger("fedsim.client")


def scenario_for_node(scenario, context: Context):
    """A device may hold its data in its own folder: `--node-config 'data-dir="..."'` overrides data.dir."""
    data_dir = context.node_config.get("data-dir")
    if not data_dir:
        return scenario
    return scenario.model_copy(update={"data": scenario.data.model_copy(update={"dir": str(data_dir)})})


def model_ranks(config) -> dict[str, int] | None:
    """The factorized layers' ranks the server broadcast (JSON in the config), or None for full rank."""
    text = config.get("model-ranks", "") if hasattr(config, "get") else ""
    return {str(k): int(v) for k, v in json.loads(text).items()} if text else None


def partition_id(context: Context) -> int:
    return int(context.node_config["partition-id"])


def local_data_path(context: Context) -> str | None:
    """The device's own data (node config `local-data`), or None to train on its partition."""
    own = context.node_config.get(LOCAL_DATA)
    return str(own) if own else None


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


def local_update(rt, pid: int, global_vec: torch.Tensor, rnd: int, config, memory: dict | None = None,
                 data: tuple[np.ndarray, np.ndarray] | None = None) -> LocalResult:
    """Train from the global model on this client's data (or the attacker's) and return the update.

    Under redundant aggregation (DETOX) the server names a `data-partition`: every member of a
    group then trains on that shard with that shard's seed, so honest members agree bit for bit.
    `memory`: an attacker's arrays from its previous attack round, updated in place.
    `data`: an honest device's own (x, y) in place of its partition; an attacker ignores it.
    """
    fed = rt.scenario.federation
    data_pid = int(config.get("data-partition", pid))
    ranks = model_ranks(config)
    layout = rt.layout_for(ranks)
    attack = rt.attack if attacking(rt, pid) else None
    model = rt.build_model(ranks)
    layout.load_into(model, global_vec)
    cfg = TrainConfig(fed.local_epochs, fed.batch_size, rt.lr(rnd), fed.momentum, fed.weight_decay,
                      proximal_mu=fed.proximal_mu, max_steps=fed.local_steps)
    seed = derive_seed(rt.scenario.seed, TRAIN, rnd, data_pid)
    if attack is not None:
        job = AttackerRound(rt, pid, rnd, model, global_vec, layout,
                            attacker_train_config(attack.params, client_train_config(cfg, rt.scenario, attacker=True), fed.lr_decay ** (rnd - 1)), seed, dict(config),
                            memory if memory is not None else {})
        n, stats, info = attack.local_train(job)
        delta = attack.finish_update(layout.flatten_model(model) - global_vec, info)
        return LocalResult(delta, n, stats, attack.shared_state(job))
    x, y = data if data is not None else rt.client_data(data_pid)
    stats = train(model, x, y, client_train_config(cfg, rt.scenario), seed) if len(x) else {"loss": 0.0}
    return LocalResult(layout.flatten_model(model) - global_vec, len(x), stats)


def state_folder(context: Context, default: str | None) -> str | None:
    """Where this node keeps its memory between runs: its node config's `state-dir`, else `default`."""
    own = context.node_config.get("state-dir")
    return str(own) if own else default


def make_client_app(scenario=None, state_dir: str | Path | None = None) -> ClientApp:
    """A ClientApp for `scenario` (simulation), or reading it from the run config (deployment).

    `state_dir`: the folder this client keeps its memory in across restarts (in simulation, the
    run folder's `checkpoint/clients` when checkpoints are on); a node's `state-dir` overrides it."""
    from fedsim.deploy.run_config import scenario_from_context

    app = ClientApp()
    # On a SuperNode (the scenario comes from the run config) the per-message lines go through
    # Flower's logger, the one the node prints; in simulation through fedsim's, quiet by default.
    say = flwr_log if scenario is None else log.log
    default_state_dir = str(state_dir) if state_dir is not None else None

    @app.query()
    def query(msg: Message, context: Context) -> Message:
        say(logging.INFO, "query partition %d", partition_id(context))
        return Message(RecordDict({"info": MetricRecord({"partition-id": partition_id(context)})}), reply_to=msg)

    @app.train(mods=[secure_aggregation_mod, lightsecagg_mod])
    def train_handler(msg: Message, context: Context) -> Message:
        started = time.perf_counter()
        rt = runtime_for(scenario_for_node(scenario if scenario is not None else scenario_from_context(context), context))
        # as many threads as the actor has CPUs (one by default): parallelism comes from the actors
        torch.set_num_threads(max(1, int(rt.scenario.federation.client_cpus)))
        pid = partition_id(context)
        secure = is_legacy_fit_ins(msg.content)  # a secure round: Flower's legacy fit records (fedsim/server/secure.py)
        if secure:
            model_arrays, config = legacy_fit_ins(msg.content)
        else:
            config = msg.content["config"]
        aggregator = rt.scenario.aggregator.name
        protocol_step = AGGREGATORS.get(aggregator).capability("client_step")
        if protocol_step is not None:  # one exchange of a multi-exchange protocol (FedMA's layer-wise matching)
            if local_data_path(context) is not None:
                raise ValueError(f"{LOCAL_DATA} {local_data_path(context)}: aggregator {aggregator}'s client "
                                 "protocol trains on the scenario's partitions; it does not take a device's own data")
            reply = protocol_step(rt, pid, msg, context)
            say(logging.INFO, "round %s partition %d %s step: %.2f s", config.get("server-round", "?"), pid, aggregator,
                     time.perf_counter() - started)
            return reply
        rnd = int(config["server-round"])
        data = own_data(rt, context, pid, config)
        layout = rt.layout_for(model_ranks(config))
        global_vec = model_from_arrays(model_arrays, layout) if secure else unpack_model(msg.content["arrays"], layout)
        state_dir = state_folder(context, default_state_dir)
        state = {}
        if CLIENT_STATE in context.state:
            state = {k: v.numpy() for k, v in context.state[CLIENT_STATE].items()}
        elif state_dir is not None:  # a resumed run: this node's memory comes from the checkpoint
            state = load_client(state_dir, pid, rnd) or {}
        memory = {k[len(ATTACK_MEMORY):]: state.pop(k) for k in list(state) if k.startswith(ATTACK_MEMORY)}
        train_started = time.perf_counter()
        result = local_update(rt, pid, global_vec, rnd, config, memory, data)
        train_seconds = time.perf_counter() - train_started
        if state and int(state.pop("layout-dim", [layout.dim])[0]) != layout.dim:
            state = {}  # the model was factorized since: old residuals no longer fit
        delta = result.delta
        if not attacking(rt, pid):  # local DP: an honest update is clipped and noised before it leaves (docs/privacy.md)
            delta = privatize_release(delta, rt.scenario.federation.local_dp, rt.scenario.seed, rnd, pid)
        if secure:  # clipped before masking: the norm bound that survives secure aggregation
            delta = clip_before_masking(delta, rt.scenario.secure_aggregation, attacking(rt, pid))
        payload = None
        if not secure:  # a secure round uploads the dense update through the protocol (codecs are refused there)
            payload, state = rt.codec.encode(delta, layout, state)
        if state:
            state["layout-dim"] = np.array([layout.dim], dtype=np.int64)
        state.update({ATTACK_MEMORY + k: np.asarray(v) for k, v in memory.items()})
        if state:
            context.state[CLIENT_STATE] = pack_payload(state)
            if state_dir is not None:
                save_client(state_dir, pid, rnd, state)
        metrics = MetricRecord({"num-examples": int(result.num_examples), "train-loss": float(result.stats["loss"]),
                                "partition-id": pid})
        if secure:  # what the protocol's mod quantises and masks: the flat update and its example count
            content = legacy_fit_res([delta.numpy()], int(result.num_examples), dict(metrics))
        else:
            content = RecordDict({"update": pack_payload(payload), "metrics": metrics})
        if attacking(rt, pid):  # the attack's cost
            content[ATTACK_METRICS_RECORD] = MetricRecord({"train-seconds": train_seconds})
        if result.shared is not None:
            content[BACKDOOR_RECORD] = pack_payload(result.shared)
        say(logging.INFO, "round %d partition %d %s: %d examples%s, %.2f s", rnd, pid,
                 "attacker" if attacking(rt, pid) else "honest", result.num_examples,
                 " (local data)" if data is not None else "", time.perf_counter() - started)
        return Message(content, reply_to=msg)

    return app


# The component `flwr run` and SuperNodes load: the scenario comes from the run config.
app = make_client_app()
