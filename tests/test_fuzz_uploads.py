"""Hundreds of malformed uploads thrown at real rounds: every one is rejected with a reason, the
run never crashes, and the honest uploads are still aggregated."""

from __future__ import annotations

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from fedsim.client.app import make_client_app
from fedsim.runs.results import new_run_dir, read_rounds
from fedsim.scenario import load_scenario
from fedsim.server.app import run_server
from fedsim.engine.local_grid import LocalGrid

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

    run_dir = new_run_dir(scenario, tmp_path)
    summary = run_server(LocalGrid(make_client_app(scenario), 30, tamper=tamper), scenario, run_dir)
    rounds = read_rounds(run_dir)
    assert summary["rounds_completed"] == 10
    rejected = sum(len(r["rejected"]) for r in rounds)
    assert rejected == 10 * 25  # 250 malformed uploads, every one rejected
    assert all(r["aggregated"] == sorted(honest) for r in rounds)
    assert all(isinstance(reason, str) and reason for r in rounds for reason in r["rejected"].values())
    assert summary["final_main_accuracy"] > 0.5


# --- property-based: every codec's decode path against mutated payloads -------------------------
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
    """One hostile edit of a valid payload: the ways an untrusted client can lie."""
    payload = dict(payload)
    key = draw(st.sampled_from(sorted(payload)))
    arr = payload[key]
    kind = draw(st.sampled_from(["drop", "extra", "truncate", "grow", "dtype", "rank", "random", "values", "ints"]))
    if kind == "drop":
        del payload[key]
    elif kind == "extra":
        payload[draw(st.text(min_size=1, max_size=8))] = np.zeros(draw(st.integers(0, 50)), np.float32)
    elif kind == "truncate" and arr.size:
        payload[key] = arr.reshape(-1)[: draw(st.integers(0, arr.size - 1))]
    elif kind == "grow":
        payload[key] = np.concatenate([arr.reshape(-1), arr.reshape(-1)[: draw(st.integers(1, 64))]])
    elif kind == "dtype":
        to = draw(st.sampled_from(["float64", "float16", "int8", "int16", "int32", "int64", "uint8", "uint64", "bool"]))
        payload[key] = arr.astype(to)
    elif kind == "rank":
        payload[key] = arr.reshape(1, -1) if arr.ndim == 1 else arr.reshape(-1)
    elif kind == "random":  # the right dtype and size, arbitrary bytes
        nbytes = arr.dtype.itemsize * arr.size
        payload[key] = np.frombuffer(draw(st.binary(min_size=nbytes, max_size=nbytes)), arr.dtype).reshape(arr.shape)
    elif kind == "values" and arr.size and arr.dtype.kind == "f":
        bad = arr.copy()
        idx = draw(st.lists(st.integers(0, arr.size - 1), min_size=1, max_size=5))
        bad.reshape(-1)[idx] = draw(st.sampled_from(HUGE))
        payload[key] = bad
    elif kind == "ints" and arr.size and arr.dtype.kind in "iu":
        bad = arr.copy()
        info = np.iinfo(arr.dtype)
        idx = draw(st.lists(st.integers(0, arr.size - 1), min_size=1, max_size=5))
        bad.reshape(-1)[idx] = draw(st.sampled_from([info.min, info.max, 0, -1 if info.min < 0 else 1]))
        payload[key] = bad
    return payload


def check_upload(codec, layout, payload, num_examples) -> None:
    """Decode a reply carrying `payload`: a clean rejection (PayloadError with a reason) or a
    finite, right-sized update with a bounded weight. Nothing else may come out."""
    from types import SimpleNamespace

    content = RecordDict({"update": pack_payload(payload),
                          "metrics": MetricRecord({"num-examples": num_examples, "train-loss": 0.5})})
    try:
        message_bytes(SimpleNamespace(content=content))  # only the content is sized
        update, weight, _ = decode_upload(content, codec, layout)
    except PayloadError as err:
        assert str(err)
        return
    assert update.shape == (layout.dim,) and torch.isfinite(update).all()
    assert torch.isfinite(torch.linalg.vector_norm(update)) and 0 <= weight <= MAX_EXAMPLES


FUZZ = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.mark.parametrize("name", CODECS)
@FUZZ
@given(data=st.data())
def test_mutated_payloads_are_decoded_or_cleanly_rejected(valid_payloads, name, data):
    codec, layout, payload = valid_payloads[name]
    count = data.draw(st.one_of(st.integers(0, 1000), st.sampled_from([-1, 10**30, 2**63 - 1, 2**31]),
                                st.sampled_from([1e39, float("nan"), float("inf"), 0.5])))
    check_upload(codec, layout, mutate(data.draw, payload), count)


@pytest.mark.slow
@pytest.mark.parametrize("name", CODECS)
@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_mutated_payloads_many(valid_payloads, name, data):
    codec, layout, payload = valid_payloads[name]
    check_upload(codec, layout, mutate(data.draw, payload), data.draw(st.integers(-5, 2**70)))


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

    run_dir = new_run_dir(scenario, tmp_path)
    run_server(LocalGrid(make_client_app(scenario), 5, tamper=tamper), scenario, run_dir)
    rounds = read_rounds(run_dir)
    assert all("3" in r["rejected"] and r["aggregated"] == [0, 1, 2, 4] and not r["skipped"] for r in rounds)
