"""Whole rounds through the real ServerApp strategy and ClientApp, on an in-process grid (no Ray).

Bad uploads (NaN, wrong shape, truncated bytes, a crashing client) are rejected with a reason in
rounds.jsonl and the run goes on; the same seed gives the same metrics; bytes are counted.
"""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord

from conftest import QUICKSTART, quick_scenario, run_local
from fedsim.server.record import without_times

QUICK = ["federation.rounds=4", "federation.num_clients=8", "federation.clients_per_round=5", "attack.schedule.every=2", "attack.schedule.first=1"]


def run(tmp_path, overrides=(), tamper=None, **grid_options):
    """The QUICK run in-process (grid_options: LocalGrid's fail / offline): rounds, summary, run folder."""
    result = run_local(quick_scenario(*QUICK, *overrides, base=QUICKSTART), tmp_path, tamper=tamper, **grid_options)
    return result.rounds, result.summary, result.path


def metrics(rounds):
    return without_times(rounds)


def test_rounds_written_with_every_key(tmp_path):
    rounds, summary, run_dir = run(tmp_path)
    assert [r["round"] for r in rounds] == [1, 2, 3, 4]
    for key in ("main_accuracy", "main_loss", "backdoor_success", "bytes_up", "bytes_down", "wall_seconds", "sampled", "attackers", "rejected", "defenses"):
        assert all(key in r for r in rounds), key
    assert all(len(r["sampled"]) == 5 for r in rounds)
    assert [bool(r["attackers"]) for r in rounds] == [True, False, True, False]  # every 2 rounds from round 1
    # uploads are float32 updates of the 4810-parameter MLP: at least 4 bytes per parameter per client
    assert all(r["bytes_up"] >= 5 * 4 * 4810 and r["bytes_down"] >= 5 * 4 * 4810 for r in rounds)
    for r in rounds:  # per client, and summing to the round's totals
        assert sorted(map(int, r["bytes_up_per_client"])) == r["sampled"]
        assert sum(r["bytes_up_per_client"].values()) == r["bytes_up"]
        assert sum(r["bytes_down_per_client"].values()) == r["bytes_down"]
    assert summary["rounds_completed"] == 4 and (run_dir / "scenario.yaml").exists()
    assert summary["attack"]["density_check"]["median_percentile"] < 5


def test_same_seed_same_metrics_other_seed_differs(tmp_path):
    a, _, _ = run(tmp_path / "a")
    b, _, _ = run(tmp_path / "b")
    c, _, _ = run(tmp_path / "c", ["seed=1"])
    assert metrics(a) == metrics(b)
    assert metrics(a) != metrics(c)


def _nan_upload(pid, reply):
    if pid == 2 and not reply.has_error():
        arr = reply.content["update"]["delta"].numpy().copy()
        arr[0] = np.nan
        reply.content["update"] = ArrayRecord(array_dict={"delta": Array(arr)})
    return reply


def _short_upload(pid, reply):
    if pid == 3 and not reply.has_error():
        reply.content["update"] = ArrayRecord(array_dict={"delta": Array(np.zeros(10, np.float32))})
    return reply


def _truncated_upload(pid, reply):
    if pid == 4 and not reply.has_error():
        good = reply.content["update"]["delta"]
        reply.content["update"] = ArrayRecord(
            array_dict={"delta": Array(dtype=good.dtype, shape=good.shape, stype=good.stype, data=good.data[:100])}
        )
    return reply


@pytest.mark.parametrize(
    "tamper, pid, reason",
    [(_nan_upload, 2, "NaN"), (_short_upload, 3, "shape"), (_truncated_upload, 4, "deserialise")],
)
def test_malformed_upload_is_rejected_and_logged(tmp_path, tamper, pid, reason):
    rounds, summary, _ = run(tmp_path, tamper=tamper)
    hit = [r for r in rounds if pid in r["sampled"]]
    assert hit, "the tampered client was never sampled; pick another id"
    for r in hit:
        assert reason in r["rejected"][str(pid)]
        assert pid not in r.get("aggregated", [])
    assert summary["rounds_completed"] == 4 and summary["final_main_accuracy"] > 0.3


def test_crashing_client_is_reported_not_fatal(tmp_path):
    rounds, summary, _ = run(tmp_path, fail={1})
    hit = [r for r in rounds if 1 in r["sampled"]]
    assert hit and all("device out of memory" in r["rejected"]["1"] for r in hit)
    assert summary["rounds_completed"] == 4


def test_the_links_answer_for_an_offline_node_is_recorded_under_that_node(tmp_path):
    """A SuperLink answers for a node it marked offline with an error from its own node id; the
    failure must go to the client whose message it answers, not to a client "-1", and the dead
    client must not also get a false "no reply" (issue #21, item 4)."""
    rounds, _, _ = run(tmp_path, offline={1})
    hit = [r for r in rounds if 1 in r["sampled"]]
    assert hit and all(r["rejected"]["1"] == "client error: the node is offline" for r in hit)
    assert all("-1" not in r.get("rejected", {}) for r in rounds)


def test_initial_evaluation_writes_round_zero(tmp_path):
    rounds, summary, _ = run(tmp_path, ["evaluation.initial=true", "evaluation.every=2"])
    assert [r["round"] for r in rounds] == [0, 1, 2, 3, 4]
    assert rounds[0]["main_accuracy"] is not None and rounds[0]["sampled"] == []
    # evaluated every 2nd round and always the last one
    assert [r.get("main_accuracy") is not None for r in rounds] == [True, False, True, False, True]


def test_too_few_replies_skip_the_round_with_a_message(tmp_path):
    rounds, _, _ = run(tmp_path, ["federation.min_replies=5"], fail={0, 1, 2, 3})
    for r in rounds:
        failed = set(r["sampled"]) & {0, 1, 2, 3}
        if failed:
            assert r["skipped"] and "min_replies=5" in r["skipped"]
        else:
            assert r["skipped"] is None


def _hostile_fields(pid, reply):
    """Three clients lie in fields a codec does not check: a repeated top-k index, an infinite
    training loss, an example count finite in float64 but not in float32."""
    if reply.has_error():
        return reply
    if pid == 2:
        update = {k: v.numpy().copy() for k, v in reply.content["update"].items()}
        idx = next(k for k in update if k.endswith(".i"))
        update[idx][1] = update[idx][0]
        reply.content["update"] = ArrayRecord(array_dict={k: Array(v) for k, v in update.items()})
    elif pid == 3:
        reply.content["metrics"]["train-loss"] = float("inf")
    elif pid == 4:
        reply.content["metrics"]["num-examples"] = 1e39
    return reply


def test_hostile_metric_and_index_fields_reject_only_their_client(tmp_path):
    """A repeated top-k index was scattered silently, an inf loss made the round's train_loss inf
    and 1e39 examples turned every FedAvg weight into inf (the round skipped): now each of these
    clients is rejected with the field and its allowed range, and the others are aggregated."""
    rounds, summary, _ = run(tmp_path, ["compression={name: topk, fraction: 0.1}", "attack=null"], _hostile_fields)
    reasons = {2: "indices must be distinct", 3: "train-loss must be a number in", 4: "num-examples must be a count in [0, 2147483647], got 1e+39"}
    assert any(set(reasons) & set(r["sampled"]) for r in rounds)
    for r in rounds:
        for pid in set(reasons) & set(r["sampled"]):
            assert reasons[pid] in r["rejected"][str(pid)]
        assert r["aggregated"] == sorted(set(r["sampled"]) - set(reasons))
        assert r["skipped"] is None and np.isfinite(r["train_loss"]) and np.isfinite(r["main_loss"])
    assert summary["rounds_completed"] == 4
