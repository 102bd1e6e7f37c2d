"""Bucketing and nearest-neighbour mixing (aggregators/mixing.py) against independent oracles: hand
computations, plain-loop references written here (float64, one row at a time), and properties from
the papers (honest neighbourhoods that exclude far outliers, byzantine updates that spoil only their
buckets); then the registry, schema, scenario and DETOX checks they share with centered clipping
(whose own tests are in test_centered_clipping.py)."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from conftest import QUICKSTART, quick_scenario, round_context, update_batch
from update_samples import close, loop_centered_clip, make_updates
from fedsim.aggregators import AggregationError
from fedsim.aggregators.centered_clipping import CenteredClippingParams
from fedsim.aggregators.detox import detox
from fedsim.aggregators.mixing import (
    BucketingParams,
    NNMParams,
    bucketing,
    bucketing_with_info,
    nearest_neighbours,
    nnm,
    nnm_mix,
    nnm_with_info,
)
from fedsim.aggregators.base import call_rule
from fedsim.registry import AGGREGATORS
from fedsim.scenario import ScenarioError
from fedsim.server.pipeline import RoundPipeline


# ---------------------------------------------------------------- inputs and references


def scenario(*overrides: str):
    return quick_scenario("attack=null", "defenses=[]", *overrides, base=QUICKSTART)


def rule(name: str, **params):
    """A registered rule called as the pipeline would, with its defaults."""
    spec = AGGREGATORS.get(name).spec_model()(name=name, **params)

    def call(updates, weights, ctx=None):
        return call_rule(spec, updates, weights, ctx)[0]

    return call


def loop_buckets(n: int, s: int, seed: int) -> list[list[int]]:
    """The official code's buckets: a permutation cut into runs of s, the last one shorter."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    return [perm[t * s:(t + 1) * s] for t in range(math.ceil(n / s))]


def loop_bucket_inputs(updates, weights, buckets):
    means = torch.stack([sum(updates[i].double() for i in b) / len(b) for b in buckets]).float()
    totals = torch.tensor([sum(float(weights[i]) for i in b) for b in buckets])
    return means, totals


def loop_nnm(updates: torch.Tensor, f: int) -> torch.Tensor:
    """Each row: the mean of its n - f nearest rows (float64 distances, itself first, ties to lower index)."""
    rows = [r.double() for r in updates]
    n, out = len(rows), []
    for i in range(n):
        dist = [(-1.0 if j == i else float(torch.linalg.vector_norm(rows[i] - rows[j])), j) for j in range(n)]
        chosen = [j for _, j in sorted(dist)[: n - f]]
        out.append(sum(rows[j] for j in chosen) / len(chosen))
    return torch.stack(out).float()


# ---------------------------------------------------------------- bucketing


ORDER_FREE_INNER = [
    ("fedavg", {}), ("median", {}), ("trimmed_mean", {"beta": 0.2}), ("krum", {"num_malicious": 2}),
    ("multikrum", {"num_malicious": 2}), ("rfa", {}), ("bulyan", {"num_malicious": 1, "selection": "multikrum"}),
    ("centered_clipping", {"tau": 1.0, "iterations": 2}),
]


@pytest.mark.parametrize("inner,params", ORDER_FREE_INNER)
def test_bucket_size_one_is_the_inner_rule(inner, params):
    updates, weights = make_updates(15, 20, seed=20)
    ctx = round_context(20, seed=3, previous=updates.mean(0))
    expected = rule(inner, **params)(updates, weights, ctx=round_context(20, previous=updates.mean(0)))
    close(bucketing(updates, weights, s=1, inner={"name": inner, **params}, ctx=ctx), expected)


@pytest.mark.parametrize("s", [2, 3, 4, 11, 20])
@pytest.mark.parametrize("inner", ["median", "fedavg", "rfa"])
def test_bucketing_matches_the_loop_reference(s, inner):
    updates, weights = make_updates(11, 25, seed=21)
    means, totals = loop_bucket_inputs(updates, weights, loop_buckets(11, s, seed=7))
    out = bucketing(updates, weights, s=s, inner=inner, ctx=round_context(25, seed=7))
    close(out, rule(inner)(means, totals))


def test_bucketing_around_fedavg_is_fedavg_with_equal_counts():
    updates, _ = make_updates(13, 10, seed=22)
    ones = torch.ones(13)
    for s in (2, 3, 5):
        for seed in range(3):
            close(bucketing(updates, ones, s=s, inner="fedavg", ctx=round_context(10, seed=seed)), updates.double().mean(0))


def test_krum_on_buckets_reports_the_chosen_bucket_members():
    updates, weights = make_updates(11, 25, seed=23)
    out, info = bucketing_with_info(updates, weights, s=2, inner={"name": "krum", "num_malicious": 1},
                                    ctx=round_context(25, seed=4))
    buckets = loop_buckets(11, 2, seed=4)
    assert info["inner"] == "krum" and info["inner_inputs"] == 6
    assert sorted(info["selected"]) in [sorted(b) for b in buckets]
    close(out, updates[info["selected"]].double().mean(0))
    _, median_info = bucketing_with_info(updates, weights, s=2, inner="median", ctx=round_context(25))
    assert "selected" not in median_info  # a rule that does not choose leaves no one out


@pytest.mark.parametrize("seed", range(6))
def test_far_byzantine_updates_spoil_only_their_buckets(seed):
    updates, weights = make_updates(15, 20, seed=30 + seed)
    bad = [3, 11]
    updates[bad] = 1e3 + updates[bad]
    _, info = bucketing_with_info(updates, weights, s=2, inner={"name": "krum", "num_malicious": 2},
                                  ctx=round_context(20, seed=seed))
    assert not set(info["selected"]) & set(bad)


def test_bucketing_draws_from_the_round_generator():
    updates, weights = make_updates(12, 15, seed=24)
    outs = [bucketing(updates, weights, s=3, inner="median", ctx=round_context(15, seed=seed)) for seed in range(4)]
    assert torch.equal(outs[0], bucketing(updates, weights, s=3, inner="median", ctx=round_context(15, seed=0)))
    assert any(not torch.equal(outs[0], o) for o in outs[1:])
    # without a context (a direct call, or inside DETOX) a fixed seed: still deterministic
    assert torch.equal(bucketing(updates, weights, s=3, inner="median"), bucketing(updates, weights, s=3, inner="median"))


def test_bucketing_passes_its_context_to_an_inner_rule_that_reads_it():
    updates, weights = make_updates(10, 8, seed=25)
    previous = torch.full((8,), 0.7)
    inner = {"name": "centered_clipping", "tau": 0.5}
    ctx = round_context(8, seed=2, previous=previous)
    means, _ = loop_bucket_inputs(updates, weights, loop_buckets(10, 2, seed=2))
    close(bucketing(updates, weights, s=2, inner=inner, ctx=ctx), loop_centered_clip(means, previous, 0.5, 1))


def test_bucketing_round_problem_counts_bucket_means():
    params = BucketingParams(s=2, inner={"name": "krum", "num_malicious": 1})
    assert params.round_problem(9) is None  # 5 buckets: Krum with f = 1 needs 5
    field, reason, value = params.round_problem(8)
    assert field == "inner.num_malicious" and value == 1
    assert "bucketing: 8 clients make 4 buckets of s=2" in reason and "n >= 2f + 3" in reason
    updates, weights = make_updates(8, 5, seed=26)
    with pytest.raises(AggregationError, match=r"bucketing: inner rule krum failed on 4 bucket means of s=2"):
        bucketing(updates, weights, s=2, inner={"name": "krum", "num_malicious": 1}, ctx=round_context(5))


# ---------------------------------------------------------------- nearest-neighbour mixing


@pytest.mark.parametrize("n,f", [(5, 0), (5, 4), (7, 2), (10, 3), (12, 5), (16, 7)])
def test_nnm_matches_the_loop_reference(n, f):
    updates, _ = make_updates(n, 30, seed=40 + n + f)
    mixed, neighbours = nnm_mix(updates, f)
    close(mixed, loop_nnm(updates, f))
    assert neighbours.shape == (n, n - f) and torch.equal(neighbours[:, 0], torch.arange(n))


def test_nnm_with_no_malicious_makes_every_row_the_mean():
    updates, _ = make_updates(9, 12, seed=41)
    mixed, _ = nnm_mix(updates, 0)
    close(mixed, updates.double().mean(0).expand(9, 12))


@pytest.mark.parametrize("inner,params", [
    ("krum", {"num_malicious": 2}), ("median", {}), ("trimmed_mean", {"num_trim": 2}),
    ("multikrum", {"num_malicious": 2}), ("fedavg", {}), ("rfa", {}),
])
def test_nnm_composes_with_the_inner_rule(inner, params):
    updates, weights = make_updates(11, 20, seed=42)
    expected = rule(inner, **params)(loop_nnm(updates, 2), weights)  # mixed row i keeps client i's weight
    close(nnm(updates, weights, num_malicious=2, inner={"name": inner, **params}, ctx=round_context(20)), expected)


def test_far_outliers_leave_the_honest_neighbourhoods():
    honest, weights = make_updates(7, 20, seed=43)
    outliers = 500.0 + make_updates(3, 20, seed=44)[0]
    updates = torch.cat([honest, outliers])
    weights = torch.cat([weights, torch.full((3,), 1e6)])
    mixed, _ = nnm_mix(updates, 3)
    close(mixed[:7], honest.double().mean(0).expand(7, 20))  # n - f = 7 nearest: exactly the honest rows
    out, info = nnm_with_info(updates, weights, num_malicious=3, inner={"name": "krum", "num_malicious": 3})
    close(out, honest.double().mean(0))
    assert info["selected"] == list(range(7))


def test_every_row_is_its_own_first_neighbour_even_among_copies():
    row = torch.randn(6)
    updates = torch.stack([row, row, row + 1, row, row + 2])
    assert nearest_neighbours(updates, 3)[:, 0].tolist() == [0, 1, 2, 3, 4]


def test_a_non_finite_row_only_spoils_its_own_mixture():
    updates, weights = make_updates(8, 10, seed=45)
    updates[3, 2] = float("nan")
    mixed, neighbours = nnm_mix(updates, 1)
    assert not torch.isfinite(mixed[3]).all()
    assert torch.isfinite(mixed[torch.arange(8) != 3]).all()
    assert 3 not in neighbours[torch.arange(8) != 3].flatten().tolist()
    out = nnm(updates, weights, num_malicious=1, inner={"name": "krum", "num_malicious": 1})
    assert torch.isfinite(out).all()


def test_nnm_round_problem():
    assert NNMParams(num_malicious=2, inner="median").round_problem(3) is None
    assert NNMParams(num_malicious=3, inner="median").round_problem(3)[0] == "num_malicious"
    field, reason, _ = NNMParams(num_malicious=1, inner={"name": "krum", "num_malicious": 2}).round_problem(6)
    assert field == "inner.num_malicious" and "nnm: 6 clients make 6 mixed updates" in reason
    updates, weights = make_updates(3, 4, seed=46)
    with pytest.raises(AggregationError, match="nnm needs f < n"):
        nnm(updates, weights, num_malicious=3, inner="median")


# ---------------------------------------------------------------- registry, schema, scenarios


def test_defaults_and_capabilities():
    assert CenteredClippingParams().model_dump() == {"tau": 10.0, "iterations": 1, "center": "previous"}
    assert BucketingParams().s == 2 and BucketingParams().inner.name == "krum"
    assert NNMParams().num_malicious == 1 and NNMParams().inner.name == "krum"
    for name in ("centered_clipping", "bucketing", "nnm"):
        assert AGGREGATORS.get(name).traits.with_context is True
    with pytest.raises(ValidationError):
        CenteredClippingParams(tau=float("inf"))
    with pytest.raises(ValidationError):
        CenteredClippingParams(tau=0.0)
    with pytest.raises(ValidationError):
        CenteredClippingParams(center="median")


def test_bad_inner_specs_are_validation_errors():
    with pytest.raises(ValidationError, match="unknown inner aggregator 'nope'; allowed: .*krum"):
        BucketingParams(inner="nope")
    with pytest.raises(ValidationError, match="detox cannot be an inner rule"):
        NNMParams(inner={"name": "detox"})
    with pytest.raises(ValidationError, match="num_malicious"):
        BucketingParams(inner={"name": "krum", "num_malicious": -1})
    with pytest.raises(ValidationError, match="beta"):
        NNMParams(inner={"name": "median", "beta": 0.1})
    nested = BucketingParams(inner={"name": "nnm", "inner": "median"})  # wrappers nest
    assert nested.model_dump()["inner"] == {"name": "nnm", "inner": {"name": "median"}, "num_malicious": 1}


def test_scenarios_validate_or_name_the_inner_precondition():
    sc = scenario("aggregator={name: bucketing, s: 2, inner: {name: krum, num_malicious: 1}}")  # 10 per round
    assert sc.aggregator.inner.name == "krum"
    with pytest.raises(ScenarioError, match=r"aggregator.inner.num_malicious: bucketing: 10 clients make 4 buckets"):
        scenario("aggregator={name: bucketing, s: 3, inner: {name: krum, num_malicious: 1}}")
    assert scenario("aggregator={name: nnm, num_malicious: 2, inner: median}").aggregator.num_malicious == 2
    assert scenario("aggregator={name: centered_clipping, center: zero}").aggregator.tau == 10.0


def test_pipeline_reports_bucket_members_by_client_id():
    pipe = RoundPipeline(scenario("aggregator={name: bucketing, s: 2, inner: {name: krum, num_malicious: 1}}"))
    updates, weights = make_updates(10, 6, seed=50)
    ids = tuple(range(100, 110))
    out = pipe.run(update_batch(updates, ids, weights), set(), round_context(6, seed=9))
    chosen = out.aggregator["selected"]
    assert len(chosen) == 2 and set(chosen) <= set(ids)
    close(out.aggregate, updates[[c - 100 for c in chosen]].double().mean(0))


@pytest.mark.parametrize("name", ["bucketing", "nnm", "centered_clipping"])
def test_each_rule_works_inside_detox(name):
    unique, weights = make_updates(9, 12, seed=51)
    redundant = unique.repeat_interleave(3, dim=0)
    expected = rule(name)(unique, weights)  # DETOX passes no context: fixed seed, zero center
    close(detox(redundant, weights.repeat_interleave(3), inner=name), expected)
