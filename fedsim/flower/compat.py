"""Every use of Flower's non-public API, in one place, each behind a capability probe.

fedsim talks to Flower through its public API (`flwr.app`, `flwr.serverapp`, `flwr.clientapp`,
`flwr.simulation.run_simulation`). A few things it needs are not public in flwr 1.41; they are
all here, so that a Flower upgrade means reading one file and running one test
(`tests/test_flower_compat.py`, which fails naming every probe that no longer holds):

* `simulation-engine`: fedsim's simulation adjustments (fedsim/engine/simulate.py) replace or wrap,
  through `set_engine_members` here, nine members of Flower's simulation engine (node registration
  and the nodes' run-info stores, message delivery, the worker queues and the workers themselves
  (cohorts: one actor task for several messages), actor shutdown and class, the actor pool's size
  (memory counted), Ray's start); nodes are
  registered one at a time, when first messaged, by `register_node` and `node_info_store`.
  Fallback: the engine runs as shipped (correct, slower at scale).
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
import secrets
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
               f"{_POOL}:BasicActorPool.terminate_all_actors", f"{_POOL}:pool_size_from_resources", f"{_VCE}:worker",
               f"{_VCE}:VceMetrics",
               "flwr.common.constant:ErrorCode", f"{_RAYBACKEND}:RayBackend.process_message",
               f"{_LINKSTATE}:InMemoryLinkState._check_stored_messages",
               f"{_LINKSTATE}:InMemoryLinkState.get_message_ins", "flwr.supercore.date:now",
               f"{_VCE}:_register_node_info_stores", f"{_LINKSTATE}:InMemoryLinkState.create_node",
               f"{_LINKSTATE}:InMemoryLinkState.acknowledge_node_heartbeat",
               "flwr.compat.client.run_info_store:DeprecatedRunInfoStore.register_context",
               "flwr.common.constant:NOOP_FLWR_AID", "flwr.common.constant:NOOP_ACCOUNT_NAME",
               "flwr.common.constant:HEARTBEAT_INTERVAL_INF", "flwr.common.constant:PARTITION_ID_KEY",
               "flwr.common.constant:NUM_PARTITIONS_KEY"),
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
# fedsim's name -> (owner, attribute): the members of Flower's simulation engine that fedsim's
# simulation adjustments replace (fedsim/engine/simulate.py builds the replacements)
ENGINE_MEMBERS = {
    "register_nodes": (_VCE, "_register_nodes"),
    "node_info_stores": (_VCE, "_register_node_info_stores"),
    "deliver": (_VCE, "add_messages_to_queue"),
    "queue": (_VCE, "Queue"),
    "actor_class": (_RAYBACKEND, "ClientAppActor"),
    "init_ray": (f"{_RAYBACKEND}:RayBackend", "init_ray"),
    "terminate_all_actors": (f"{_POOL}:BasicActorPool", "terminate_all_actors"),
    "worker": (_VCE, "worker"),
    "pool_size": (_POOL, "pool_size_from_resources"),
}


def _owner(spec: str) -> Any:
    return _get(spec) if ":" in spec else importlib.import_module(spec)


def engine_members() -> dict[str, Any]:
    """The current values of ENGINE_MEMBERS (Flower's own, or fedsim's while adjusted)."""
    require("simulation-engine")
    return {name: getattr(_owner(owner), attr) for name, (owner, attr) in ENGINE_MEMBERS.items()}


def set_engine_members(values: dict[str, Any]) -> None:
    """Replace the named members of Flower's simulation engine (the one place fedsim writes them);
    called again with `engine_members()`'s earlier result to put Flower's back."""
    require("simulation-engine")
    for name, value in values.items():
        owner, attr = ENGINE_MEMBERS[name]
        setattr(_owner(owner), attr, value)


def register_node(state) -> int:
    """Register one simulated node with an in-memory link state and return its id: what
    `vce_api._register_nodes` does for each of its nodes (`create_node` with a random public key,
    then a heartbeat with an infinite interval, so the node stays online), for one node, when fedsim's
    engine needs it (fedsim/engine/simulate.py: `SimulatedNodes`)."""
    const = importlib.import_module("flwr.common.constant")
    while True:
        node_id = state.create_node(const.NOOP_FLWR_AID, const.NOOP_ACCOUNT_NAME, secrets.token_bytes(32),
                                    heartbeat_interval=const.HEARTBEAT_INTERVAL_INF)
        if node_id:  # 0: the random id was taken (Flower logs it); draw again
            break
    state.acknowledge_node_heartbeat(node_id=node_id, heartbeat_interval=const.HEARTBEAT_INTERVAL_INF)
    return node_id


def node_info_store(node_id: int, partition_id: int, num_partitions: int, run, app_dir: str | None):
    """The run-info store (node config and the run's Context) of one simulated node: what
    `vce_api._register_node_info_stores` makes for each node of the mapping, for one node."""
    const = importlib.import_module("flwr.common.constant")
    store_class = _get("flwr.compat.client.run_info_store:DeprecatedRunInfoStore")
    store = store_class(node_id=node_id, node_config={const.PARTITION_ID_KEY: partition_id,
                                                      const.NUM_PARTITIONS_KEY: num_partitions})
    store.register_context(run_id=run.run_id, run=run, app_dir=app_dir)
    return store


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
def run_cohort_task(backend, messages: list, contexts: list, wait: Callable[[Any, Any], bool] | None = None
                    ) -> tuple[list, list]:
    """What `RayBackend.process_message` does for one message, for a cohort of messages in one task
    on one actor (`run_cohort`, fedsim/engine/ray_actor.py): (per message its reply or the exception
    it raised, per message its updated context). An actor that dies fails the whole task; a task of
    several messages is then not retried by Ray (the caller retries each message alone), a single
    message is, as the actor's options say (fedsim/engine/ray_start.py client_resources).
    `wait(future, actor)`, when given, runs before the result is fetched: it may wait for the task
    its own way, raise to give up on it, or return True when the actor is lost for good (its node
    left the cluster and no node has room for it). Such an actor leaves Flower's `BasicActorPool`:
    it is killed, not to be restarted, the pool counts one actor less, and the task fails with
    Ray's `ActorDiedError`. (The shared engine's pool, fedsim/engine/shared.py, keeps its actors.)"""
    if backend.pool is None or backend.app_fn is None:
        raise ValueError("the Ray backend is not built: no actor pool to run a cohort on")
    cids = [str(c.node_config["partition-id"]) for c in contexts]
    retries = {} if len(messages) == 1 else {"max_task_retries": 0}

    def submit(actor, app_fn, msgs, ids, ctxs):
        return actor.run_cohort.options(**retries).remote(app_fn, msgs, ids, ctxs)

    pool = backend.pool
    future = pool.submit(submit, (backend.app_fn, messages, cids, contexts))
    try:
        if wait is not None and wait(future, pool._future_to_actor[future]) and can_retire_actors(backend):
            import ray

            actor = pool._future_to_actor.pop(future)
            ray.kill(actor, no_restart=True)
            pool.num_actors -= 1
            _, replies, updated = ray.get(future)  # Ray's ActorDiedError, unless the task had just answered
            return replies, updated
        return pool.fetch_result_and_return_actor_to_pool(future)
    except Exception:
        if future in pool._future_to_actor:
            pool.add_actor_back_to_pool(future)  # as process_message does (a no-op once returned)
        raise


def can_retire_actors(backend) -> bool:
    """Whether `run_cohort_task` can take a lost actor out of the backend's pool (Flower's own pool)."""
    return isinstance(backend.pool, _get(f"{_POOL}:BasicActorPool"))


def pool_actors(backend) -> int:
    """How many actors the backend's pool holds (idle or busy)."""
    return backend.pool.num_actors


def backend_client_resources(backend) -> dict:
    """The `client_resources` the backend's actors were made with."""
    return backend.client_resources


def error_code(ex: BaseException) -> int:
    """The `ErrorCode` Flower's engine worker gives a reply whose ClientApp raised `ex`."""
    codes = _get("flwr.common.constant:ErrorCode")
    client_app_exception, load_error = actor_exceptions()
    if isinstance(ex, client_app_exception):
        return codes.CLIENT_APP_RAISED_EXCEPTION
    if isinstance(ex, load_error):
        return codes.LOAD_CLIENT_APP_EXCEPTION
    return codes.UNKNOWN


def ray_actor_state(actor) -> str | None:
    """The state Ray's actor table (its GCS) holds for `actor` ("ALIVE", "RESTARTING", "DEAD", ...),
    or None when the table has no entry. Ray has no public call for one actor's state short of its
    state API, which needs the dashboard: `ray._private.state` and the handle's `_actor_id` (Ray 2.x)."""
    from ray._private import state

    info = state.actors(actor_id=actor._actor_id.hex())
    return info.get("State") if info else None


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
    """Give a message the id a grid gives it when it is pushed (the in-process grid has no link), or
    the id the engine's worker gives a reply (fedsim/engine/cohorts.py)."""
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


# --- secure aggregation: Flower's SecAgg+ (docs/secure_aggregation.md) ----------------------------
# Flower 1.41 ships SecAgg+ as a legacy workflow (`flwr.server.workflow.SecAggPlusWorkflow`, which
# drives the four exchanges on a Grid through a `LegacyContext` holding a legacy Strategy) and a
# client mod (`flwr.client.mod.secaggplus_mod`, which wraps a handler that answers with legacy
# `fitres.*` records). fedsim reuses both unchanged: the adapters below hand the workflow the
# round's clients as legacy FitIns and take the unmasked aggregate from its `aggregate_fit` call.
SECAGG_STAGES = ("setup", "share_keys", "collect_masked_vectors", "unmask")
PROBES["secure-aggregation"] = Probe(
    "secure-aggregation", "secure_aggregation: Flower's SecAgg+ workflow and mod, its legacy records, its key agreement "
    "and encryption (also LightSecAgg's share exchange)",
    ("flwr.server.workflow:SecAggPlusWorkflow", "flwr.server.compat.legacy_context:LegacyContext",
     "flwr.server.strategy:Strategy", "flwr.client.mod:secaggplus_mod",
     "flwr.common.secure_aggregation.secaggplus_constants:RECORD_KEY_CONFIGS",
     "flwr.compat.common.recorddict_compat:recorddict_to_fitins",
     "flwr.compat.common.recorddict_compat:fitres_to_recorddict",
     "flwr.compat.common.recorddict_compat:recorddict_to_fitres",
     "flwr.common:FitIns", "flwr.common:FitRes", "flwr.common:ndarrays_to_parameters",
     "flwr.common:parameters_to_ndarrays", "flwr.supercore.primitives.asymmetric:generate_key_pairs",
     "flwr.common.secure_aggregation.crypto.symmetric_encryption:generate_shared_key"),
    "none: a scenario with secure_aggregation fails at its first secure round, naming the missing names")


def secaggplus_record_key() -> str:
    """The ConfigRecord name under which SecAgg+ messages carry their protocol fields."""
    require("secure-aggregation")
    return _get("flwr.common.secure_aggregation.secaggplus_constants:RECORD_KEY_CONFIGS")


def secaggplus_client_mod():
    """Flower's client mod for SecAgg+ (`flwr.client.mod.secaggplus_mod`)."""
    return _get("flwr.client.mod:secaggplus_mod")


def legacy_fit_ins(content) -> tuple[list, dict]:
    """(arrays, config) of a legacy `fitins.*` RecordDict (what SecAggPlusWorkflow sends with stage 2)."""
    compat = importlib.import_module("flwr.compat.common.recorddict_compat")
    fitins = compat.recorddict_to_fitins(content, keep_input=True)
    return _get("flwr.common:parameters_to_ndarrays")(fitins.parameters), dict(fitins.config)


def is_legacy_fit_ins(content) -> bool:
    return "fitins.parameters" in content.array_records and "fitins.config" in content.config_records


def legacy_fit_res(arrays: list, num_examples: int, metrics: dict):
    """A legacy `fitres.*` RecordDict: what `secaggplus_mod` reads the update and its weight from."""
    compat = importlib.import_module("flwr.compat.common.recorddict_compat")
    common = importlib.import_module("flwr.common")
    fitres = common.FitRes(status=common.Status(code=common.Code.OK, message="Success"),
                           parameters=common.ndarrays_to_parameters(arrays), num_examples=int(num_examples),
                           metrics=dict(metrics))
    return compat.fitres_to_recorddict(fitres, keep_input=True)


class _NodeProxy:
    """What SecAggPlusWorkflow needs of a legacy ClientProxy: its node id."""

    def __init__(self, node_id: int) -> None:
        self.node_id = node_id
        self.cid = str(node_id)


@dataclass
class SecAggPlusRound:
    """What one run of Flower's SecAggPlusWorkflow gave: the unmasked weighted mean (None when the
    protocol halted), the nodes whose masked vectors were summed, and each client's legacy metrics."""

    aggregate: list | None
    summed: list[int]
    metrics: dict[int, dict]  # node id -> its fitres metrics and num_examples
    failures: list[str]


def run_secaggplus(grid, fit_ins: dict[int, tuple[list, dict]], server_round: int, *, num_shares, reconstruction_threshold,
                   max_weight: float, clipping_range: float, quantization_range: int, modulus_range: int,
                   timeout: float | None) -> SecAggPlusRound:
    """One secure round through Flower's own SecAggPlusWorkflow: `fit_ins` maps each node id to the
    (arrays, config) of its training instruction. The workflow's messages go through `grid`
    (wrap it to count bytes); the weighted mean of the clients' returned arrays is unmasked by the
    workflow and handed to the legacy strategy's `aggregate_fit`, where it is taken from here."""
    app = importlib.import_module("flwr.app")
    workflow_cls = _get("flwr.server.workflow:SecAggPlusWorkflow")
    legacy_context = _get("flwr.server.compat.legacy_context:LegacyContext")
    legacy_strategy = _get("flwr.server.strategy:Strategy")
    common = importlib.import_module("flwr.common")
    outcome = SecAggPlusRound(None, [], {}, [])

    class Adapter(legacy_strategy):  # the legacy Strategy the workflow calls: ours decides, the workflow exchanges
        def initialize_parameters(self, client_manager):
            return None

        def configure_fit(self, server_round, parameters, client_manager):
            return [(_NodeProxy(nid), common.FitIns(common.ndarrays_to_parameters(arrays), dict(config)))
                    for nid, (arrays, config) in fit_ins.items()]

        def aggregate_fit(self, server_round, results, failures):
            if results:
                outcome.aggregate = common.parameters_to_ndarrays(results[0][1].parameters)
            outcome.summed = sorted(proxy.node_id for proxy, _ in results)
            outcome.metrics = {proxy.node_id: {**res.metrics, "num_examples": res.num_examples} for proxy, res in results}
            outcome.failures = [str(f) for f in failures]
            return None, {}

        def configure_evaluate(self, server_round, parameters, client_manager):
            return []

        def aggregate_evaluate(self, server_round, results, failures):
            return None, {}

        def evaluate(self, server_round, parameters):
            return None

    context = app.Context(run_id=0, node_id=0, node_config={}, state=app.RecordDict(), run_config={})
    context = legacy_context(context, strategy=Adapter())
    context.state.config_records["config"] = app.ConfigRecord({"current_round": int(server_round)})
    context.state.array_records["parameters"] = app.ArrayRecord()
    workflow = workflow_cls(num_shares, reconstruction_threshold, max_weight=float(max_weight),
                            clipping_range=float(clipping_range), quantization_range=int(quantization_range),
                            modulus_range=int(modulus_range), timeout=timeout)
    workflow(grid, context)
    return outcome


def legacy_fit_res_update(content) -> tuple[list, int, dict]:
    """(arrays, num_examples, metrics) of a legacy `fitres.*` RecordDict (what the train handler
    answers inside a secure round)."""
    compat = importlib.import_module("flwr.compat.common.recorddict_compat")
    fitres = compat.recorddict_to_fitres(content, keep_input=True)
    return _get("flwr.common:parameters_to_ndarrays")(fitres.parameters), int(fitres.num_examples), dict(fitres.metrics)


@dataclass(frozen=True)
class PairwiseCrypto:
    """Flower's SecAgg+ primitives, reused for LightSecAgg's share exchange: an elliptic-curve key
    pair as bytes, the ECDH + HKDF shared key of a private and a public key, Fernet encryption."""

    key_pair: Callable[[], tuple[bytes, bytes]]
    shared_key: Callable[[bytes, bytes], bytes]
    encrypt: Callable[[bytes, bytes], bytes]
    decrypt: Callable[[bytes, bytes], bytes]


def pairwise_crypto() -> PairwiseCrypto:
    asym = importlib.import_module("flwr.supercore.primitives.asymmetric")
    sym = importlib.import_module("flwr.common.secure_aggregation.crypto.symmetric_encryption")

    def key_pair() -> tuple[bytes, bytes]:
        sk, pk = asym.generate_key_pairs()
        return asym.private_key_to_bytes(sk), asym.public_key_to_bytes(pk)

    def shared_key(sk: bytes, pk: bytes) -> bytes:
        return sym.generate_shared_key(asym.bytes_to_private_key(sk), asym.bytes_to_public_key(pk))

    return PairwiseCrypto(key_pair, shared_key, sym.encrypt, sym.decrypt)

# --- shared-engine (fedsim/engine/shared.py) ------------------------------------------------------
_SIMULATION = "flwr.simulation.run_simulation"

PROBES["shared-engine"] = Probe(
    "shared-engine", "one Ray and one set of client actors for every run of a sweep",
    (f"{_RAYBACKEND}:BasicActorPool", f"{_RAYBACKEND}:RayBackend.terminate",
     f"{_SIMULATION}:generate_rand_int_from_bytes", f"{_POOL}:pool_size_from_resources"),
    "each run of a sweep starts and stops its own Ray, one run at a time")


def actor_pool_size(client_resources: dict) -> int:
    """How many client actors of `client_resources` fit in the running Ray cluster, node by node (Flower's rule)."""
    require("shared-engine")
    return _get(f"{_POOL}:pool_size_from_resources")(client_resources)


def shared_engine_patches(pool_for: Callable[..., Any], run_id: int):
    """While the returned context is open, every simulation's Ray backend takes its actor pool from
    `pool_for(actor_type, client_resources, actor_kwargs)` and leaves Ray running when it ends, and
    every `run_simulation` uses `run_id`: Flower stamps each new Message with the process-wide
    `TaskIdentity.run_id` that `run_simulation` sets, so runs in flight together in one process
    must share one id (each still has its own link state, nodes and contexts)."""
    import contextlib

    require("shared-engine")

    @contextlib.contextmanager
    def patched():
        raybackend, simulation = importlib.import_module(_RAYBACKEND), importlib.import_module(_SIMULATION)
        saved = raybackend.BasicActorPool, raybackend.RayBackend.terminate, simulation.generate_rand_int_from_bytes

        def terminate(backend) -> None:  # the run's pool hands its actors back; Ray stays up
            if backend.pool:
                backend.pool.terminate_all_actors()

        raybackend.BasicActorPool = lambda actor_type, client_resources, actor_kwargs: pool_for(
            actor_type, client_resources, actor_kwargs)
        raybackend.RayBackend.terminate = terminate
        simulation.generate_rand_int_from_bytes = lambda num_bytes: run_id
        try:
            yield
        finally:
            raybackend.BasicActorPool, raybackend.RayBackend.terminate, simulation.generate_rand_int_from_bytes = saved

    return patched()



# --- deployment: each reply pulled only up to the server's bound (fedsim/deploy/bounded_grid.py) ---
# flwr 1.41's `HttpGrid.pull_messages` pulls every object of a reply into the ServerApp's memory,
# whatever its size. `pull_replies_bounded` makes the same Runtime API calls through the grid's own
# client but counts each reply's bytes as its objects arrive and gives up a reply past the bound.
_HTTP_GRID = "flwr.superlink.grid.http_grid:HttpGrid"
_INFLATE = "flwr.supercore.inflatable.inflatable_utils"
PROBES["bounded-pull"] = Probe(
    "bounded-pull", "a deployed ServerApp pulls each reply only up to the server's bound",
    (_HTTP_GRID, "flwr.proto.runtime_pb2:PullAppMessagesRequest", "flwr.proto.message_pb2:ConfirmMessageReceivedRequest",
     "flwr.supercore.inflatable.inflatable_protobuf_utils:make_pull_object_fn_protobuf", f"{_INFLATE}:pull_objects",
     f"{_INFLATE}:iterate_object_tree", f"{_INFLATE}:inflate_object_from_contents", f"{_INFLATE}:ObjectPullError",
     "flwr.app.message:make_message", "flwr.common.constant:ErrorCode", "flwr.supercore.constant:SYSTEM_MESSAGE_TYPE",
     "flwr.supercore.date:now"),
    "Flower's own pull: a reply is loaded whole before fedsim's decoding refuses it when oversized")


def is_http_grid(grid) -> bool:
    """Whether `grid` is Flower's HTTP grid (a deployed ServerApp's) and the bounded pull holds for it."""
    try:
        return isinstance(grid, _get(_HTTP_GRID)) and PROBES["bounded-pull"].holds()
    except (ImportError, AttributeError):
        return False


class ReplyTooLarge(Exception):
    """A reply's objects passed the bound while they were pulled."""


def pull_replies_bounded(grid, message_ids, limit: int, too_large: Callable[[int, int], str]) -> list:
    """`HttpGrid.pull_messages` (flwr 1.41) for Flower's HTTP `grid`, each reply's objects counted as
    they arrive: a reply past `limit` bytes becomes an error reply (reason `too_large(src node id,
    bytes pulled)`) matched to the message it answers, and what was pulled of it is dropped. A
    reply's objects are pulled two at a time (Flower's FLWR_PRIVATE_MAX_CONCURRENT_OBJ_PULLS)."""
    inflate = importlib.import_module(_INFLATE)
    make_pull = _get("flwr.supercore.inflatable.inflatable_protobuf_utils:make_pull_object_fn_protobuf")
    client, run_id, node = grid._runtime_client, grid._run.run_id, grid.node  # noqa: SLF001 - HttpGrid's own
    res = client.PullMessages(_get("flwr.proto.runtime_pb2:PullAppMessagesRequest")(message_ids=message_ids))
    out = []
    for msg_proto, tree in zip(res.messages_list, res.message_object_trees, strict=True):
        msg_id = msg_proto.metadata.message_id
        pull_one = make_pull(pull_object_protobuf=client.PullObject, node=node, run_id=run_id)
        pulled = [0]

        def counted(object_id: str, pull_one=pull_one, pulled=pulled) -> bytes:
            content = pull_one(object_id)
            pulled[0] += len(content)
            if pulled[0] > limit:
                raise ReplyTooLarge(object_id)
            return content

        try:
            contents = inflate.pull_objects([t.object_id for t in inflate.iterate_object_tree(tree)],
                                            pull_object_fn=counted)
        except ReplyTooLarge:
            out.append(_error_reply(grid, msg_proto, too_large(msg_proto.metadata.src_node_id, pulled[0]), run_id))
            continue
        except inflate.ObjectPullError as err:  # as HttpGrid: an object gone or never uploaded
            out.append(_error_reply(grid, msg_proto, f"Reply message objects are unavailable. {err}", run_id))
            continue
        client.ConfirmMessageReceived(_get("flwr.proto.message_pb2:ConfirmMessageReceivedRequest")(
            node=node, run_id=run_id, message_object_id=msg_id))
        message = inflate.inflate_object_from_contents(msg_id, contents)
        message.metadata.__dict__["_message_id"] = msg_id
        out.append(message)
    return out


def _error_reply(grid, msg_proto, reason: str, run_id: int):
    """An error reply from the grid's own node in place of a reply not pulled, as HttpGrid makes one."""
    app = importlib.import_module("flwr.app")
    node = grid.node.node_id
    metadata = app.Metadata(run_id=run_id, message_id="", src_node_id=node, dst_node_id=node,
                            message_type=_get("flwr.supercore.constant:SYSTEM_MESSAGE_TYPE"), group_id="", ttl=0,
                            reply_to_message_id=msg_proto.metadata.reply_to_message_id,
                            created_at=_get("flwr.supercore.date:now")().timestamp())
    error = app.Error(code=_get("flwr.common.constant:ErrorCode").MESSAGE_UNAVAILABLE, reason=reason)
    return _get("flwr.app.message:make_message")(metadata=metadata, error=error)
