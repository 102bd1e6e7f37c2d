"""Hundreds of malformed uploads thrown at real rounds: every one is rejected with a reason, the
run never crashes, and the honest uploads are still aggregated."""

from __future__ import annotations

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from conftest import run_local
from fedsim.scenario import load_scenario

D = 4810  # the quickstart MLP


def malformed(rng: np.random.Generator, good: RecordDict) -> RecordDict:
    """One of many ways an untrusted client can break an upload."""
    delta = good["update"]["delta"].numpy()
    metrics = good["metrics"]
    kind = int(rng.integers(0, 14))
    if kind == 0:
        bad = delta.copy(); bad[rng.integers(0, D)] = np.nan  # noqa: E702
        return RecordDict({"update": ArrayRecord(array_dict={"delta": Array(bad)}), "metrics": metrics})
    if kind == 1:
        bad = delta.copy(); bad[rng.integers(0, D)] = np.inf  # noqa: E702
        return RecordDict({"update": ArrayRecord(array_dict={"delta": Array(bad)}), "metrics": metrics})
    if kind == 2:  # wrong length
        return RecordDict({"update": ArrayRecord(array_dict={"delta": Array(delta[: rng.integers(0, D)])}), "metrics": metrics})
    if kind == 3:  # wrong dtype
        return RecordDict({"update": ArrayRecord(array_dict={"delta": Array(delta.astype(np.float64))}), "metrics": metrics})
    if kind == 4:  # wrong shape
        return RecordDict({"update": ArrayRecord(array_dict={"delta": Array(delta.reshape(74, 65))}), "metrics": metrics})
    if kind == 5:  # truncated bytes
        arr = good["update"]["delta"]
        cut = Array(dtype=arr.dtype, shape=arr.shape, stype=arr.stype, data=arr.data[: int(rng.integers(0, len(arr.data)))])
        return RecordDict({"update": ArrayRecord(array_dict={"delta": cut}), "metrics": metrics})
    if kind == 6:  # random bytes claiming to be numpy
        junk = Array(dtype="float32", shape=(D,), stype="numpy.ndarray", data=rng.bytes(int(rng.integers(1, 5000))))
        return RecordDict({"update": ArrayRecord(array_dict={"delta": junk}), "metrics": metrics})
    if kind == 7:  # oversized payload
        return RecordDict({"update": ArrayRecord(array_dict={"delta": Array(np.zeros(20 * D, np.float32))}), "metrics": metrics})
    if kind == 8:  # missing array / wrong name
        return RecordDict({"update": ArrayRecord(array_dict={"other": Array(delta)}), "metrics": metrics})
    if kind == 9:  # no update record at all
        return RecordDict({"metrics": metrics})
    if kind == 10:  # no metrics
        return RecordDict({"update": good["update"]})
    if kind == 11:  # negative / NaN / missing example count
        value = [-5, float("nan"), float("inf")][int(rng.integers(0, 3))]
        return RecordDict({"update": good["update"], "metrics": MetricRecord({"num-examples": value})})
    if kind == 12:
        return RecordDict({"update": good["update"], "metrics": MetricRecord({"loss": 1.0})})
    # an update sent as a config record instead of arrays
    return RecordDict({"update": ConfigRecord({"delta": "nope"}), "metrics": metrics})


def test_hundreds_of_malformed_uploads_never_crash_a_run(tmp_path):
    scenario = load_scenario("scenarios/quickstart.yaml", [
        "federation.rounds=10", "federation.num_clients=30", "federation.clients_per_round=30", "attack=null",
    ])
    rng = np.random.default_rng(0)
    honest = {0, 1, 2, 3, 4}  # these always upload correctly

    def tamper(pid, reply):
        if pid in honest:
            return reply
        reply.content = malformed(rng, reply.content)
        return reply

    result = run_local(scenario, tmp_path, tamper=tamper)  # 30 nodes, one per client
    summary, rounds = result.summary, result.rounds
    assert summary["rounds_completed"] == 10
    rejected = sum(len(r["rejected"]) for r in rounds)
    assert rejected == 10 * 25  # 250 malformed uploads, every one rejected
    assert all(r["aggregated"] == sorted(honest) for r in rounds)
    assert all(isinstance(reason, str) and reason for r in rounds for reason in r["rejected"].values())
    assert summary["final_main_accuracy"] > 0.5


# --- property-based: every codec's decode path against hostile replies --------------------------
import io  # noqa: E402
from collections import Counter  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fedsim.compression.base import PayloadError  # noqa: E402
from fedsim.registry import COMPRESSORS  # noqa: E402
from fedsim.wire import MAX_EXAMPLES, decode_upload, message_bytes, pack_payload  # noqa: E402

CODECS = COMPRESSORS.names()
HUGE = [np.inf, -np.inf, np.nan, 3.4e38, -3.4e38, 1e30, 0.0]


def codec_and_layout(name: str):
    """The quickstart's layout (4,810 parameters) with `name`'s codec at its defaults, min_size low
    enough that every weight matrix is compressed."""
    from fedsim.runtime import runtime_for

    spec = {"name": name} if name in ("none",) else {"name": name, "min_size": 64}
    scenario = load_scenario("scenarios/quickstart.yaml", [f"compression={spec}", "attack=null"])
    rt = runtime_for(scenario)
    return rt.codec, rt.layout_for(None)


@pytest.fixture(scope="module")
def valid_payloads():
    """A real encoded upload per codec (arrays), from a seeded random delta."""
    out = {}
    for name in CODECS:
        codec, layout = codec_and_layout(name)
        delta = torch.randn(layout.dim, generator=torch.Generator().manual_seed(0)) * 0.01
        payload, _ = codec.encode(delta, layout, {})
        out[name] = (codec, layout, payload)
    return out


def mutate(draw, payload: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """One hostile edit of a valid payload's arrays: the ways an untrusted client can lie."""
    payload = dict(payload)
    if not payload:  # earlier edits dropped every array
        return {draw(NAMES): np.zeros(draw(st.integers(0, 50)), np.float32)}
    key = draw(st.sampled_from(sorted(payload)))
    arr = payload[key]
    kind = draw(st.sampled_from(["drop", "extra", "truncate", "grow", "dtype", "rank", "random", "values", "ints"]))
    if kind == "drop":
        del payload[key]
    elif kind == "extra":
        payload[draw(NAMES)] = np.zeros(draw(st.integers(0, 50)), np.float32)
    elif kind == "truncate" and arr.size:
        payload[key] = arr.reshape(-1)[: draw(st.integers(0, arr.size - 1))]
    elif kind == "grow":
        payload[key] = np.concatenate([arr.reshape(-1), arr.reshape(-1)[: draw(st.integers(1, 64))]])
    elif kind == "dtype":
        to = draw(st.sampled_from(["float64", "float16", "int8", "int16", "int32", "int64", "uint8", "uint64", "bool"]))
        with np.errstate(all="ignore"):
            payload[key] = arr.astype(to)
    elif kind == "rank":
        payload[key] = arr.reshape(1, -1) if arr.ndim == 1 else arr.reshape(-1)
    elif kind == "random":  # the right dtype and size, arbitrary bytes
        nbytes = arr.dtype.itemsize * arr.size
        payload[key] = np.frombuffer(draw(st.binary(min_size=nbytes, max_size=nbytes)), arr.dtype).reshape(arr.shape)
    elif kind == "values" and arr.size and arr.dtype.kind == "f":
        bad = arr.copy()
        idx = draw(st.lists(st.integers(0, arr.size - 1), min_size=1, max_size=5))
        with np.errstate(all="ignore"):
            bad.reshape(-1)[idx] = draw(st.sampled_from(HUGE))
        payload[key] = bad
    elif kind == "ints" and arr.size and arr.dtype.kind in "iu":
        bad = arr.copy()
        info = np.iinfo(arr.dtype)
        idx = draw(st.lists(st.integers(0, arr.size - 1), min_size=1, max_size=5))
        bad.reshape(-1)[idx] = draw(st.sampled_from([info.min, info.max, 0, -1 if info.min < 0 else 1]))
        payload[key] = bad
    return payload


NPY_DTYPES = ["<f4", ">f4", "<f8", "<f2", "|u1", "|i1", "<i2", "<u2", "<i4", "<i8", "<u8", "|b1", "<c8", "|V0", "|V3",
              "<U2", "|S0", "|O", "<M8[s]"]


def mutate_bytes(draw, record: ArrayRecord) -> ArrayRecord:
    """One hostile edit of the serialized arrays as they travel (.npy bytes and Array metadata):
    cut short, replaced by junk, header bytes overwritten, a forged header of any dtype, shape
    (huge claims included), order and format version, an unknown stype, or lying metadata."""
    arrays = dict(record.items())
    if not arrays:
        return record
    key = draw(st.sampled_from(sorted(arrays)))
    a = arrays[key]
    dtype, shape, stype, data = a.dtype, a.shape, a.stype, a.data
    kind = draw(st.sampled_from(["cut", "junk", "header bytes", "forged header", "stype", "metadata"]))
    if kind == "cut":
        data = data[: draw(st.integers(0, max(len(data) - 1, 0)))]
    elif kind == "junk":
        data = draw(st.binary(max_size=300))
    elif kind == "header bytes" and data:
        buf = bytearray(data)
        for i in draw(st.lists(st.integers(0, min(len(buf), 140) - 1), min_size=1, max_size=4)):
            buf[i] = draw(st.integers(0, 255))
        data = bytes(buf)
    elif kind == "forged header":
        claim = draw(st.lists(st.one_of(st.integers(0, 70), st.sampled_from([2**31, 2**62, 10**20])), max_size=3))
        header = {"descr": draw(st.sampled_from(NPY_DTYPES)), "fortran_order": draw(st.booleans()), "shape": tuple(claim)}
        head = io.BytesIO()
        try:
            np.lib.format._write_array_header(head, header, draw(st.sampled_from([(1, 0), (2, 0), (3, 0)])))
        except Exception:  # numpy will not even write this header (e.g. 10**20 overflows its size)
            return record
        data = head.getvalue() + draw(st.binary(max_size=600))
    elif kind == "stype":
        stype = draw(st.text(max_size=12))
    elif kind == "metadata":  # dtype and shape are what the protobuf carries beside the bytes
        dtype = draw(st.text(max_size=5))
        shape = tuple(draw(st.lists(st.integers(-(2**40), 2**40), max_size=3)))
    arrays[key] = Array(dtype=dtype, shape=shape, stype=stype, data=data)
    return ArrayRecord(array_dict=arrays)


NAMES = st.one_of(st.text(min_size=1, max_size=8), st.just("k" * 5000))  # a key as long as a client likes
LOSSES = st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True, width=64),
                   st.sampled_from([1e39, -1e39, 3.4e38, float("inf"), float("-inf"), 10**30, -(2**63)]))
COUNTS = st.one_of(st.integers(0, 1000), st.sampled_from([-1, 10**30, 2**63 - 1, 2**31, MAX_EXAMPLES]),
                   st.sampled_from([1e39, float("nan"), float("inf"), 0.5, -0.0]), st.integers(-(2**70), 2**70))
METRIC_VALUES = st.one_of(LOSSES.filter(lambda v: v is not None), st.lists(st.integers(-(2**70), 2**70), max_size=3),
                          st.lists(st.floats(), max_size=3))
REPLY_SHAPES = ["as sent", "update as a ConfigRecord", "metrics as a ConfigRecord", "no update", "no metrics", "extra record"]
F32_MAX = float(np.finfo(np.float32).max)
MAX_REASON = 400  # characters: a rejection names what was wrong with bounded excerpts of what was sent


def hostile_reply(draw, payload: dict[str, np.ndarray]) -> RecordDict:
    """A reply built from a valid payload by hostile edits at every layer a client controls: the
    arrays (0-3 edits), their serialized bytes (0-2), the metrics, and the records around them."""
    for _ in range(draw(st.integers(0, 3))):
        payload = mutate(draw, payload)
    update = pack_payload(payload)
    for _ in range(draw(st.integers(0, 2))):
        update = mutate_bytes(draw, update)
    if draw(st.integers(0, 2)) == 0:  # hostile metrics in one reply of three, so most reach the codec
        loss = draw(LOSSES)
        metrics = {"num-examples": draw(COUNTS)} | ({} if loss is None else {"train-loss": loss})
        if draw(st.booleans()):
            metrics[draw(NAMES)] = draw(METRIC_VALUES)
    else:
        metrics = {"num-examples": draw(st.integers(0, 1000)), "train-loss": draw(st.floats(0, 10))}
    records = {"update": update, "metrics": MetricRecord(metrics)}
    shape = draw(st.sampled_from(["as sent"] * 15 + REPLY_SHAPES[1:]))  # a broken record layout in one reply of four
    if shape == "update as a ConfigRecord":
        records["update"] = ConfigRecord({"delta": draw(st.binary(max_size=64))})
    elif shape == "metrics as a ConfigRecord":
        records["metrics"] = ConfigRecord(metrics)
    elif shape.startswith("no "):
        del records[shape[3:]]
    elif shape == "extra record":
        records[draw(NAMES)] = ArrayRecord(array_dict={"x": Array(np.zeros(3, np.float32))})
    return RecordDict(records)


def honest_reply(draw, payload: dict[str, np.ndarray]) -> RecordDict:
    """The reply an honest client sends: the valid payload as encoded, an example count and a loss in range."""
    metrics = {"num-examples": draw(st.integers(0, 1000)), "train-loss": draw(st.floats(0, 10))}
    return RecordDict({"update": pack_payload(payload), "metrics": MetricRecord(metrics)})


def check_reply(codec, layout, content: RecordDict) -> bool:
    """Size and decode a reply as the server does: a clean rejection (PayloadError with a short
    reason) or a finite, right-sized update with a bounded weight and loss. Nothing else may come out.
    True when it decoded."""
    from types import SimpleNamespace

    try:
        message_bytes(SimpleNamespace(content=content))  # only the content is sized
        update, weight, got_loss = decode_upload(content, codec, layout)
    except PayloadError as err:
        assert 0 < len(str(err)) <= MAX_REASON, str(err)[:2 * MAX_REASON]
        return False
    assert update.shape == (layout.dim,) and update.dtype == torch.float32 and torch.isfinite(update).all()
    assert torch.isfinite(torch.linalg.vector_norm(update)) and 0 <= weight <= MAX_EXAMPLES
    assert np.isfinite(np.float32(weight)) and isinstance(weight, float)
    assert got_loss != got_loss or abs(got_loss) <= F32_MAX  # NaN (not reported) or a bounded number
    return True


def fuzz_decode(valid_payloads, name: str, budget: settings) -> Counter:
    """`budget`'s examples against one codec's decode path, each a hostile reply and an honest one
    built from the same valid payload; counts the replies that decoded. Every honest reply is valid,
    so at least half the replies must decode: a decode path that rejected everything, which
    check_reply alone would pass as clean rejections, fails the tests' floor."""
    codec, layout, payload = valid_payloads[name]
    outcomes: Counter = Counter()

    @budget
    @given(data=st.data())
    def replies(data):
        hostile = check_reply(codec, layout, hostile_reply(data.draw, payload))
        honest = check_reply(codec, layout, honest_reply(data.draw, payload))
        outcomes.update({"examples": 1, "decoded": hostile + honest, "honest decoded": honest})

    replies()
    return outcomes


# Example budgets: 100 per codec (9 codecs, 900 hostile replies and as many honest ones, ~13 s on 2 cores) in the
# default run; 1,500 per codec (13,500 hostile replies, the size of the fuzzing campaign of issue #16) in the slow step.
FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
FUZZ_SLOW = settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.mark.parametrize("name", CODECS)
def test_hostile_replies_are_decoded_or_cleanly_rejected(valid_payloads, name):
    outcomes = fuzz_decode(valid_payloads, name, FUZZ)
    assert outcomes["examples"] >= FUZZ.max_examples, outcomes
    assert outcomes["decoded"] >= outcomes["honest decoded"] == outcomes["examples"], outcomes  # the floor


@pytest.mark.slow
@pytest.mark.parametrize("name", CODECS)
def test_hostile_replies_many(valid_payloads, name):
    outcomes = fuzz_decode(valid_payloads, name, FUZZ_SLOW)
    assert outcomes["examples"] >= FUZZ_SLOW.max_examples, outcomes
    assert outcomes["decoded"] >= outcomes["honest decoded"] == outcomes["examples"], outcomes  # the floor


@pytest.mark.parametrize("loss", [float("inf"), float("-inf"), 1e39, -1e39, 10**39, [0.5]],
                         ids=["inf", "-inf", "1e39", "-1e39", "10**39", "list"])
def test_absurd_train_loss_is_rejected(valid_payloads, loss):
    """An infinite or float32-overflowing loss was accepted and made the round's train_loss inf."""
    codec, layout, payload = valid_payloads["none"]
    content = RecordDict({"update": pack_payload(payload), "metrics": MetricRecord({"num-examples": 5, "train-loss": loss})})
    with pytest.raises(PayloadError, match=r"train-loss must be a number in \[-3.403e\+38, 3.403e\+38\] \(or NaN\), got"):
        decode_upload(content, codec, layout)


@pytest.mark.parametrize("loss", [None, float("nan"), 0.0, 2.5, 3.4e38])
def test_reported_loss_kept_missing_or_nan_is_nan(valid_payloads, loss):
    codec, layout, payload = valid_payloads["none"]
    metrics = {"num-examples": 5} | ({} if loss is None else {"train-loss": loss})
    _, weight, got = decode_upload(RecordDict({"update": pack_payload(payload), "metrics": MetricRecord(metrics)}), codec, layout)
    assert weight == 5.0 and (got == loss if loss == loss and loss is not None else got != got)


@pytest.mark.parametrize("count", [10**400, 2**31, 1e39, float("nan"), -1, [1, 2]],
                         ids=["10**400", "2**31", "1e39", "nan", "-1", "list"])
def test_bad_example_counts_name_the_field_and_range(valid_payloads, count):
    """10**400 overflowed float() and a list was a TypeError: both surfaced as a bare "malformed reply"."""
    codec, layout, payload = valid_payloads["none"]
    metrics = MetricRecord({"num-examples": count})  # as it arrives in simulation, unserialized
    with pytest.raises(PayloadError, match=rf"num-examples must be a count in \[0, {MAX_EXAMPLES}\], got"):
        decode_upload(RecordDict({"update": pack_payload(payload), "metrics": metrics}), codec, layout)


@pytest.mark.parametrize("name", ["topk", "accordion"])
def test_repeated_sparse_index_is_rejected(valid_payloads, name):
    """A top-k payload naming one index twice decoded silently (the scatter's last write won)."""
    codec, layout, payload = valid_payloads[name]
    if name == "accordion":  # the top-k flavour of Accordion
        codec, layout = codec_and_layout("accordion")
        codec.params = codec.params.model_copy(update={"codec": "topk"})
        payload, _ = codec.encode(torch.randn(layout.dim) * 0.01, layout, {})
    key = next(k for k in payload if k.endswith(".i"))
    payload = dict(payload)
    payload[key] = payload[key].copy()
    payload[key][1] = payload[key][0]
    content = RecordDict({"update": pack_payload(payload), "metrics": MetricRecord({"num-examples": 5})})
    with pytest.raises(PayloadError, match=rf"indices must be distinct, {int(payload[key][0])} repeats"):
        decode_upload(content, codec, layout)


def test_npy_header_claiming_a_huge_array_is_refused_before_allocating(valid_payloads):
    """np.load allocates the array its header claims before reading the data: 20 bytes of payload
    claiming 1 GiB made the server allocate 1 GiB per upload."""
    import io
    import tracemalloc

    codec, layout, _ = valid_payloads["none"]
    head = io.BytesIO()
    np.lib.format.write_array_header_1_0(head, {"descr": "<f4", "fortran_order": False, "shape": (2**28,)})
    lie = Array(dtype="float32", shape=(2**28,), stype="numpy.ndarray", data=head.getvalue() + bytes(20))
    content = RecordDict({"update": ArrayRecord(array_dict={"delta": lie}), "metrics": MetricRecord({"num-examples": 5})})
    tracemalloc.start()
    try:
        with pytest.raises(PayloadError, match="claims 1073741824 bytes of data but carries"):
            decode_upload(content, codec, layout)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20


def test_any_exception_inside_a_codec_is_a_rejection_with_its_type():
    """Only KeyError/TypeError/ValueError/OverflowError were caught: anything else escaped decode_upload."""
    codec, layout = codec_and_layout("none")

    class Broken(type(codec)):
        def decode(self, payload, layout):
            raise RuntimeError("shape '[64, 64]' is invalid for input of size 3")

    content = RecordDict({"update": pack_payload({"delta": np.zeros(layout.dim, np.float32)}),
                          "metrics": MetricRecord({"num-examples": 5})})
    with pytest.raises(PayloadError, match="malformed reply: RuntimeError: .*is invalid for input"):
        decode_upload(content, Broken(codec.params), layout)


def test_qsgd_minimum_int_level_is_rejected():
    """int16 -32768 passed the |level| <= s check (np.abs wraps around) and decoded 33x its bucket norm."""
    codec, layout = codec_and_layout("qsgd")
    codec.params = codec.params.model_copy(update={"levels": 1000})
    payload, _ = codec.encode(torch.randn(layout.dim) * 0.01, layout, {})
    q = next(k for k in payload if k.endswith(".q"))
    payload[q] = payload[q].copy()
    payload[q][0] = np.int16(-32768)
    with pytest.raises(PayloadError, match="level outside"):
        decode_upload(RecordDict({"update": pack_payload(payload), "metrics": MetricRecord({"num-examples": 5})}),
                      codec, layout)


def _reply(payload, metrics=None) -> RecordDict:
    return RecordDict({"update": pack_payload(payload), "metrics": MetricRecord(metrics or {"num-examples": 5})})


@pytest.mark.parametrize("content, where", [
    (lambda p: _reply(p, {"num-examples": 10**30}), r"metrics\['num-examples'\] = 1000000000000000000000000000000: "),
    (lambda p: _reply(p, {"num-examples": 5, "seen": [1, -(2**63) - 1]}), r"metrics\['seen'\] = \[1, -9223372036854775809\]: "),
    (lambda p: RecordDict({"update": ArrayRecord(array_dict={"delta": Array(dtype="float32", shape=(2**40,), stype="numpy.ndarray",
                                                                             data=b"")}), "metrics": MetricRecord({"num-examples": 5})}),
     r"update\['delta'\] = Array\(dtype='float32', shape=\(1099511627776,\)"),
], ids=["count-10**30", "metric-list", "array-shape"])
def test_a_reply_that_does_not_serialize_names_the_record_and_key(valid_payloads, content, where):
    """The serializer's refusal was the whole reason ("ValueError: ValueError('Value out of range:
    1000...')"): now it names the record and key the serializer refused, with the value sent."""
    from types import SimpleNamespace

    with pytest.raises(PayloadError, match=rf"^reply does not serialize: {where}.*ValueError: Value out of range"):
        message_bytes(SimpleNamespace(content=content(valid_payloads["none"][2])))


LONG = "k" * 100_000


@pytest.mark.parametrize("name, edit, start", [
    ("topk", lambda p: p | {LONG: np.zeros(3, np.float32)}, "payload has unexpected arrays ['kkk"),
    ("none", lambda p: {LONG: p["delta"]}, "payload lacks array 'delta' (has ['kkk"),
    ("none", lambda p: p | {LONG: np.zeros(3, np.int64)}, "payload has unexpected arrays"),
    ("none", lambda p: {LONG: b"junk"}, "payload array 'kkk"),
], ids=["extra-array", "missing-array", "extra-next-to-delta", "undecodable-array"])
def test_client_chosen_names_keep_the_reason_short(valid_payloads, name, edit, start):
    """A 100,000-character array name went verbatim into the rejection reason (rounds.jsonl, the
    log), once per round; every name and value a client chooses is now an excerpt. (The uncompressed
    codec also took arrays beside "delta" silently; it refuses them now, as every other codec does.)"""
    codec, layout, payload = valid_payloads[name]
    payload = edit(dict(payload))
    if any(isinstance(v, bytes) for v in payload.values()):  # bytes that are not an .npy file
        update = ArrayRecord(array_dict={k: Array(dtype="float32", shape=(1,), stype="numpy.ndarray", data=v) for k, v in payload.items()})
        content = RecordDict({"update": update, "metrics": MetricRecord({"num-examples": 5})})
    else:
        content = _reply(payload)
    with pytest.raises(PayloadError) as err:
        decode_upload(content, codec, layout)
    assert str(err.value).startswith(start) and len(str(err.value)) <= MAX_REASON


def test_update_rejections_say_where_and_how_much(valid_payloads):
    """The reasons "update contains NaN or Inf" and "update norm overflows float32" said neither
    where nor how much; the norm bound is now stated and is the real one: sqrt(float32 max) ~ 1.845e19."""
    from fedsim.wire import MAX_NORM

    codec, layout, payload = valid_payloads["none"]
    delta = payload["delta"].copy()
    delta[[17, 40]] = [np.nan, -np.inf]
    with pytest.raises(PayloadError, match=r"^update has 2 NaN/Inf entries \(first at index 17: nan\)$"):
        decode_upload(_reply({"delta": delta}), codec, layout)
    spread = np.full(layout.dim, 1e18, np.float32)  # norm 6.9e19: sum of squares 4.8e39
    with pytest.raises(PayloadError, match=r"L2 norm overflows float32: .*\(allowed norm < 1.845e\+19\), largest \|entry\| 1e\+18$"):
        decode_upload(_reply({"delta": spread}), codec, layout)
    under, over = np.zeros(layout.dim, np.float32), np.zeros(layout.dim, np.float32)
    under[0], over[0] = np.float32(MAX_NORM * 0.99), np.float32(MAX_NORM * 1.01)
    assert float(decode_upload(_reply({"delta": under}), codec, layout)[0][0]) == float(under[0])
    with pytest.raises(PayloadError, match="L2 norm overflows float32"):
        decode_upload(_reply({"delta": over}), codec, layout)


@pytest.mark.parametrize("count", [10**30, 1e39, 2**31, -1])
def test_absurd_example_counts_reject_one_client_and_the_round_goes_on(tmp_path, count):
    """10**30 crashed the run (Flower's serializer, outside the decode's try); 1e39 (finite in
    float64, inf in float32) turned every FedAvg weight into inf and every round was skipped."""
    scenario = load_scenario("scenarios/quickstart.yaml", ["federation.rounds=2", "federation.num_clients=5",
                                                           "federation.clients_per_round=5", "attack=null"])

    def tamper(pid, reply):
        if pid == 3:
            reply.content["metrics"]["num-examples"] = count
        return reply

    rounds = run_local(scenario, tmp_path, tamper=tamper).rounds
    reason = (f"reply does not serialize: metrics['num-examples'] = {count}: ValueError: Value out of range" if count == 10**30
              else f"num-examples must be a count in [0, {MAX_EXAMPLES}], got {count!r}")
    assert all(r["rejected"]["3"].startswith(reason) and r["aggregated"] == [0, 1, 2, 4] and not r["skipped"] for r in rounds)
    sized = [("3" in r["bytes_up_per_client"]) for r in rounds]  # a reply that does not serialize counts 0 bytes
    assert sized == [count != 10**30] * len(rounds)


def test_fedma_upload_with_overflowing_norm_or_infinite_loss_is_rejected(tmp_path):
    """FedMA's own decode path: finite weights whose L2 norm overflows float32 went into the
    matching, and an infinite train-loss into the round's mean; each now rejects its client only."""
    scenario = load_scenario("scenarios/fedma/digits_mlp.yaml", [
        "federation.num_clients=4", "federation.clients_per_round=4", "federation.rounds=1",
        "federation.local_epochs=1", "aggregator.retrain_epochs=1", "federation.round_timeout=60",
    ])

    def tamper(pid, reply):
        layer = reply.content.array_records.get("layer") if not reply.has_error() else None
        if layer is None or "class-counts" not in layer:  # only the first exchange (layer 0)
            return reply
        if pid == 1:
            huge = np.full_like(layer["weight"].numpy(), 1e20)  # every entry finite, the norm is not
            reply.content["layer"] = ArrayRecord({"weight": Array(huge), "bias": layer["bias"],
                                                  "class-counts": layer["class-counts"]})
        elif pid == 2:
            reply.content["metrics"]["train-loss"] = float("inf")
        return reply

    (r,) = run_local(scenario, tmp_path, tamper=tamper).rounds
    assert "layer 0" in r["rejected"]["1"] and "norm overflows float32" in r["rejected"]["1"]
    assert "layer 0" in r["rejected"]["2"] and "train-loss must be a number" in r["rejected"]["2"]
    assert r["aggregated"] == [0, 3] and np.isfinite(r["train_loss"])
