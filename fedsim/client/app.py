"""The ClientApp: each training message goes to the client step of the scenario's round protocol
(fedsim.registry.PROTOCOLS: fedsim/client/steps.py for `plain`, fedsim/client/secure.py,
fedsim/fedma/client.py); the handler itself knows no protocol.

A client's partition comes from `context.node_config["partition-id"]` (set by the simulation
engine, or by `--node-config` on a real SuperNode); whether it is an attacker follows from the
scenario's attacker ids. Codec memory (error feedback) and an attacker's own memory (a trigger it
keeps optimising) are the client's memory (fedsim/client/memory.py).

A device holding its own data sets `local-data` in its node config (`--node-config
'local-data="/path"'`): an honest client then trains on those files (fedsim/data/local.py) instead
of its partition, and reports their size as `num-examples`; nodes without it keep their
partition, so one run can mix both. An attacker keeps building its own training set from the
scenario's data as its attack prescribes, whatever `local-data` says. Each message is logged as
one line on the "fedsim.client" logger.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedsim.client.cohort import prepare_cohort
from fedsim.client.lightsecagg import lightsecagg_mod
from fedsim.client.memory_limit import run_limited
from fedsim.client.secure import secure_aggregation_mod
from fedsim.client.steps import ClientCall, partition_id, scenario_for_node
from fedsim.flower.compat import flower_log as flwr_log
from fedsim.registry import protocol_for
from fedsim.runtime import runtime_for

log = logging.getLogger("fedsim.client")


def state_folder(context: Context, default: str | None) -> str | None:
    """Where this node keeps its memory between runs: its node config's `state-dir`, else `default`."""
    own = context.node_config.get("state-dir")
    return str(own) if own else default


def step_name(msg: Message) -> str:
    """The round a training message belongs to, for the client's log line."""
    for key in ("config", "fitins.config"):
        if key in msg.content.config_records:
            return f"round {msg.content.config_records[key].get('server-round', '?')}"
    return "round ?"


class CohortClientApp(ClientApp):
    """Flower's ClientApp, plus `prepare_cohort`: what an actor (or the in-process grid) handed
    several messages at once calls before answering them one by one (fedsim/client/cohort.py)."""

    def __init__(self, scenario=None) -> None:
        super().__init__()
        self.scenario = scenario

    def prepare_cohort(self, messages: list, contexts: list) -> None:
        if self.scenario is not None:  # on a SuperNode each message comes alone
            prepare_cohort(self.scenario, messages, contexts)


def make_client_app(scenario=None, state_dir: str | Path | None = None) -> ClientApp:
    """A ClientApp for `scenario` (simulation), or reading it from the run config (deployment).

    `state_dir`: the folder this client keeps its memory in across restarts (in simulation, the
    run folder's `checkpoint/clients` when checkpoints are on); a node's `state-dir` overrides it."""
    from fedsim.deploy.run_config import scenario_from_context

    app = CohortClientApp(scenario)
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
        protocol = protocol_for(rt.scenario)  # the registered round protocol: its client step answers
        call = ClientCall(rt, partition_id(context), msg, context, state_folder(context, default_state_dir))
        # the client step under federation.client_memory_gb (fedsim/client/memory_limit.py): over it, this message fails
        reply, what = run_limited(rt.scenario.federation.client_memory_gb, lambda: protocol.load("client_step")(call))
        say(logging.INFO, "%s partition %d %s, %.2f s", step_name(msg), call.pid, what, time.perf_counter() - started)
        return reply

    return app


# The component `flwr run` and SuperNodes load: the scenario comes from the run config.
app = make_client_app()
