"""Hundreds of malformed uploads thrown at real rounds: every one is rejected with a reason, the
run never crashes, and the honest uploads are still aggregated."""

from __future__ import annotations

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from fedsim.client_app import make_client_app
from fedsim.results import new_run_dir, read_rounds
from fedsim.scenario import load_scenario
from fedsim.server_app import run_server
from local_grid import LocalGrid

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
