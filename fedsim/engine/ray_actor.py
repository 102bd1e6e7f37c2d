"""What a simulation sends to its Ray client actors, defined where importing it is cheap.

Every client actor imports the module of its actor class and of the ClientApp it is handed
before it trains anyone. Flower's actor class lives in `flwr.simulation.ray_transport.ray_actor`,
and importing it runs `flwr/simulation/__init__.py`, which pulls in the whole link state (SQLAlchemy,
alembic, FastAPI): 1.1-1.5 s of CPU per actor, measured, on the critical path of start-up. This
module needs only Ray and `flwr.clientapp`; fedsim's own client code is imported on the first
message, as before.
"""

from __future__ import annotations

import collections
import functools
import json

import ray
from flwr.clientapp import ClientApp

from fedsim.flower import compat as flower_compat


class ClientAppRunner:
    """Flower's `ClientAppActor`, the same contract: `run` hands the message to the ClientApp and
    returns (cid, reply, context); a failing app surfaces as `ClientAppException`, a ClientApp
    that cannot be loaded as `LoadClientAppError` (Flower stops the simulation on that one)."""

    def __init__(self, on_actor_init_fn=None) -> None:
        if on_actor_init_fn:
            on_actor_init_fn()

    def run(self, client_app_fn, message, cid: str, context):
        ClientAppException, LoadClientAppError = flower_compat.actor_exceptions()
        try:
            app = client_app_fn()
            out_message = app(message=message, context=context)
        except LoadClientAppError:
            raise
        except Exception as ex:
            raise ClientAppException(str(ex)) from ex
        return cid, out_message, context

    def run_cohort(self, client_app_fn, messages: list, cids: list[str], contexts: list):
        """Several messages in one task (fedsim/engine/cohorts.py): the ClientApp may first train the
        cohort together (`prepare_cohort`), then answers each message as `run` would. Returns
        (cids, per message its reply or the `ClientAppException` it raised, per message its context);
        a ClientApp that cannot be loaded still raises `LoadClientAppError` for the whole task."""
        ClientAppException, LoadClientAppError = flower_compat.actor_exceptions()
        try:
            app = client_app_fn()
        except LoadClientAppError:
            raise
        except Exception as ex:
            raise ClientAppException(str(ex)) from ex
        prepare = getattr(app, "prepare_cohort", None)
        if prepare is not None:
            prepare(messages, contexts)  # never raises: a client it could not prepare trains alone
        replies = []
        for message, context in zip(messages, contexts):
            try:
                replies.append(app(message=message, context=context))
            except Exception as ex:  # noqa: BLE001  (this client's failure is its reply; the others go on)
                replies.append(ClientAppException(str(ex)))
        return cids, replies, contexts

    def warm_up(self, scenario_json: str, key: str) -> str | None:
        """Import the client code and load the scenario's data now, before this actor's first
        message (a sweep asks while its own process is still importing, fedsim/engine/shared.py).
        A failure is returned, not raised: the run's first message meets it again and reports it."""
        try:
            from fedsim.client import app  # noqa: F401  (the ClientApp's modules)
            from fedsim.runtime import runtime_for

            runtime = runtime_for(_scenario_of(scenario_json, key))
            runtime.data, runtime.layout  # noqa: B018  (the dataset read, a model built)
        except Exception as ex:  # noqa: BLE001
            return f"{type(ex).__name__}: {ex}"
        return None

    def terminate(self) -> None:
        ray.actor.exit_actor()


@functools.cache
def client_actor_class():
    """The Ray actor class the engine creates in each worker, or None when the installed Flower's
    actor contract is not the one this class follows (the engine then keeps Flower's own)."""
    if not flower_compat.PROBES["actor-contract"].holds():
        return None
    return ray.remote(ClientAppRunner)


def scenario_message(scenario) -> tuple[str, str]:
    """(the scenario's JSON text, its content key): what an actor rebuilds the scenario from."""
    from fedsim.runtime import scenario_key
    from fedsim.scenario import scenario_dict

    return json.dumps(scenario_dict(scenario), sort_keys=True), scenario_key(scenario)


class CompactClientApp(ClientApp):
    """`make_client_app(scenario)`, pickled as the scenario's JSON text and rebuilt once per process.

    The engine pickles the ClientApp with every message. fedsim's ClientApp closes over the
    scenario, whose pydantic class is built at run time and so is pickled by value: 200 KB and
    ~20 ms to pickle in the server process plus ~50 ms to unpickle in the actor, per message.
    """

    def __init__(self, scenario_json: str, key: str, state_dir: str | None = None) -> None:
        super().__init__()
        self.scenario_json, self.key, self.state_dir = scenario_json, key, state_dir

    @classmethod
    def of(cls, scenario, state_dir=None) -> "CompactClientApp":
        """`state_dir`: the clients' own state folder (make_client_app), or None."""
        return cls(*scenario_message(scenario), None if state_dir is None else str(state_dir))

    def __reduce__(self):
        return (CompactClientApp, (self.scenario_json, self.key, self.state_dir))

    def __call__(self, message, context):
        return _client_app(self.scenario_json, self.key, self.state_dir)(message, context)

    def prepare_cohort(self, messages: list, contexts: list) -> None:
        """Train the honest clients of a cohort together before their messages are answered
        (fedsim/client/cohort.py decides who can, and logs why the others cannot)."""
        _client_app(self.scenario_json, self.key, self.state_dir).prepare_cohort(messages, contexts)


CLIENT_APPS_KEPT = 4  # ClientApps a worker process keeps: runs of a sweep in flight together share actors
_CLIENT_APPS: "collections.OrderedDict[tuple[str, str | None], ClientApp]" = collections.OrderedDict()


def _client_app(scenario_json: str, key: str, state_dir: str | None) -> ClientApp:
    """The ClientApp of (scenario, state folder), built once per worker process and kept, most
    recently used last, for the few runs that may be in flight on this actor (fedsim/engine/shared.py).
    The key is the scenario's content, so a run never gets another scenario's app."""
    if (key, state_dir) in _CLIENT_APPS:
        _CLIENT_APPS.move_to_end((key, state_dir))
    else:
        from fedsim.client.app import make_client_app

        scenario = _scenario_of(scenario_json, key)
        while len(_CLIENT_APPS) >= CLIENT_APPS_KEPT:
            _CLIENT_APPS.popitem(last=False)
        _CLIENT_APPS[key, state_dir] = make_client_app(scenario, state_dir)
    return _CLIENT_APPS[key, state_dir]


def _scenario_of(scenario_json: str, key: str):
    """The scenario the server sent as JSON; the round trip must give back the very same scenario."""
    from fedsim.runtime import scenario_key
    from fedsim.scenario import validate_scenario

    scenario = validate_scenario(json.loads(scenario_json), "the simulated scenario")
    if scenario_key(scenario) != key:
        raise RuntimeError("the scenario sent to the client actors does not validate to the one the server runs")
    return scenario
