"""Where a run's tensors live (CPU or a CUDA GPU) and PyTorch's switches for reproducible runs.

The scenario names devices as strings (`auto`, `cpu`, `cuda`, `cuda:N`); `resolve_device` turns
one into a `torch.device` on the machine that runs it, with a clear error when that machine
cannot. The schema's checks at the top stay free of torch: the scenario module (and with it the
CLI's `list` and `check`) does not import torch, so the functions below import it when called.
See docs/gpu.md for what runs where.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from typing import Annotated

from pydantic import AfterValidator

DEVICE_CHOICES = "auto, cpu, cuda, cuda:N (N a device index)"
CUBLAS_DETERMINISTIC = ":4096:8"  # the workspace PyTorch documents for deterministic cuBLAS (":16:8" also works)


class DeviceError(ValueError):
    """A device setting this machine (or this torch build) cannot serve."""


# --- the scenario schema's checks (no torch) -----------------------------------------------------
def check_device_name(value: str) -> str:
    """A device name as the scenario writes it; anything else is refused naming the choices."""
    text = value.strip().lower()
    head, _, index = text.partition(":")
    if text in ("auto", "cpu", "cuda") or (head == "cuda" and index.isdigit() and index.isascii()):
        return text
    raise ValueError(f"unknown device; allowed: {DEVICE_CHOICES}")


def check_gpu_share(value: float) -> float:
    """Ray's rule for an actor's GPUs: a fraction of one GPU, or a whole number of them."""
    if value > 1 and value != int(value):
        raise ValueError("above 1 a client's GPU share must be a whole number of GPUs (Ray's rule); "
                         "below 1 it is a fraction of one GPU (0.25: four clients per GPU)")
    return value


DeviceName = Annotated[str, AfterValidator(check_device_name)]
GpuShare = Annotated[float, AfterValidator(check_gpu_share)]


# --- devices ----------------------------------------------------------------------------------------
def torch_build() -> str:
    """This torch build, for error messages: '2.13.0+cpu, CUDA none'."""
    import torch

    return f"{torch.__version__}, CUDA {torch.version.cuda or 'none'}"


def resolve_device(name: str, setting: str = "federation.device"):
    """`name` (auto, cpu, cuda, cuda:N) as a torch.device on this machine, with an index for CUDA.

    `auto` is CUDA when torch can use a GPU here, else CPU. `cuda` on a machine (or torch build)
    without CUDA is an error naming `setting`, never a silent fallback to CPU.
    """
    import torch

    text = check_device_name(str(name))  # also a torch.device
    if text == "cpu" or (text == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise DeviceError(f"{setting}={name} but torch.cuda.is_available() is False (this torch build: {torch_build()})")
    count = torch.cuda.device_count()
    index = int(text.partition(":")[2]) if ":" in text else torch.cuda.current_device()
    if index >= count:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise DeviceError(f"{setting}={name} but this process sees {count} CUDA device(s)"
                          + (f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""))
    return torch.device("cuda", index)


def ray_actor_gpus() -> list | None:
    """The GPU ids Ray assigned this process's actor, or None outside a Ray actor.

    Reads `sys.modules` rather than importing Ray: a device install has no Ray."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    context = ray.get_runtime_context()
    if context.get_actor_id() is None:  # a driver (the server), not an actor
        return None
    return list(context.get_accelerator_ids().get("GPU", []))


def client_device(federation):
    """Where this client trains: `federation.device`, with `auto` meaning CPU in a Ray actor that
    was given no GPU share (federation.client_gpus 0). fedsim sets RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=0,
    so such an actor still sees every GPU, and `auto` would put all clients on GPU 0 behind Ray's back."""
    import torch

    if federation.device == "auto" and ray_actor_gpus() == []:
        return torch.device("cpu")
    return resolve_device(federation.device, "federation.device")


def client_train_config(cfg, scenario, attacker: bool = False):
    """`cfg` (a fedsim.training.TrainConfig) with the scenario's device, precision and determinism.

    An attacker trains on CPU in fp32 (determinism as asked): the attacks' own code (PGD projection
    against the CPU global model, trigger optimisation, Chameleon's contrastive loop) builds CPU
    tensors beside the model and has not been made device-aware."""
    if attacker:
        return dataclasses.replace(cfg, device="cpu", precision="fp32", deterministic=scenario.deterministic)
    fed = scenario.federation
    return dataclasses.replace(cfg, device=str(client_device(fed)), precision=fed.precision,
                               deterministic=scenario.deterministic)


def check_simulation_gpus(scenario, attached: bool) -> None:
    """Refuse, before Ray starts, device settings the simulation cannot run.

    Flower sizes its actor pool from Ray's resources; one that comes out empty (a GPU share on a
    machine without GPUs) is an error there only after Ray has started. `attached`: the run joins
    an existing Ray cluster, whose nodes' GPUs this machine cannot see (Flower's check remains).
    The server's devices are checked too: in the simulation the server runs in this process."""
    resolve_device(scenario.server.device, "server.device")
    resolve_device(scenario.evaluation.device, "evaluation.device")
    federation = scenario.federation
    share, device = federation.client_gpus, federation.device
    if share == 0:
        if device.startswith("cuda"):
            raise DeviceError(f"federation.device={device} but federation.client_gpus=0: in the simulation a client "
                              "actor gets a GPU only through its share (e.g. federation.client_gpus=0.25: four clients "
                              "per GPU); set one, or federation.device=auto / cpu")
        return
    if attached:
        return
    import torch

    if not torch.cuda.is_available():
        raise DeviceError(f"federation.client_gpus={share} asks Ray for a GPU share per client, but "
                          f"torch.cuda.is_available() is False on this machine (this torch build: {torch_build()}); "
                          "set federation.client_gpus=0 or run where CUDA works")
    index = device.partition(":")[2]
    if index and int(index) >= max(1, int(share)):
        raise DeviceError(f"federation.device={device}: a client actor sees only the {max(1, int(share))} GPU(s) "
                          f"Ray assigns it (federation.client_gpus={share}), as cuda:0...; use cuda or auto")


# --- determinism ------------------------------------------------------------------------------------
def deterministic_switches_on() -> None:
    """The switches PyTorch documents for reproducible runs (notes/randomness.html), process-wide.

    CUBLAS_WORKSPACE_CONFIG is read when cuBLAS starts, so this must run before the process's
    first CUDA use; an existing value is kept (":16:8" is the other documented one)."""
    import torch

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_DETERMINISTIC)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


@contextlib.contextmanager
def deterministic_algorithms(enabled: bool):
    """With `enabled`, PyTorch's reproducibility switches are on while the block runs and put back
    as they were after it; without, nothing is touched."""
    if not enabled:
        yield
        return
    import torch

    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    deterministic_switches_on()
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[2], before[3]


def determinism_report(scenario) -> dict:
    """For summary.json: whether the run asked for determinism, and the switches as this process
    (the server's) has them now. Clients set the same switches around each local training."""
    import torch

    return {
        "requested": bool(scenario.deterministic),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "cudnn_deterministic": bool(torch.backends.cudnn.deterministic),
        "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
        "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    }
