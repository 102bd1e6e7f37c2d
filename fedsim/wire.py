"""What crosses the wire: packing the global model and client payloads into Flower records,
unpacking them on the other side as untrusted input, and measuring message sizes in bytes."""

from __future__ import annotations

from io import BytesIO
from itertools import islice
from math import prod

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, Message, RecordDict

from fedsim.compression.base import PayloadError, clip, excerpt
from fedsim.flower.compat import recorddict_size
from fedsim.models.layout import ModelLayout

MAX_PAYLOAD_FACTOR = 4  # a payload may be at most this many times the float32 model (plus 1 MiB)
MAX_EXAMPLES = 2**31 - 1  # an example count above this is not a client's dataset; float32 weights stay exact-ish and finite
F32_MAX = float(np.finfo(np.float32).max)
# An attacker's reports for the experimenter, beside its upload: not part of the protocol, so not counted in bytes
BACKDOOR_RECORD = "backdoor"  # the trigger it planted (ArrayRecord)
ATTACK_METRICS_RECORD = "attack-metrics"  # what its attack cost it, e.g. train-seconds (MetricRecord)
WORK_RECORD = "work"  # what a client's training processed: samples (MetricRecord), for the federation clock
MEASUREMENT_RECORDS = frozenset({BACKDOOR_RECORD, ATTACK_METRICS_RECORD, WORK_RECORD})
MAX_NORM = F32_MAX**0.5  # an update's L2 norm must stay below this: its float32 sum of squares is then finite


def pack_model(vec: torch.Tensor, layout: ModelLayout) -> ArrayRecord:
    """The global model as named arrays (a torch state dict's names and shapes)."""
    return ArrayRecord(array_dict={n: Array(t.numpy()) for n, t in layout.unflatten(vec).items()})


def unpack_model(record: ArrayRecord, layout: ModelLayout) -> torch.Tensor:
    """The flat vector of a received model record, checked against the layout."""
    if list(record.keys()) != list(layout.names):
        raise PayloadError(f"model arrays {list(record.keys())} do not match the layout {list(layout.names)}")
    parts = []
    for name, shape in zip(layout.names, layout.shapes):
        arr = record[name].numpy()
        if arr.shape != shape:
            raise PayloadError(f"model array {name!r} has shape {arr.shape}, expected {shape}")
        parts.append(torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32)).reshape(-1))
    return torch.cat(parts)


def pack_payload(payload: dict[str, np.ndarray]) -> ArrayRecord:
    return ArrayRecord(array_dict={k: Array(np.ascontiguousarray(v)) for k, v in payload.items()})


def max_payload_bytes(layout: ModelLayout) -> int:
    """The most bytes of array data a client's payload (an upload or a backdoor report) may carry for
    this model: `MAX_PAYLOAD_FACTOR` times the float32 model, plus 1 MiB."""
    return MAX_PAYLOAD_FACTOR * 4 * layout.dim + (1 << 20)


def unpack_payload(record: ArrayRecord, layout: ModelLayout) -> dict[str, np.ndarray]:
    """A client's payload arrays, refusing oversized ones before deserialising anything."""
    limit = max_payload_bytes(layout)
    size = sum(len(a.data) for a in record.values())
    if size > limit:
        raise PayloadError(f"payload of {size} bytes exceeds the limit of {limit} bytes for this model")
    out = {}
    for key, arr in record.items():
        claimed = npy_nbytes(arr.data)
        if claimed is not None and claimed > len(arr.data):  # np.load would allocate the claim first
            raise PayloadError(f"payload array {excerpt(key)} claims {claimed} bytes of data but carries {len(arr.data)}")
        try:
            out[key] = arr.numpy()
        except Exception as err:  # truncated or non-numpy bytes
            raise PayloadError(f"payload array {excerpt(key)} does not deserialise: {error_text(err)}") from None
    return out


def npy_nbytes(data: bytes) -> int | None:
    """The data size an .npy header claims (shape x itemsize), or None when the header does not parse
    (np.load then rejects it itself). Read before np.load, which allocates the claimed array up front."""
    try:
        buf = BytesIO(data)
        version = np.lib.format.read_magic(buf)
        shape, _, dtype = (np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0)(buf)
        return prod(shape) * dtype.itemsize
    except Exception:
        return None


def decode_upload(content, codec, layout: ModelLayout) -> tuple[torch.Tensor, float, float]:
    """A reply's (update, example count, training loss), every part checked; PayloadError says why not."""
    try:
        if "update" not in content.array_records or "metrics" not in content.metric_records:
            raise PayloadError("reply needs an 'update' ArrayRecord and a 'metrics' MetricRecord")
        weight = check_count(content["metrics"].get("num-examples"), "num-examples")
        loss = check_loss(content["metrics"].get("train-loss"))
        update = codec.decode(unpack_payload(content["update"], layout), layout)
    except PayloadError:
        raise
    except Exception as err:  # malformed records from an untrusted client: never a traceback
        raise PayloadError(f"malformed reply: {error_text(err)}") from None
    if update.shape != (layout.dim,) or update.dtype != torch.float32:
        raise PayloadError(f"decoded update has shape {tuple(update.shape)} / {update.dtype}, expected ({layout.dim},) / torch.float32")
    finite = torch.isfinite(update)
    if not finite.all():
        bad = (~finite).nonzero()[:, 0]
        raise PayloadError(f"update has {bad.numel()} NaN/Inf entries (first at index {int(bad[0])}: {float(update[bad[0]])})")
    # Finite entries whose float32 sum of squares overflows (norm above MAX_NORM): every norm and
    # distance the defenses and aggregators compute would be inf, so the update is refused here.
    if not torch.isfinite(torch.linalg.vector_norm(update)):
        raise PayloadError(f"update L2 norm overflows float32: sum of squares above {F32_MAX:.4g} (allowed norm < {MAX_NORM:.4g}), "
                           f"largest |entry| {float(update.abs().max()):.4g}")
    return update, weight, loss


def is_number(value) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))


def check_count(value, what: str) -> float:
    """An example count: a number in [0, MAX_EXAMPLES] (NaN, inf, 1e39 and 10**30 are not), as a float."""
    if not is_number(value) or not 0 <= value <= MAX_EXAMPLES:  # compared before float(): 10**400 cannot overflow
        raise PayloadError(f"{what} must be a count in [0, {MAX_EXAMPLES}], got {excerpt(value)}")
    return float(value)


def check_loss(value) -> float:
    """The reported training loss: absent or NaN (not measured, e.g. no local steps) reads as NaN;
    anything else must be a number of magnitude <= float32 max, so the round's mean stays finite."""
    if value is None:
        return float("nan")
    if is_number(value) and value != value:  # NaN
        return float("nan")
    if not is_number(value) or not -F32_MAX <= value <= F32_MAX:
        raise PayloadError(f"train-loss must be a number in [-{F32_MAX:.4g}, {F32_MAX:.4g}] (or NaN), got {excerpt(value)}")
    return float(value)


def error_text(err: BaseException) -> str:
    """An exception raised by untrusted input, for a rejection reason: its type and bounded message."""
    return f"{type(err).__name__}: {clip(str(err))}"


def records_bytes(records: dict) -> int:
    """Serialized size of a RecordDict holding `records`; sizes of disjoint record sets add up exactly
    (each record is its own protobuf map entry), so a shared model record is sized once per round."""
    return recorddict_size(RecordDict(records))


def message_bytes(msg: Message) -> int:
    """Serialized size of the message's content (its RecordDict protobuf): the payload it carries.

    Flower's per-message metadata (ids, timestamps, ~100 bytes) is left out: it varies run to run
    with the random node ids and says nothing about the algorithm. A reply that cannot be
    serialized (in simulation nothing serializes replies on the way, so e.g. an integer metric
    outside int64 arrives as is) could not have crossed a real wire: PayloadError, naming the
    record and key the serializer refused. The strategies then count 0 bytes for that reply (the
    client is absent from `bytes_up_per_client`, like a client whose reply is an error).
    An attacker's reports to the experimenter (`MEASUREMENT_RECORDS`) are not part of the protocol
    and are left out.
    """
    try:
        return recorddict_size(RecordDict({k: v for k, v in msg.content.items() if k not in MEASUREMENT_RECORDS}))
    except Exception as err:  # whatever the content holds, sizing it never takes the round down
        raise PayloadError(f"reply does not serialize: {unserializable_entry(msg.content)}{error_text(err)}") from None


def shared_backdoor_state(content, layout: ModelLayout) -> dict[str, np.ndarray] | None:
    """An attacker's report for the backdoor measurement (a trigger it optimised), or None when the
    reply carries none; bounded like an upload (PayloadError when oversized or malformed)."""
    if BACKDOOR_RECORD not in content.array_records:
        return None
    try:
        return unpack_payload(content[BACKDOOR_RECORD], layout)
    except PayloadError:
        raise
    except Exception as err:
        raise PayloadError(f"malformed backdoor report: {error_text(err)}") from None


def attacker_train_seconds(content) -> float | None:
    """The training seconds an attacker reported beside its upload, or None (not reported, or not a number)."""
    if ATTACK_METRICS_RECORD not in content.metric_records:
        return None
    value = content[ATTACK_METRICS_RECORD].get("train-seconds")
    return float(value) if is_number(value) and 0 <= value < 1e9 else None


def trained_samples(content) -> int | None:
    """The samples a client reported training on (forward and backward passes), or None (not
    reported, or not a sane count): the simulated clock's compute time is proportional to it."""
    if WORK_RECORD not in content.metric_records:
        return None
    value = content[WORK_RECORD].get("samples")
    return int(value) if is_number(value) and 0 <= value < 1e15 and float(value).is_integer() else None


def unserializable_entry(content, limit: int = 1000) -> str:
    """The prefix "record['key'] = value: " naming the first entry the serializer refuses, found by
    sizing the records and then that record's entries one at a time (only once the whole content
    has failed; at most `limit` of each are tried); "" when no single entry fails on its own."""
    try:
        for name, record in islice(content.items(), limit):
            if _sizes(RecordDict({name: record})):
                continue
            for key in islice(record.keys(), limit):
                if not _sizes(RecordDict({name: type(record)({key: record[key]})})):
                    return f"{clip(name)}[{excerpt(key)}] = {excerpt(record[key])}: "
            return f"{clip(name)}: "
    except Exception:  # content that is not a RecordDict of records at all
        pass
    return ""


def _sizes(content: RecordDict) -> bool:
    try:
        recorddict_size(content)
        return True
    except Exception:
        return False
