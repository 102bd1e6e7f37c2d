"""A cohort's honest clients trained together, before their messages are answered one by one.

An actor handed a cohort of messages (fedsim/engine/cohorts.py, or the in-process grid) calls
`prepare_cohort` first. The honest clients of a protocol whose step trains through
`local_update` (the registry's `cohort_training` trait: `plain`) that start from the same global
model in the same round train as one torch.func computation (fedsim/cohort/vectorized.py), each
on exactly the batches it would get alone. Their updates wait in the runtime's cohort store
(fedsim/cohort/store.py); when each message is then answered as usual, `local_update` takes its
client's update from there instead of training (local DP, the codec, the memory and the reply are unchanged). Attackers and
clients on their own data train alone, as before, and so does a whole cohort whose model or
settings cannot be vectorised (BatchNorm, LSTMs, fp16), or whose honest clients a defense trains
(its registry entry's `client_training`: FLIP, Lockdown), with the reason logged once. A cohort whose
training takes its process over `federation.client_memory_gb` (fedsim/client/memory_limit.py) trains
one by one too, each message then under the limit on its own.

Under DETOX's redundancy, group members that train on one shard with one seed are trained once
and share the result, so they still agree bit for bit.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from fedsim.client.memory_limit import run_limited
from fedsim.client.steps import (
    LocalResult, attacking, client_defense, local_data_path, model_ranks, partition_id, round_steps, round_train_config, scenario_for_node,
)
from fedsim.cohort.store import cohort_store
from fedsim.cohort.vectorized import chunk_size_for, train_cohort, vector_refusal
from fedsim.devices import client_train_config
from fedsim.registry import protocol_for
from fedsim.runtime import runtime_for
from fedsim.seeding import TRAIN, derive_seed
from fedsim.training import TrainConfig
from fedsim.wire import unpack_model

log = logging.getLogger("fedsim.client")


@dataclass
class Group:
    """Clients of one round that start from one global model at one set of ranks."""

    rt: object
    rnd: int
    ranks: dict[str, int] | None
    start: torch.Tensor
    local_steps: int | None = None  # the round's local period, when the server sets it (AdaComm)
    clients: list[tuple[int, int]] = field(default_factory=list)  # (partition id, data partition)


def training_config(rt, rnd: int, local_steps: int | None = None) -> TrainConfig:
    """An honest client's training settings in round `rnd`, as `local_update` uses them."""
    return client_train_config(round_train_config(rt, rnd, local_steps), rt.scenario)


def cohort_refusal(rt) -> str | None:
    """Why this scenario's honest clients cannot train vectorised (None: they can)."""
    protocol = protocol_for(rt.scenario)
    if not protocol.traits.cohort_training:
        return f"the {protocol.name} round protocol trains its clients its own way"
    defense = client_defense(rt)
    if defense is not None:  # its client part trains each honest client (fedsim/client/steps.py HonestTraining)
        return f"defense {defense[0].name} trains the honest clients its own way"
    return vector_refusal(rt.build_model(), training_config(rt, 1))


def prepare_cohort(scenario, messages: list, contexts: list) -> None:
    """Train the cohort's eligible clients together (see the module docstring). Never raises: a
    failure is logged and every client then trains alone."""
    stores = []
    decoded: dict[tuple[int, str], torch.Tensor] = {}  # one decode per model record (a round's messages share one)
    try:
        groups: list[Group] = []
        for msg, context in zip(messages, contexts):
            if msg.metadata.message_type != "train" or msg.has_error():
                continue
            rt = runtime_for(scenario_for_node(scenario, context))
            torch.set_num_threads(max(1, int(rt.scenario.federation.client_cpus)))  # as the train handler does
            store = cohort_store(rt)
            if not any(s is store for s in stores):
                store.clear()  # what an earlier cohort left unclaimed (its message failed) goes
                stores.append(store)
            if not eligible(rt, context):
                continue
            config = msg.content["config"]
            ranks = model_ranks(config)
            rnd, pid = int(config["server-round"]), partition_id(context)
            record = msg.content["arrays"]
            key = (id(record), json.dumps(ranks, sort_keys=True))
            if key not in decoded:
                decoded[key] = unpack_model(record, rt.layout_for(ranks))
            start = decoded[key]
            steps = round_steps(config)
            group = next((g for g in groups if g.rt is rt and g.rnd == rnd and g.ranks == ranks
                          and g.local_steps == steps and torch.equal(g.start, start)), None)
            if group is None:
                group = Group(rt, rnd, ranks, start, steps)
                groups.append(group)
            group.clients.append((pid, int(config.get("data-partition", pid))))
        # under federation.client_memory_gb: a cohort that goes over it trains its clients one by one
        run_limited(scenario.federation.client_memory_gb, lambda: [train_group(group) for group in groups])
    except Exception as ex:  # noqa: BLE001  (the clients then train one by one, as they always could)
        log.warning("a cohort could not train together (%s: %s); its clients train one by one", type(ex).__name__, ex)
        for store in stores:
            store.clear()


def eligible(rt, context) -> bool:
    """Whether this client may train with its cohort: vectorising on, an honest client on its partition,
    a protocol and model that allow it (the reason logged once per runtime when not)."""
    mode = rt.scenario.federation.vectorize
    if mode == "off" or attacking(rt, partition_id(context)) or local_data_path(context) is not None:
        return False
    reason = rt.cached(("cohort-refusal",), lambda: cohort_refusal(rt) or "")
    if reason:
        rt.cached(("cohort-refusal-logged",), lambda: log.info("federation.vectorize %s: %s; clients train one by one",
                                                               mode, reason) or True)
    return not reason


def train_group(group: Group) -> None:
    """One vectorised computation for the group's distinct data partitions; results into the store."""
    rt, fed = group.rt, group.rt.scenario.federation
    # DETOX: one shard, trained once. A lone client trains vectorised too, as its cohort would: the
    # engine cuts a round the same way every time (fedsim/engine/cohorts.py), so a run repeats bit for
    # bit, and for the mlp a client's bits do not even depend on its cohort (a conv net's may, in the
    # last place, with the number of clients a step computes: fedsim/cohort/vectorized.py)
    shards = list(dict.fromkeys(data_pid for _, data_pid in group.clients))
    cfg = training_config(rt, group.rnd, group.local_steps)
    model = rt.cached(("cohort-model", json.dumps(group.ranks, sort_keys=True)), lambda: rt.build_model(group.ranks))
    layout = rt.layout_for(group.ranks)
    datasets = [rt.client_data(s) for s in shards]
    seeds = [derive_seed(rt.scenario.seed, TRAIN, group.rnd, s) for s in shards]
    chunk = fed.cohort_size or chunk_size_for(model, layout, cfg, tuple(np.shape(datasets[0][0])[1:]), cfg.device)
    rows, stats = train_cohort(model, layout, group.start, datasets, cfg, seeds, chunk)
    by_shard = {s: LocalResult(rows[i] - group.start, len(datasets[i][1]), stats[i]) for i, s in enumerate(shards)}
    store = cohort_store(rt)
    for pid, data_pid in group.clients:
        store[group.rnd, pid] = (group.start, by_shard[data_pid])
