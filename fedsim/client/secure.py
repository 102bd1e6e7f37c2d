"""The client's side of secure aggregation: Flower's `secaggplus_mod`, and what fedsim adds around it.

`secure_aggregation_mod` is installed on the ClientApp's train handler. A message that is not a
SecAgg+ message (a plain round) passes straight through. A SecAgg+ message goes to Flower's own
mod unchanged; around it fedsim

- seeds numpy's global generator for the mod's stochastic rounding (Flower's `quantize` draws from
  `np.random`) with the seed the server put in the training config, so a run is reproducible, and
  restores the generator afterwards;
- times the mod's own work (key generation, Shamir shares, encryption, masking), leaving out the
  local training it calls, and reports the seconds in a `secagg-timing` MetricRecord (a
  measurement: not counted in the bytes);
- keeps an attacker's backdoor report (a measurement record the mod would clear with the
  update's arrays).

`clip_before_masking` is the norm clipping that survives secure aggregation: the client bounds
its own update before it is quantised and masked.
"""

from __future__ import annotations

import time

import numpy as np
import torch
from flwr.app import ArrayRecord, Message, MetricRecord

from fedsim.client.steps import attacking, describe, model_ranks, reply_records, train_delta
from fedsim.defenses.clipping import clip_rows
from fedsim.flower.compat import SECAGG_STAGES, is_legacy_fit_ins, legacy_fit_ins, legacy_fit_res, secaggplus_client_mod
from fedsim.flower.compat import secaggplus_record_key
from fedsim.secagg.config import SECAGG_TIMING
from fedsim.wire import BACKDOOR_RECORD, PayloadError


def model_from_arrays(arrays: list[np.ndarray], layout) -> torch.Tensor:
    """The flat global model from the legacy FitIns arrays (in the layout's order), checked."""
    if len(arrays) != len(layout.shapes):
        raise PayloadError(f"{len(arrays)} model arrays, the layout has {len(layout.shapes)}")
    parts = []
    for name, shape, arr in zip(layout.names, layout.shapes, arrays):
        if tuple(arr.shape) != tuple(shape):
            raise PayloadError(f"model array {name!r} has shape {arr.shape}, expected {shape}")
        parts.append(torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32)).reshape(-1))
    return torch.cat(parts)


def clip_before_masking(delta: torch.Tensor, sa, attacker: bool) -> torch.Tensor:
    """Δ · min(1, S / ‖Δ‖) with S = `secure_aggregation.clip_norm` (no clipping when unset). An attacker
    skips it when `clip_attackers` is false (it controls its own client code)."""
    if sa is None or sa.clip_norm is None or (attacker and not sa.clip_attackers):
        return delta
    return clip_rows(delta[None], sa.clip_norm)[0][0]  # the server's norm clipping, moved to the client


def secure_aggregation_mod(msg: Message, context, call_next) -> Message:
    """Flower's secaggplus_mod for SecAgg+ messages (see the module's docstring); others pass through."""
    key = secaggplus_record_key()
    if key not in msg.content.config_records:
        return call_next(msg, context)
    stage = str(msg.content.config_records[key].get("stage", ""))
    trained = [0.0]
    kept: dict[str, ArrayRecord] = {}

    def handler(inner: Message, ctx) -> Message:
        started = time.perf_counter()
        reply = call_next(inner, ctx)
        trained[0] = time.perf_counter() - started
        if BACKDOOR_RECORD in reply.content.array_records:  # copied: the mod clears the reply's arrays
            kept[BACKDOOR_RECORD] = ArrayRecord(array_dict=dict(reply.content.array_records[BACKDOOR_RECORD].items()))
        return reply

    saved = None
    if is_legacy_fit_ins(msg.content):
        seed = legacy_fit_ins(msg.content)[1].get("secagg-rounding-seed")
        if seed is not None:
            saved = np.random.get_state()
            np.random.seed(int(seed))
    started = time.perf_counter()
    try:
        reply = secaggplus_client_mod()(msg, context, handler)
    finally:
        if saved is not None:
            np.random.set_state(saved)
    seconds = time.perf_counter() - started - trained[0]
    for name, record in kept.items():
        reply.content.array_records[name] = record
    reply.content.metric_records[SECAGG_TIMING] = MetricRecord(
        {"seconds": seconds, "stage": SECAGG_STAGES.index(stage) if stage in SECAGG_STAGES else -1})
    return reply


def secure_train(call) -> tuple[Message, str]:
    """The secure protocols' client step (`secaggplus`, `lightsecagg`): train as under `plain`, clip
    before masking, and hand the dense update to the protocol's mod in Flower's legacy fit records
    (codecs are refused under secure aggregation: masks are added to the dense quantised update)."""
    rt = call.rt
    model_arrays, config = legacy_fit_ins(call.msg.content)
    layout = rt.layout_for(model_ranks(config))
    trained = train_delta(call, model_from_arrays(model_arrays, layout), config)
    delta = clip_before_masking(trained.delta, rt.scenario.secure_aggregation, attacking(rt, call.pid))
    trained.memory.keep(call.context, call.pid, int(config["server-round"]), call.state_dir,
                        trained.memory.codec_state(layout.dim), layout.dim)
    metrics = {"num-examples": int(trained.result.num_examples), "train-loss": float(trained.result.stats["loss"]),
               "partition-id": call.pid}
    content = reply_records(call, trained, legacy_fit_res([delta.numpy()], int(trained.result.num_examples), metrics))
    return Message(content, reply_to=call.msg), describe(call, trained)
