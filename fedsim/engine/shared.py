"""One Ray and one set of client actors for every run of a sweep.

A run on its own starts Ray (~6 s on two cores), creates its client actors (each a fresh worker
process that imports torch and fedsim and maps the data: most of a quickstart run's first round)
and stops them and Ray again (~1.5 s); for a quickstart-sized run that is most of its time.
`SharedEngine` pays it once: it starts a local Ray (or attaches to a cluster's address), holds the
engine adjustments of fedsim/engine/simulate.py, and lends its client actors to every run started
with `simulate(..., engine=...)`, one message at a time, so that runs in flight together share the
cluster's actors: the CPU/GPU budget is the cluster's, however many runs are in flight.

What it pays, it overlaps: `begin` starts Ray in a thread while the caller validates its runs;
`start(scenario)` creates the first run's actors as soon as Ray is up and has them import the
client code and read the data while the runs' servers start; `close_in_background` shuts Ray
down while the caller draws its report (`fedsim sweep`, fedsim/cli.py).

Why a run on shared actors computes what it computes alone: a run's messages already land on
whichever actor is free, so nothing a client computes may depend on the process it runs in (its
randomness is seeded per round and client, fedsim/seeding.py; its memory is in its Context or its
state folder). What an actor keeps between messages is the ClientApp built from the scenario's
exact JSON (fedsim/engine/ray_actor.py), keyed by the scenario's content and state folder, and
the datasets' caches, keyed by their files; a run never sees another scenario's app; a warm-up
only fills those caches ahead of the first message.

Flower's engine is reached only through fedsim/flower/compat.py (`shared_engine_patches`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import random
import threading

from fedsim.flower import compat as flower_compat
from fedsim.flower.options import EngineOptions

log = logging.getLogger("fedsim")


class SharedActors:
    """Client actors of one resource shape, idle ones in a queue that every run's pool draws from."""

    def __init__(self, create, size: int) -> None:
        self.actors = [create() for _ in range(size)]
        self.idle: queue.Queue = queue.Queue()
        for actor in self.actors:
            self.idle.put(actor)
        self.leases = 0  # runs using these actors now
        self.lock = threading.Lock()

    def kill(self) -> None:
        import ray

        for actor in self.actors:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        self.actors = []


class RunPool:
    """What Flower's Ray backend expects of its `BasicActorPool`, for one run, on shared actors.

    The run gets as many engine workers as there are shared actors; each worker borrows an idle
    actor for one message and gives it back, so runs in flight together divide the actors between
    them message by message. Ending the run gives the actors back instead of killing them."""

    def __init__(self, shared: SharedActors) -> None:
        self.shared = shared
        self.num_actors = self.actors_capacity = len(shared.actors)
        self.pool: list = []  # Flower's idle list; the idle actors are in shared.idle
        self._future_to_actor: dict = {}
        with shared.lock:
            shared.leases += 1
        self._ended = False

    def add_actors_to_pool(self, num_actors: int) -> None:
        """The shared actors exist already."""

    def is_actor_available(self) -> bool:
        return not self.shared.idle.empty()

    def submit(self, actor_fn, job):
        actor = self.shared.idle.get()
        try:
            future = actor_fn(actor, *job)
        except BaseException:
            self.shared.idle.put(actor)
            raise
        self._future_to_actor[future] = actor
        return future

    def add_actor_back_to_pool(self, future) -> None:
        """Once per future: after a failed fetch (an actor killed mid-task) Flower's backend returns
        the actor again, which `fetch_result_and_return_actor_to_pool` has already done."""
        actor = self._future_to_actor.pop(future, None)
        if actor is not None:
            self.shared.idle.put(actor)

    def fetch_result_and_return_actor_to_pool(self, future):
        import ray

        try:
            _, out_message, updated_context = ray.get(future)
        finally:
            self.add_actor_back_to_pool(future)
        return out_message, updated_context

    def terminate_all_actors(self) -> None:
        if not self._ended:
            self._ended = True
            with self.shared.lock:
                self.shared.leases -= 1


class SharedEngine:
    """A running Ray with client actors, shared by every `simulate(..., engine=self)` while open.

    `address`: an existing Ray cluster (`ray start --head` ...) to attach to; None starts a local
    one on this machine's cores. `ray.init` runs in a thread of its own, so it leaves the process's
    signal handlers alone (in the main thread it replaces SIGTERM's)."""

    def __init__(self, address: str | None = None, verbose: bool = False, options: EngineOptions = EngineOptions()) -> None:
        self.address, self.verbose, self.options = address, verbose, options
        self.shapes: dict[str, SharedActors] = {}
        self.lock = threading.Lock()
        self.stack = contextlib.ExitStack()
        self.started = False
        self.starting: tuple | None = None  # `begin`'s thread, its events (Ray up, release) and what it raised
        self.warm_ups: list = []  # the prestarted actors' warm-up results (None, or what failed)

    @staticmethod
    def available() -> bool:
        """Whether the installed Flower lets runs share an engine (else a sweep starts Ray per run)."""
        return flower_compat.PROBES["shared-engine"].holds() and flower_compat.PROBES["simulation-engine"].holds()

    def begin(self) -> "SharedEngine":
        """Start Ray (or attach to it) in a background thread and return at once: a sweep
        validates its runs meanwhile, which imports torch and every component (~3 s on two
        cores), while Ray's processes start (~6 s). Only Ray's own start runs in the thread;
        `start` waits for it. Needs only Ray and fedsim/engine/ray_start.py."""
        from fedsim.engine.allocator import apply_to_this_process
        from fedsim.engine.ray_start import quiet_logs, single_threaded_openblas

        if self.starting is not None or self.started:
            return self
        quiet_logs(self.verbose)
        if self.options.malloc_settings:
            apply_to_this_process()
        # before Ray forks (see there); libraries loaded by this process meanwhile are single-threaded too
        self.stack.enter_context(single_threaded_openblas())
        import ray  # noqa: F401  (here, not in the thread: one thread imports Ray's package)

        up, release, failure = threading.Event(), threading.Event(), []

        def start_ray() -> None:
            try:
                self.start_ray()
            except BaseException as err:  # noqa: BLE001  (raised again by `start`, in the caller's thread)
                failure.append(err)
            up.set()
            # Ray's processes die with the *thread* that started them (prctl PR_SET_PDEATHSIG, Ray's
            # fate sharing): this one lives until `close` has shut Ray down
            release.wait()

        self.starting = (threading.Thread(target=start_ray, name="fedsim-ray", daemon=True), up, release, failure)
        self.starting[0].start()
        return self

    def start(self, scenario=None) -> "SharedEngine":
        """Ray up (waiting for `begin`'s thread, or starting it here) and, given the scenario of the
        first run, the client actors its runs will borrow, each told to import the client code
        and read the data now: they warm up while this process imports the server, instead of in
        the first run's first round. `with` calls it when nobody did."""
        if self.started:
            return self
        try:
            self.begin()
            if scenario is not None:  # their imports (Flower's engine and client side) while Ray is still starting
                from fedsim.engine.ray_actor import client_actor_class

                self.available(), client_actor_class()
            _, up, _, failure = self.starting
            up.wait()
            if failure:
                raise failure[0]
            self.started = True
            if scenario is not None:
                self.prestart(scenario)
        except BaseException:
            self.close()
            raise
        return self

    def open(self) -> "SharedEngine":
        """Started, and every simulation from now on runs on this engine (Flower's engine adjusted
        and its actor pool lent from here) until `close`."""
        from fedsim.engine.simulate import engine_adjustments

        try:
            self.start()
            self.stack.enter_context(engine_adjustments(self.options))
            # one run id for the engine's runs (random, as Flower's own: Message ids are per run state)
            run_id = random.SystemRandom().randrange(1, 2**62)
            self.stack.enter_context(flower_compat.shared_engine_patches(self.pool_for, run_id))
        except BaseException:
            self.close()
            raise
        return self

    def __enter__(self) -> "SharedEngine":
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()

    def start_ray(self) -> None:
        import ray

        from fedsim.engine.ray_start import OBJECT_STORE_BYTES, init_local_ray, workers_pythonpath

        init_args = {"logging_level": "INFO" if self.verbose else "ERROR", "log_to_driver": self.verbose,
                     "include_dashboard": False}
        if ray.is_initialized():
            return
        if self.address:  # a cluster's workers inherit nothing from this process: PYTHONPATH goes in the job's env
            ray.init(address=self.address, runtime_env={"env_vars": {"PYTHONPATH": workers_pythonpath()}}, **init_args)
        else:
            init_local_ray(dict(init_args, num_cpus=os.cpu_count() or 1, object_store_memory=OBJECT_STORE_BYTES),
                           self.options.malloc_settings)
        self.stack.callback(ray.shutdown)

    @staticmethod
    def shape_key(actor_type, client_resources: dict, actor_kwargs: dict) -> str:
        return json.dumps([getattr(actor_type, "__name__", str(actor_type)), client_resources,
                           sorted((actor_kwargs or {}).items(), key=str)], sort_keys=True, default=str)

    def actors_of(self, actor_type, client_resources: dict, actor_kwargs: dict) -> SharedActors:
        """The shared actors of this resource shape, created on first use. A new shape first
        releases the idle actors of other shapes, so that they do not hold the cores."""
        key = self.shape_key(actor_type, client_resources, actor_kwargs)
        with self.lock:
            if key not in self.shapes:
                for other, actors in list(self.shapes.items()):
                    if actors.leases == 0:
                        actors.kill()
                        del self.shapes[other]
                size = flower_compat.actor_pool_size(client_resources)
                if size < 1:
                    raise RuntimeError(f"no node of the Ray cluster can host a client with resources {client_resources}")
                create = lambda: actor_type.options(**client_resources).remote(**(actor_kwargs or {}))  # noqa: E731
                self.shapes[key] = SharedActors(create, size)
                log.info("shared engine: %d client actors with %s", size, client_resources)
            return self.shapes[key]

    def pool_for(self, actor_type, client_resources: dict, actor_kwargs: dict) -> RunPool:
        """A run's pool on the shared actors of its resource shape (what Flower's backend builds)."""
        return RunPool(self.actors_of(actor_type, client_resources, actor_kwargs))

    def prestart(self, scenario) -> None:
        """The client actors `scenario`'s run will ask for, each sent a warm-up (ray_actor.py
        `warm_up`: imports, data, a model) that runs before any message. The shape is the one
        Flower's backend asks for (fedsim's actor class, `client_resources`, no actor arguments);
        if it ever differed, the run would release these idle actors and make its own."""
        from fedsim.engine.ray_actor import client_actor_class, scenario_message
        from fedsim.engine.ray_start import client_resources

        actor_type = client_actor_class() if self.options.light_actor else None
        if actor_type is None:  # Flower's own actor class has no warm-up
            return
        message = scenario_message(scenario)
        shared = self.actors_of(actor_type, client_resources(scenario), {})
        self.warm_ups = [actor.warm_up.remote(*message) for actor in shared.actors]

    def close_in_background(self) -> threading.Thread:
        """`close` in a thread (Ray's shutdown takes ~1.5 s): join it before this process exits."""
        thread = threading.Thread(target=self.close, name="fedsim-ray-shutdown")
        thread.start()
        return thread

    def close(self) -> None:
        """Stop the actors and Ray (or detach from the cluster). Again: nothing more happens."""
        if self.starting is not None:
            self.starting[1].wait()  # Ray's start is not interruptible; shut it down once it is up
        with self.lock:
            for actors in self.shapes.values():
                actors.kill()
            self.shapes.clear()
        self.stack.close()
        if self.starting is not None:
            self.starting[2].set()
            self.starting[0].join()

