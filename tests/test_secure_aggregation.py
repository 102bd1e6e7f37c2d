"""Secure aggregation through Flower's own SecAgg+ (fedsim/secagg/config.py, fedsim/server/secure.py,
fedsim/client/secure.py): what is refused up front, and rounds checked against oracles: the
clients' own updates (recomputed with `local_update`, the plain path's function) averaged with
FedAvg's weights, and with the quantised weights the protocol uses, within the documented error
bound 2·c·n / Σ round(Q·w_i/W)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import QUICKSTART, quick_scenario, run_local
from fedsim.client.app import make_client_app
from fedsim.client.steps import local_update
from fedsim.flower.local_grid import StageDropGrid
from fedsim.runs.checkpoint import load_server
from fedsim.runs.results import read_rounds
from fedsim.runtime import runtime_for
from fedsim.scenario import ScenarioError, load_scenario, validate_scenario

ROOT = Path(__file__).resolve().parents[1]
FLOAT_SLACK = 2e-6  # float32 rounding of the global model (|w| < 10) on top of the protocol's bound


def scenario(*overrides: str):
    return quick_scenario(
        "federation.num_clients=6", "federation.clients_per_round=5", "federation.rounds=1",
        "federation.local_epochs=1", "attack=null", "evaluation.overlap=false", *overrides, base=QUICKSTART)


def run(sc, grid=None):
    """One in-process run: (its trained round line, the global model after it)."""
    result = run_local(sc, tempfile.mkdtemp(), grid=grid, checkpoints=True)
    line = [r for r in result.rounds if r["round"] > 0][-1]
    return line, load_server(result.path, at_most=line["round"])["global"]


def client_updates(sc, pids):
    """Each client's round-1 update, as its ClientApp computes it (same seed, same function)."""
    rt = runtime_for(sc)
    g0 = rt.initial_weights()
    cfg = {"server-round": 1, "lr": rt.lr(1)}
    out = {p: local_update(rt, p, g0, 1, cfg) for p in pids}
    return g0, {p: r.delta for p, r in out.items()}, {p: float(r.num_examples) for p, r in out.items()}


def mean(deltas, weights):
    pids = sorted(deltas)
    w = torch.tensor([weights[p] for p in pids], dtype=torch.float64)
    rows = torch.stack([deltas[p].double() for p in pids])
    return (w / w.sum()) @ rows


def quantised_weights(weights, sa, max_weight):
    return {p: float(round(w / max_weight * sa.quantization_range)) for p, w in weights.items()}


# --------------------------------------------------------------------------- validation
@pytest.mark.parametrize("extra, field, words", [
    ({"aggregator": "krum"}, "aggregator", "needs every client's update"),
    ({"aggregator": {"name": "detox", "group_size": 3, "inner": "median"}}, "aggregator.redundancy", "majority vote"),
    ({"defenses": [{"name": "norm_clipping"}]}, "defenses.0", "secure_aggregation.clip_norm"),
    ({"defenses": [{"name": "flame"}]}, "defenses.0", "individual updates"),
    ({"compression": {"name": "topk"}}, "compression", "cannot be compressed"),
    ({"attack": {"name": "alie", "num_attackers": 1}}, "attack", "crafted from the honest ones"),
    ({"federation": {"num_clients": 6, "clients_per_round": 2}}, "federation.clients_per_round", "at least 3 clients"),
])
def test_what_needs_individual_updates_is_refused_naming_the_field(extra, field, words):
    raw = {"federation": {"num_clients": 6, "clients_per_round": 5}, "secure_aggregation": "secaggplus", **extra}
    with pytest.raises(ScenarioError) as err:
        validate_scenario(raw)
    problems = {p[0]: p[1] for p in err.value.problems}
    assert field in problems and words in problems[field]


@pytest.mark.parametrize("section, words", [
    ({"name": "secaggplus", "num_shares": 2}, "greater than 2"),
    ({"name": "secaggplus", "num_shares": 5, "reconstruction_threshold": 5}, "less than num_shares"),
    ({"name": "secaggplus", "modulus_range": 3 * 2**30}, "power of 2"),
    ({"name": "secaggplus", "quantization_range": 2**32}, "must exceed quantization_range"),
    ({"name": "secaggplus", "quantization_range": 2**30}, "would wrap"),
])
def test_impossible_protocol_parameters_are_refused(section, words):
    with pytest.raises(ScenarioError) as err:
        validate_scenario({"federation": {"num_clients": 6, "clients_per_round": 5}, "secure_aggregation": section})
    assert words in str(err.value)


def test_what_survives_validates():
    for extra in ({}, {"aggregator": {"name": "detox", "group_size": 3, "redundancy": False, "inner": "median"}},
                  {"attack": {"name": "edge_case", "num_attackers": 1}}):
        raw = {"federation": {"num_clients": 12, "clients_per_round": 9}, **extra,
               "secure_aggregation": {"name": "secaggplus", "clip_norm": 1.0}}
        assert validate_scenario(raw).secure_aggregation.clip_norm == 1.0
    assert validate_scenario({}).secure_aggregation is None


def test_shares_follow_flowers_setup_stage():
    sa = validate_scenario({"secure_aggregation": "secaggplus"}).secure_aggregation
    assert sa.shares_for(5) == (5, 2)  # round(0.5 * 5) = 2
    assert validate_scenario({"secure_aggregation": {"name": "secaggplus", "num_shares": 0.5}}).secure_aggregation \
        .shares_for(10) == (5, 2)


# --------------------------------------------------------------------------- rounds
def test_secaggplus_aggregate_equals_fedavg_up_to_the_documented_quantisation_error():
    plain_line, plain = run(scenario())
    sc = scenario("secure_aggregation={name: secaggplus}")
    line, secure = run(sc)
    pids = line["sampled"]
    assert line["secure_aggregation"]["summed"] == pids == plain_line["sampled"] and line["rejected"] == {}
    g0, deltas, weights = client_updates(sc, pids)
    sa, max_weight = sc.secure_aggregation, line["secure_aggregation"]["max_weight"]
    bound = line["secure_aggregation"]["error_bound"]
    assert bound == pytest.approx(2 * sa.clipping_range * len(pids) / sum(quantised_weights(weights, sa, max_weight).values()))
    assert bound < 1e-4
    got = (secure - g0).double()
    # against the quantised-weight mean: the protocol's rounding error only
    exact_q = mean(deltas, quantised_weights(weights, sa, max_weight))
    assert float((got - exact_q).abs().max()) <= bound + FLOAT_SLACK
    # against plain FedAvg (the plain run's global model): plus the weights' quantisation
    fedavg = mean(deltas, weights)
    assert float(((plain - g0).double() - fedavg).abs().max()) <= FLOAT_SLACK  # the oracle is FedAvg's
    weight_term = float((exact_q - fedavg).abs().max())
    assert float((secure - plain).abs().max()) <= bound + weight_term + 2 * FLOAT_SLACK
    assert float((secure - plain).abs().max()) > 0  # it was quantised, not passed in the clear


def test_a_secure_run_is_reproducible_and_counts_every_stage_bytes():
    sc = scenario("secure_aggregation={name: secaggplus}")
    a, ga = run(sc)
    b, gb = run(sc)
    assert torch.equal(ga, gb)  # masks cancel exactly; the rounding is seeded per client and round
    sa_info = a["secure_aggregation"]
    stages = sa_info["bytes_per_stage"]
    assert list(stages) == ["setup", "share_keys", "collect_masked_vectors", "unmask"]
    assert sum(s["up"] for s in stages.values()) == a["bytes_up"] == sum(a["bytes_up_per_client"].values())
    assert sum(s["down"] for s in stages.values()) == a["bytes_down"] == sum(a["bytes_down_per_client"].values())
    d = runtime_for(sc).layout.dim
    per_client_up = {int(k): v for k, v in a["bytes_up_per_client"].items()}
    assert sorted(per_client_up) == a["sampled"]
    assert all(v >= 4 * d for v in per_client_up.values())  # at least the masked vector of d coordinates
    assert sorted(int(k) for k in a["secure_aggregation_seconds"]["clients"]) == a["sampled"]


@pytest.mark.parametrize("stage, summed_too", [("collect_masked_vectors", False), ("unmask", True)])
def test_a_dropout_during_the_protocol_is_survived(stage, summed_too):
    """A client gone before sending its masked vector is left out (its pairwise masks are removed from
    its neighbours' shares of its key); one gone after sending it is still in the sum (its own mask
    is removed from the others' shares of its seed). Either way the result is the mean of exactly
    the summed clients, within the bound."""
    sc = scenario("secure_aggregation={name: secaggplus}")
    probe, _ = run(sc)
    victim = probe["sampled"][1]
    line, secure = run(sc, StageDropGrid(make_client_app(sc), 6, {victim: stage}))
    summed = line["secure_aggregation"]["summed"]
    assert (victim in summed) == summed_too and line["skipped"] is None
    assert (str(victim) in line["rejected"]) != summed_too
    g0, deltas, weights = client_updates(sc, summed)
    sa = sc.secure_aggregation
    exact_q = mean(deltas, quantised_weights(weights, sa, line["secure_aggregation"]["max_weight"]))
    assert float(((secure - g0).double() - exact_q).abs().max()) <= line["secure_aggregation"]["error_bound"] + FLOAT_SLACK


def test_more_dropouts_than_the_threshold_allows_skip_the_round_with_the_reason():
    sc = scenario("secure_aggregation={name: secaggplus, reconstruction_threshold: 4}")
    probe, _ = run(sc)
    drop = {p: "collect_masked_vectors" for p in probe["sampled"][:2]}
    line, after = run(sc, StageDropGrid(make_client_app(sc), 6, drop))
    assert line["skipped"] == "secaggplus halted in every group"
    assert all("halted" in line["rejected"][str(p)] for p in probe["sampled"][2:])
    assert torch.equal(after, runtime_for(sc).initial_weights())  # the global model stays


def test_client_side_clipping_bounds_the_secure_aggregate():
    sc = scenario("secure_aggregation={name: secaggplus, clip_norm: 0.05}")
    line, secure = run(sc)
    g0 = runtime_for(sc).initial_weights()
    d = g0.numel()
    step = float(torch.linalg.vector_norm(secure - g0))
    assert step <= 0.05 + line["secure_aggregation"]["error_bound"] * d ** 0.5 + 1e-5  # a mean of vectors of norm <= S


@pytest.mark.parametrize("section", ["{name: secaggplus}", "{name: lightsecagg, privacy: 1, dropout: 1}"])
def test_detox_groups_are_securely_aggregated_and_the_robust_rule_runs_across_their_means(section):
    from fedsim.aggregators.detox import detox_with_info

    inner = "{name: detox, group_size: 3, redundancy: false, inner: median}"
    sc = load_scenario(str(ROOT / "scenarios/quickstart.yaml"), [
        "federation.num_clients=8", "federation.clients_per_round=7", "federation.rounds=1", "federation.local_epochs=1",
        "attack=null", "evaluation.overlap=false", f"aggregator={inner}", f"secure_aggregation={section}"])
    line, secure = run(sc)
    groups = [g["members"] for g in line["secure_aggregation"]["groups"]]
    assert groups == line["groups"] and [len(g) for g in groups] == [3, 4]
    assert all(not g["halted"] for g in line["secure_aggregation"]["groups"])
    g0, deltas, weights = client_updates(sc, line["sampled"])
    sa, max_weight = sc.secure_aggregation, line["secure_aggregation"]["max_weight"]
    qw = quantised_weights(weights, sa, max_weight) if sa.name == "secaggplus" else weights  # LightSecAgg: exact
    means = torch.stack([mean({p: deltas[p] for p in g}, {p: qw[p] for p in g}) for g in groups]).float()
    totals = torch.tensor([sum(weights[p] for p in g) for g in groups])
    expected, _ = detox_with_info(means, totals, groups=[[0], [1]], redundancy=False, inner="median")
    bound = line["secure_aggregation"]["error_bound"]
    assert float(((secure - g0) - expected).abs().max()) <= bound + FLOAT_SLACK


# --------------------------------------------------------------------------- a real SuperLink
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("section", ["{name: secaggplus}", "{name: lightsecagg, privacy: 1, dropout: 1}"])
def test_secure_rounds_on_a_superlink_with_three_supernodes_give_the_in_process_rounds(tmp_path, section):
    """The four exchanges through a real SuperLink, SuperNodes and Flower's executor (each message a
    ClientApp process, the protocol's state in the node's Context): the same round lines as in-process
    (the rounding is seeded and the masks cancel exactly), bytes up to the node ids' encoding."""
    from test_deployment import SCENARIO, Cluster, in_process_rounds, strip, wait_summary

    over = SCENARIO + ["federation.round_timeout=300", f"secure_aggregation={section}"]
    cluster = Cluster(tmp_path)
    try:
        cluster.superlink()
        for i in range(3):
            cluster.supernode(i, 3)
        run = cluster.run(over)
        summary = wait_summary(cluster, 600, run)
        rounds = read_rounds(cluster.run_dir())
    finally:
        cluster.stop()
    assert summary["rounds_completed"] == 2
    assert all(r["secure_aggregation"]["summed"] == [0, 1, 2] and not r["rejected"] for r in rounds[1:])
    assert all(r["backdoor_success"] is not None for r in rounds)
    local = strip(in_process_rounds(tmp_path, over))
    # SecAgg+'s key and share messages carry node ids, which a SuperLink draws as 64-bit integers
    # (the in-process grid's are small): only those stages' sizes may differ, by the varints
    sizes = ("bytes_up", "bytes_down", "bytes_up_per_client", "bytes_down_per_client")

    def same_up_to_node_ids(line):
        out = {k: v for k, v in line.items() if k not in sizes}
        if "secure_aggregation" in out:
            out["secure_aggregation"] = {k: v for k, v in out["secure_aggregation"].items() if k != "bytes_per_stage"}
        return out

    assert [same_up_to_node_ids(r) for r in local] == [same_up_to_node_ids(r) for r in strip(rounds)]
    for here, there in zip(local[1:], rounds[1:]):
        stages_here, stages_there = (r["secure_aggregation"]["bytes_per_stage"] for r in (here, there))
        upload = "collect_masked_vectors" if "collect_masked_vectors" in stages_here else "upload"
        assert stages_here[upload]["up"] == stages_there[upload]["up"]
        assert abs(here["bytes_up"] - there["bytes_up"]) < 0.01 * there["bytes_up"]
        assert abs(here["bytes_down"] - there["bytes_down"]) < 0.01 * there["bytes_down"]


def test_preflight_refuses_a_max_weight_below_the_largest_partition():
    from fedsim.preflight import preflight

    preflight(scenario("secure_aggregation={name: secaggplus}"))
    with pytest.raises(ScenarioError) as err:
        preflight(scenario("secure_aggregation={name: secaggplus, max_weight: 10}"))
    assert "secure_aggregation.max_weight" in str(err.value) and "largest partition" in str(err.value)


# --------------------------------------------------------------------------- LightSecAgg in rounds
def test_lightsecagg_aggregate_equals_fedavg_within_its_rounding_bound():
    """The weights are summed exactly in F_p, so the only error is the stochastic rounding of
    c·w_i/W·x_i: below n·W/(c·Σw) per coordinate against FedAvg itself."""
    plain_line, plain = run(scenario())
    sc = scenario("secure_aggregation={name: lightsecagg}")
    line, secure = run(sc)
    info = line["secure_aggregation"]
    assert info["summed"] == line["sampled"] == plain_line["sampled"] and line["rejected"] == {}
    assert info["groups"][0] == {"members": line["sampled"], "summed": line["sampled"], "privacy": 2, "dropout": 2,
                                      "target": 3, "halted": False}
    g0, deltas, weights = client_updates(sc, line["sampled"])
    bound = info["error_bound"]
    assert bound == pytest.approx(len(weights) * info["max_weight"] / (2.0**16 * sum(weights.values())))
    assert float(((secure - g0).double() - mean(deltas, weights)).abs().max()) <= bound + FLOAT_SLACK
    assert float((secure - plain).abs().max()) <= bound + 2 * FLOAT_SLACK
    assert list(info["bytes_per_stage"]) == ["keys", "shares", "upload", "aggregate"]
    assert sum(s["up"] for s in info["bytes_per_stage"].values()) == line["bytes_up"]
    a, b = run(sc)[1], secure
    assert torch.equal(a, b)  # random masks cancel exactly; the rounding is seeded


@pytest.mark.parametrize("stage, summed_too", [("upload", False), ("aggregate", True)])
def test_lightsecagg_survives_a_dropout_before_or_after_the_upload(stage, summed_too):
    sc = scenario("secure_aggregation={name: lightsecagg}")
    probe, _ = run(sc)
    victim = probe["sampled"][2]
    line, secure = run(sc, StageDropGrid(make_client_app(sc), 6, {victim: stage}))
    summed = line["secure_aggregation"]["summed"]
    assert (victim in summed) == summed_too and line["skipped"] is None
    g0, deltas, weights = client_updates(sc, summed)
    assert float(((secure - g0).double() - mean(deltas, weights)).abs().max()) <= \
        line["secure_aggregation"]["error_bound"] + FLOAT_SLACK


def test_lightsecagg_refuses_more_dropouts_than_d_and_impossible_parameters():
    sc = scenario("secure_aggregation={name: lightsecagg, privacy: 1, dropout: 1}")  # N=5, U=4
    probe, _ = run(sc)
    line, after = run(sc, StageDropGrid(make_client_app(sc), 6, {p: "upload" for p in probe["sampled"][:2]}))
    assert line["skipped"] == "lightsecagg halted in every group"
    assert torch.equal(after, runtime_for(sc).initial_weights())
    with pytest.raises(ScenarioError) as err:
        validate_scenario({"federation": {"num_clients": 6, "clients_per_round": 5},
                           "secure_aggregation": {"name": "lightsecagg", "privacy": 3, "dropout": 2}})
    assert "N - D >= U > T" in str(err.value)


def test_lightsecagg_keys_a_link_answered_error_by_the_node_it_was_for():
    """A SuperLink answers for an offline node with an error from its own id: two such nodes must
    not collide under that id (#38 item 4); each reply is matched to the message it answers."""
    from flwr.app import RecordDict

    from fedsim.flower.local_grid import LocalGrid
    from fedsim.server.lightsecagg import _send

    sc = quick_scenario("federation.num_clients=4", "federation.clients_per_round=4", attack=None)
    grid = LocalGrid(make_client_app(sc), 4, offline={1, 2})
    nodes = list(grid.get_node_ids())
    replies = _send(grid, {nid: RecordDict() for nid in nodes}, 1, None)
    assert sorted(replies) == sorted(nodes)
    offline = [nodes[1], nodes[2]]
    assert all(replies[n].has_error() and "offline" in replies[n].error.reason for n in offline)
    assert all(replies[n].metadata.src_node_id not in nodes for n in offline)  # answered by the link
