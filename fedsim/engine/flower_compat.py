"""Every use of Flower's non-public API, in one place, each behind a capability probe.

fedsim talks to Flower through its public API (`flwr.app`, `flwr.serverapp`, `flwr.clientapp`,
`flwr.simulation.run_simulation`). A few things it needs are not public in flwr 1.41; they are
all here, so that a Flower upgrade means reading one file and running one test
(`tests/test_flower_compat.py`, which fails naming every probe that no longer holds):

* `simulation-engine`: fedsim's simulation adjustments (fedsim/engine/simulate.py) replace or wrap
  five members of Flower's simulation engine (node registration, message delivery, the worker
  queues, actor shutdown and class, Ray's start). Fallback: the engine runs as shipped (correct,
  slower at scale).
* `actor-contract`: the exceptions Flower's client actors raise (`ClientAppException`,
  `LoadClientAppError`), which fedsim's lighter actor must raise too. Fallback: Flower's actor.
* `message-size`: the protobuf serializer of a RecordDict, to count the bytes a message carries.
  Fallback: the raw sizes of the arrays and values (a slight undercount of the framing).
* `messages-outside-a-runtime`: the task identity Flower's `Message` needs when created outside a
  running app (fedsim's in-process grid). Fallback: none (the in-process grid is for tests and
  benchmarks); the probe says why.
* `forking-executor`: the SuperNode Runtime API client and `run_clientapp`, which fedsim's forking
  ClientApp executor uses (fedsim/deploy/commands.py). Fallback: refuse `--executor fork` with the reason;
  Flower's own `flower-superexec` still works.

Nothing here changes behaviour by itself: each function returns Flower's object or says it is
missing.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable


class FlowerCompatError(RuntimeError):
    """A non-public Flower name fedsim needs is missing from the installed Flower."""


@dataclass(frozen=True)
class Probe:
    name: str
    what: str  # what fedsim uses it for
    names: tuple[str, ...]  # "module:attr.attr" that must exist
    fallback: str

    def missing(self) -> list[str]:
        """The names of this probe the installed Flower lacks (empty: the probe holds)."""
        out = []
        for spec in self.names:
            module, _, attrs = spec.partition(":")
            try:
                obj: Any = importlib.import_module(module)
                for attr in filter(None, attrs.split(".")):
                    obj = getattr(obj, attr)
            except (ImportError, AttributeError):
                out.append(spec)
        return out

    def holds(self) -> bool:
        return not self.missing()


_VCE = "flwr.server.superlink.fleet.vce.vce_api"
_RAYBACKEND = "flwr.server.superlink.fleet.vce.backend.raybackend"
_POOL = "flwr.simulation.ray_transport.ray_actor"
_LINKSTATE = "flwr.server.superlink.linkstate.in_memory_linkstate"

PROBES = {
    p.name: p
    for p in (
        Probe("simulation-engine", "node map, one-scan delivery, prompt stop, light actors, Ray without a job runtime env",
              (f"{_VCE}:_register_nodes", f"{_VCE}:add_messages_to_queue", f"{_VCE}:Queue",
               f"{_RAYBACKEND}:ClientAppActor", f"{_RAYBACKEND}:RayBackend.init_ray",
               f"{_POOL}:BasicActorPool.terminate_all_actors",
               f"{_LINKSTATE}:InMemoryLinkState._check_stored_messages",
               f"{_LINKSTATE}:InMemoryLinkState.get_message_ins", "flwr.supercore.date:now"),
              "Flower's simulation engine as shipped"),
        Probe("actor-contract", "fedsim's light client actor raises what Flower's actor raises",
              ("flwr.clientapp.client_app:ClientAppException", "flwr.clientapp.client_app:LoadClientAppError"),
              "Flower's own client actor"),
        Probe("message-size", "bytes a message carries, from its serialized RecordDict",
              ("flwr.common.serde:recorddict_to_proto",),
              "raw sizes of the arrays and values"),
        Probe("messages-outside-a-runtime", "the in-process grid (tests, benchmarks) creates Flower Messages",
              ("flwr.supercore.task_identity:TaskIdentity", "flwr.common.constant:SUPERLINK_NODE_ID"),
              "none: the in-process grid cannot run"),
        Probe("forking-executor", "fedsim's forking ClientApp executor polls the SuperNode's Runtime API",
              ("flwr.proto.runtime_pb2:AcquireTaskRequest", "flwr.supercore:log", "flwr.supercore.constant:TaskType",
               "flwr.supercore.interceptors:RuntimeVersionHttpInterceptor",
               "flwr.supercore.retry:make_simple_http_retry_invoker", "flwr.supercore.runtime:RuntimeHttpClient",
               "flwr.supernode.runtime.run_clientapp:run_clientapp"),
              "`--executor flower` (Flower's flower-superexec)"),
    )
}


def require(probe: str) -> None:
    """Raise FlowerCompatError naming what is missing, unless `probe` holds."""
    missing = PROBES[probe].missing()
    if missing:
        p = PROBES[probe]
        raise FlowerCompatError(f"the installed Flower lacks {', '.join(missing)}, which fedsim's {p.what} uses; "
                                f"fallback: {p.fallback}")


def _get(spec: str) -> Any:
    module, _, attrs = spec.partition(":")
    obj: Any = importlib.import_module(module)
    for attr in attrs.split("."):
        obj = getattr(obj, attr)
    return obj


# --- logging ------------------------------------------------------------------------------------
def flower_log(level: int, msg: str, *args) -> None:
    """Log through Flower's own logger (`flwr.common.log`): the one a SuperNode prints and `flwr run
    --stream` shows, so the ServerApp's and ClientApp's progress lines appear where Flower's do."""
    _get("flwr.common:log")(level, msg, *args)


# --- simulation-engine ----------------------------------------------------------------------------
def engine_modules():
    """(vce_api, raybackend, BasicActorPool): the objects whose members the simulation adjusts."""
    require("simulation-engine")
    return importlib.import_module(_VCE), importlib.import_module(_RAYBACKEND), _get(f"{_POOL}:BasicActorPool")


def link_state_now() -> str:
    """The link state's clock (ISO time), as Flower stamps `delivered_at`."""
    return _get("flwr.supercore.date:now")().isoformat()


def undelivered_messages(state, node_ids) -> list:
    """What `vce_api.add_messages_to_queue` takes from the in-memory link state in one sweep: the
    undelivered messages for `node_ids`, expired ones dropped, marked delivered, oldest first;
    one scan of the stored messages instead of one per registered node."""
    batch = []
    with state.lock:
        ids = {
            mid for mid, msg in state.message_ins_store.items()
            if msg.metadata.delivered_at == "" and msg.metadata.dst_node_id in node_ids
        }
        if ids:
            state._check_stored_messages(ids)  # drops expired messages, as get_message_ins does
            delivered_at = link_state_now()
            for mid in ids:
                msg = state.message_ins_store.get(mid)
                if msg is not None and msg.metadata.delivered_at == "":
                    msg.metadata.delivered_at = delivered_at
                    batch.append(msg)
    batch.sort(key=lambda m: m.metadata.created_at)  # in the order the server sent them
    return batch


def has_message_store(state) -> bool:
    return hasattr(state, "message_ins_store") and hasattr(state, "lock")


def grid_link_state(grid):
    """The link state behind Flower's in-memory grid (None for any other grid)."""
    return getattr(grid, "state", None)


# --- actor-contract -------------------------------------------------------------------------------
def actor_exceptions() -> tuple[type[Exception], type[Exception]]:
    """(ClientAppException, LoadClientAppError) as Flower's engine expects them from an actor."""
    require("actor-contract")
    return (_get("flwr.clientapp.client_app:ClientAppException"),
            _get("flwr.clientapp.client_app:LoadClientAppError"))


# --- message-size ---------------------------------------------------------------------------------
def recorddict_size(content) -> int:
    """Serialized size in bytes of a RecordDict (what it costs on the wire)."""
    if PROBES["message-size"].holds():
        return _get("flwr.common.serde:recorddict_to_proto")(content).ByteSize()
    size = 0
    for record in content.values():
        for value in record.values():
            size += len(value.data) if hasattr(value, "data") else len(repr(value))
    return size


# --- messages-outside-a-runtime -------------------------------------------------------------------
def act_as_superlink(run_id: int = 1) -> None:
    """Let this process create Messages as the SuperLink of run `run_id` (the in-process grid)."""
    require("messages-outside-a-runtime")
    identity = _get("flwr.supercore.task_identity:TaskIdentity")
    identity.task_id, identity.run_id = 1, run_id
    identity.node_id = _get("flwr.common.constant:SUPERLINK_NODE_ID")


def stamp_message_id(message, message_id: str) -> None:
    """Give a message the id a grid gives it when it is pushed (the in-process grid has no link)."""
    require("messages-outside-a-runtime")
    message.metadata.__dict__["_message_id"] = message_id


def from_the_link(reply) -> Any:
    """`reply` as the SuperLink sends it for a node it has marked offline: from the link's own node id."""
    require("messages-outside-a-runtime")
    reply.metadata.__dict__["_src_node_id"] = _get("flwr.common.constant:SUPERLINK_NODE_ID")
    return reply


# --- forking-executor -----------------------------------------------------------------------------
@dataclass(frozen=True)
class RuntimeApi:
    """What the forking executor needs from Flower's SuperNode runtime."""

    acquire_task_request: Callable
    client_app_task_type: Any
    log: Callable
    connect: Callable[..., Any]
    run_clientapp: Callable


def runtime_api() -> RuntimeApi:
    require("forking-executor")

    def connect(address: str, root_certificates: bytes | None):
        client_cls = _get("flwr.supercore.runtime:RuntimeHttpClient")
        interceptor = _get("flwr.supercore.interceptors:RuntimeVersionHttpInterceptor")
        retry = _get("flwr.supercore.retry:make_simple_http_retry_invoker")
        return client_cls.from_server_address(
            server_address=address, insecure=root_certificates is None, root_certificates=root_certificates,
            interceptors=[interceptor(component_name="SuperExec")], retry_invoker=retry())

    return RuntimeApi(
        acquire_task_request=_get("flwr.proto.runtime_pb2:AcquireTaskRequest"),
        client_app_task_type=_get("flwr.supercore.constant:TaskType").CLIENT_APP,
        log=_get("flwr.supercore:log"),
        connect=connect,
        run_clientapp=_get("flwr.supernode.runtime.run_clientapp:run_clientapp"),
    )


def report() -> dict[str, list[str]]:
    """{probe name: missing names} for every probe (an empty list: it holds)."""
    return {name: p.missing() for name, p in PROBES.items()}
