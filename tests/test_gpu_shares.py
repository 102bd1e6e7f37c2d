"""Ray gives each simulated client the GPU share `federation.client_gpus` asks for (issue #18, Tests).

No GPU is needed: a local Ray declares logical GPUs (`ray.init(num_gpus=...)`), which Ray schedules
and assigns like real ones. The actors are fedsim's own client actor class, created with the
resources `backend_config` hands Flower's actor pool (Flower calls `.options(**client_resources)`
on the actor class), and each runs a probe "ClientApp" through the actor's `run`, which reports
what the actor was given: Ray's GPU ids, CUDA_VISIBLE_DEVICES, and the device fedsim would train
on there (`fedsim.devices.client_device`, with torch seeing no CUDA on this machine).
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

import fedsim.engine.simulate  # noqa: F401  (sets RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=0 before Ray starts, as a run does)
from fedsim.engine.ray_actor import client_actor_class
from fedsim.engine.simulate import backend_config
from fedsim.scenario import validate_scenario

ray = pytest.importorskip("ray")
pytestmark = [pytest.mark.simulation,
              pytest.mark.skipif(torch.cuda.is_available(), reason="checks logical GPUs on a machine without CUDA")]


@pytest.fixture(scope="module")
def cluster():
    """One local Ray for the module: 8 logical CPUs (placement only) and 2 logical GPUs."""
    ray.init(num_cpus=8, num_gpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import this test module
    yield
    ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
    ray.shutdown()


def resources(monkeypatch, share: float) -> dict:
    """The actor options a run with `federation.client_gpus=share` gives Flower's actor pool."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # passes the pre-start check only
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    config = backend_config(validate_scenario({"federation": {"client_gpus": share}}), verbose=False)
    monkeypatch.undo()
    return config["client_resources"]


def probe():
    """A ClientApp stand-in (built in the actor, pickled by value): what this actor was given."""
    def app(message, context):
        import os

        from fedsim.devices import client_device, ray_actor_gpus

        return {"gpus": sorted(ray_actor_gpus()), "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "device": str(client_device(types.SimpleNamespace(device="auto")))}
    return app


def start(options: dict, count: int) -> list:
    return [client_actor_class().options(**options).remote() for _ in range(count)]


def seen(actor, timeout: float | None = 60.0):
    ref = actor.run.remote(probe, None, "0", None)
    ready, _ = ray.wait([ref], timeout=timeout)
    return ray.get(ready[0])[1] if ready else None


def test_a_half_share_puts_two_clients_on_each_gpu_and_no_more(cluster, monkeypatch):
    options = resources(monkeypatch, 0.5)
    assert options["num_gpus"] == 0.5
    actors = start(options, 4)
    reports = [seen(a) for a in actors]
    assert sorted(r["gpus"][0] for r in reports) == ["0", "0", "1", "1"]
    assert all(len(r["gpus"]) == 1 and r["visible"] == r["gpus"][0] for r in reports)
    assert all(r["device"] == "cpu" for r in reports)  # torch sees no CUDA here: auto stays on CPU
    fifth = start(options, 1)[0]
    assert seen(fifth, timeout=3.0) is None  # both GPUs are fully shared out: the fifth client waits
    ray.kill(actors[0], no_restart=True)
    assert seen(fifth)["gpus"] == reports[0]["gpus"]  # and gets the share that freed up
    for a in [*actors[1:], fifth]:
        ray.kill(a, no_restart=True)


def test_a_whole_number_share_gives_one_client_several_gpus(cluster, monkeypatch):
    actor = start(resources(monkeypatch, 2), 1)[0]
    report = seen(actor)
    assert report["gpus"] == ["0", "1"] and report["visible"] == "0,1"
    ray.kill(actor, no_restart=True)


def test_no_share_leaves_the_client_on_cpu_with_every_gpu_visible(cluster, monkeypatch):
    actor = start(resources(monkeypatch, 0.0), 1)[0]
    report = seen(actor)
    assert report["gpus"] == [] and report["device"] == "cpu"
    assert report["visible"] is None  # RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=0: Ray does not hide the GPUs
    ray.kill(actor, no_restart=True)
