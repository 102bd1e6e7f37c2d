"""DnC (aggregators/dnc.py) and SignGuard (aggregators/signguard.py) against independent oracles.

Oracles: plain-loop references written here (numpy's SVD for DnC; Python loops around
scikit-learn's MeanShift for SignGuard, the clustering the official SignGuard code calls), hand
computations on small examples, and properties (no filtering is the mean, far or sign-flipped
attackers are removed, determinism under a seed, permutation equivariance, non-finite rows).
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from pydantic import ValidationError
from sklearn.cluster import MeanShift, estimate_bandwidth

from conftest import QUICKSTART, quick_scenario, round_context
from update_samples import make_updates
from fedsim.aggregators import AggregationError
from fedsim.aggregators.dnc import DnCParams, dnc, dnc_select, dnc_with_info, sample_coordinates
from fedsim.aggregators.signguard import (
    SignGuardParams, sign_block, signguard, signguard_select, signguard_with_info,
)
from fedsim.registry import AGGREGATORS
from fedsim.scenario import ScenarioError
from fedsim.server.pipeline import RoundPipeline
from fedsim.updates import RoundContext, UpdateBatch

# ---------------------------------------------------------------- inputs




def mostly_positive(n: int, d: int, seed: int) -> torch.Tensor:
    """Honest-looking updates: about 84 % of the coordinates positive, similar norms."""
    gen = torch.Generator().manual_seed(seed)
    return (0.3 + 0.3 * torch.randn(n, d, generator=gen)).float()


def ctx(seed: int = 0, d: int = 1) -> RoundContext:
    return round_context(d, seed=seed)


def loop_mean(rows: np.ndarray, picked) -> np.ndarray:
    return np.array([statistics.fmean(float(rows[i, c]) for i in picked) for c in range(rows.shape[1])])


# ---------------------------------------------------------------- DnC: numpy reference


def slow_dnc(rows: np.ndarray, f: int, c: float, coordinate_sets) -> list[int]:
    """Algorithm 2 of the paper with numpy's SVD and Python loops; ties to the lower index."""
    n = len(rows)
    keep_count = n - math.ceil(round(c * f, 9))
    kept = set(range(n))
    for coords in coordinate_sets:
        sub = rows[:, list(coords)].astype(np.float64)
        mu = [statistics.fmean(sub[:, j]) for j in range(sub.shape[1])]
        centred = np.array([[sub[i, j] - mu[j] for j in range(sub.shape[1])] for i in range(n)])
        v = np.linalg.svd(centred, full_matrices=False)[2][0]
        scores = [sum(centred[i, j] * v[j] for j in range(len(v))) ** 2 for i in range(n)]
        kept &= set(sorted(range(n), key=lambda i: (scores[i], i))[:keep_count])
    return sorted(kept)


@pytest.mark.parametrize("n,f,c", [(7, 1, 1.0), (10, 2, 1.0), (12, 3, 1.5), (15, 4, 1.0), (9, 2, 0.5)])
def test_dnc_on_all_coordinates_matches_numpy_svd_reference(n, f, c):
    updates, weights = make_updates(n, 30, seed=10 * n + f)
    rows = updates.numpy()
    expected = slow_dnc(rows, f, c, [range(30)])
    out, info = dnc_with_info(updates, weights, num_malicious=f, filter_frac=c, niters=1, subsample_dim=30)
    assert info["selected"] == expected and len(expected) == n - math.ceil(c * f)
    np.testing.assert_allclose(out.numpy(), loop_mean(rows, expected), rtol=1e-5, atol=1e-6)
    # b > d samples every coordinate too, whatever the generator
    assert torch.equal(dnc(updates, weights, num_malicious=f, filter_frac=c, subsample_dim=10_000, ctx=ctx(3)), out)


@pytest.mark.parametrize("niters", [2, 4])
def test_dnc_intersection_over_coordinate_subsets_matches_reference(niters):
    updates, weights = make_updates(14, 60, seed=niters)
    rng = np.random.default_rng(niters)
    subsets = [np.sort(rng.choice(60, size=12, replace=False)) for _ in range(niters)]
    expected = slow_dnc(updates.numpy(), 3, 1.0, subsets)
    ours = dnc_select(updates, 3, 1.0, [torch.from_numpy(s) for s in subsets])
    assert ours.tolist() == expected
    single = [set(slow_dnc(updates.numpy(), 3, 1.0, [s])) for s in subsets]
    assert set(expected) == set.intersection(*single)


def test_dnc_coordinate_samples_are_seeded_distinct_sorted_and_capped():
    draws = sample_coordinates(500, 40, 3, torch.Generator().manual_seed(1))
    again = sample_coordinates(500, 40, 3, torch.Generator().manual_seed(1))
    other = sample_coordinates(500, 40, 3, torch.Generator().manual_seed(2))
    assert len(draws) == 3 and all(torch.equal(a, b) for a, b in zip(draws, again))
    assert any(not torch.equal(a, b) for a, b in zip(draws, other))
    for coords in draws:
        values = coords.tolist()
        assert len(set(values)) == 40 and values == sorted(values) and 0 <= values[0] and values[-1] < 500
    assert not torch.equal(draws[0], draws[1])  # each iteration draws afresh
    assert [c.tolist() for c in sample_coordinates(20, 10_000, 2, torch.Generator())] == [list(range(20))] * 2


def test_dnc_rule_draws_its_coordinates_from_the_context_generator():
    updates, weights = make_updates(12, 200, seed=5)
    out, info = dnc_with_info(updates, weights, num_malicious=2, niters=3, subsample_dim=15, ctx=ctx(7))
    coords = sample_coordinates(200, 15, 3, torch.Generator().manual_seed(7))
    expected = slow_dnc(updates.numpy(), 2, 1.0, [c.tolist() for c in coords])
    assert info["selected"] == expected
    np.testing.assert_allclose(out.numpy(), loop_mean(updates.numpy(), expected), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("f,c", [(0, 1.0), (3, 0.0)])
@pytest.mark.parametrize("b,niters", [(10_000, 1), (7, 5)])
def test_dnc_without_filtering_is_the_plain_mean(f, c, b, niters):
    updates, weights = make_updates(9, 40, seed=3)
    out, info = dnc_with_info(updates, weights, num_malicious=f, filter_frac=c, niters=niters, subsample_dim=b, ctx=ctx(1))
    assert info["selected"] == list(range(9))
    np.testing.assert_allclose(out.numpy(), loop_mean(updates.numpy(), range(9)), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- SignGuard: loop reference


def slow_signguard(rows: np.ndarray, lower: float, upper: float, start: int, k: int, quantile: float, seed: int):
    """The official code's steps with Python loops; MeanShift from scikit-learn as the code calls it."""
    n = len(rows)
    rows = np.where(np.isnan(rows), 0.0, rows)
    norms = [math.sqrt(sum(float(x) ** 2 for x in row)) for row in rows]
    median = statistics.median(norms)  # np.median semantics
    by_norm = {i for i in range(n) if lower * median < norms[i] < upper * median}
    counts = [[sum(1 for x in row[start : start + k] if test(x)) / k for test in (lambda x: x > 0, lambda x: x == 0, lambda x: x < 0)]
              for row in rows]
    maxima = [max(counts[i][j] for i in range(n)) for j in range(3)]
    features = np.array([[counts[i][j] / (maxima[j] + 1e-8) for j in range(3)] for i in range(n)])
    bandwidth = estimate_bandwidth(features, quantile=quantile, n_samples=50, random_state=seed)
    labels = MeanShift(bandwidth=bandwidth, bin_seeding=True, cluster_all=False).fit(features).labels_
    sizes = Counter(int(label) for label in labels if label >= 0)
    biggest = min(label for label, size in sizes.items() if size == max(sizes.values()))
    kept = sorted(by_norm & {i for i in range(n) if labels[i] == biggest})
    return kept, norms, features


def slow_clipped_mean(rows: np.ndarray, picked, norms) -> np.ndarray:
    bound = sorted(norms)[(len(norms) - 1) // 2]  # torch.median: the lower middle value
    scaled = [[float(x) * min(1.0, bound / norms[i]) for x in rows[i]] for i in picked]
    return np.array([statistics.fmean(col) for col in zip(*scaled)])


def signguard_case(seed: int) -> torch.Tensor:
    """13 updates: 8 mostly positive, 3 sign-flipped copies, one huge, one tiny (so both filters act)."""
    honest = mostly_positive(8, 300, seed)
    return torch.cat([honest, -honest[:3], 40.0 * honest[3:4], 0.01 * honest[4:5]])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_signguard_selection_matches_loop_reference(seed):
    updates = signguard_case(seed)
    start, k = 37 + seed, 30
    expected, norms, features = slow_signguard(updates.numpy(), 0.1, 3.0, start, k, 0.5, seed)
    ours, our_norms = signguard_select(updates, 0.1, 3.0, start, k, 0.5, seed)
    assert ours.tolist() == expected
    np.testing.assert_allclose(our_norms.numpy(), norms, rtol=1e-9)
    assert not {8, 9, 10, 11, 12} & set(expected)  # flipped, huge and tiny rows are all out


@pytest.mark.parametrize("seed", [0, 4])
def test_signguard_rule_averages_its_selection_clipped_to_the_median_norm(seed):
    updates = signguard_case(seed)
    weights = torch.arange(1.0, 14.0)
    out, info = signguard_with_info(updates, weights, ctx=ctx(seed))
    rows = updates.numpy()
    norms = [math.sqrt(sum(float(x) ** 2 for x in row)) for row in rows]
    np.testing.assert_allclose(out.numpy(), slow_clipped_mean(rows, info["selected"], norms), rtol=1e-5, atol=1e-7)
    start, k = sign_block(300, 0.1, torch.Generator().manual_seed(seed))
    assert k == 30 and 0 <= start <= 270


def test_signguard_norm_filter_and_clipping_by_hand():
    # Every row points along u = [.5, .5, .5, .5] (norm 1), so all sign features coincide: one
    # cluster (the zero-bandwidth case), and only the norm filter and the clipping act.
    u = torch.full((4,), 0.5)
    weights = torch.ones(8)
    # odd n: median norm M = 3; keep 0.3 < norm < 9 (strict: 9 itself is out); clip to 3
    odd = torch.tensor([4.0, 0.25, 9.0, 1.0, 5.0, 2.0, 3.0])[:, None] * u
    out, info = signguard_with_info(odd, weights[:7])
    assert info["selected"] == [0, 3, 4, 5, 6]
    assert torch.allclose(out, torch.full((4,), 0.5 * (1 + 2 + 3 + 3 + 3) / 5))
    # even n: the filter's M is np.median = (3 + 5) / 2 = 4, keep 0.4 < norm < 12; the clipping
    # bound is torch.median, the lower middle norm 3 (the official code's two medians)
    even = torch.tensor([5.0, 40.0, 1.0, 0.25, 8.0, 3.0, 6.0, 2.0])[:, None] * u
    out, info = signguard_with_info(even, weights)
    assert info["selected"] == [0, 2, 4, 5, 6, 7]
    assert torch.allclose(out, torch.full((4,), 0.5 * (3 + 1 + 3 + 3 + 3 + 2) / 6))
    # other bounds
    out, info = signguard_with_info(even, weights, lower=0.5, upper=1.5)
    assert info["selected"] == [0, 5]  # 2 < norm < 6
    assert torch.allclose(out, torch.full((4,), 0.5 * 3.0))


def test_signguard_removes_sign_flipped_attackers_of_ordinary_norm():
    honest = mostly_positive(11, 2000, seed=3)
    updates = torch.cat([honest, -honest[:4]])  # same norms as honest rows: only the signs differ
    weights = torch.ones(15)
    for seed in range(3):
        _, info = signguard_with_info(updates, weights, ctx=ctx(seed))
        assert info["selected"] == list(range(11))


# ---------------------------------------------------------------- both: properties


def far_identical_attackers(n: int, f: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    updates, weights = make_updates(n, d, seed)
    updates[n - f :] = -50.0 + 0.1 * updates[0]  # f identical updates, far away and sign-flipped
    weights[n - f :] = 1e6  # large claimed datasets must not help
    return updates, weights


@pytest.mark.parametrize("n,f", [(10, 2), (15, 4), (20, 6)])
def test_far_group_of_identical_attackers_is_removed_by_dnc(n, f):
    updates, weights = far_identical_attackers(n, f, 200, seed=n)
    honest = list(range(n - f))
    for b, niters in ((10_000, 1), (10, 3)):
        out, info = dnc_with_info(updates, weights, num_malicious=f, niters=niters, subsample_dim=b, ctx=ctx(n))
        assert info["selected"] == honest
        np.testing.assert_allclose(out.numpy(), loop_mean(updates.numpy(), honest), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n,f", [(10, 2), (15, 4), (20, 6)])
def test_far_group_of_identical_attackers_is_removed_by_signguard(n, f):
    updates, weights = far_identical_attackers(n, f, 2000, seed=n)
    out, info = signguard_with_info(updates, weights, ctx=ctx(n))
    assert info["selected"] == list(range(n - f))
    norms = [math.sqrt(sum(float(x) ** 2 for x in row)) for row in updates.numpy()]
    np.testing.assert_allclose(out.numpy(), slow_clipped_mean(updates.numpy(), range(n - f), norms), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name,params", [("dnc", {"num_malicious": 2, "niters": 3, "subsample_dim": 20}), ("signguard", {})])
def test_same_seed_same_result_and_selection_is_permutation_equivariant(name, params):
    entry = AGGREGATORS.get(name)
    with_info = entry.traits.with_info
    assert entry.traits.with_context is True
    updates = torch.cat([mostly_positive(11, 400, seed=8), -mostly_positive(3, 400, seed=9)])
    weights = torch.ones(14)
    first = with_info(updates, weights, **params, ctx=ctx(11))
    second = with_info(updates, weights, **params, ctx=ctx(11))
    assert torch.equal(first[0], second[0]) and first[1] == second[1]
    assert torch.equal(entry.obj(updates, weights, **params, ctx=ctx(11)), first[0])
    perm = torch.randperm(14, generator=torch.Generator().manual_seed(2))
    permuted = with_info(updates[perm], weights[perm], **params, ctx=ctx(11))
    assert sorted(perm[permuted[1]["selected"]].tolist()) == first[1]["selected"]
    np.testing.assert_allclose(permuted[0].numpy(), first[0].numpy(), rtol=1e-5, atol=1e-6)


def test_dnc_different_seeds_sample_different_coordinates():
    updates, weights = make_updates(12, 300, seed=4)
    picks = {tuple(dnc_with_info(updates, weights, 3, 1.0, 1, 5, ctx=ctx(s))[1]["selected"]) for s in range(8)}
    assert len(picks) > 1  # 5 of 300 coordinates: the kept set depends on which


def test_non_finite_rows_are_never_averaged():
    updates, weights = make_updates(11, 40, seed=42)
    updates[3, 5] = float("nan")
    updates[8] = float("inf")
    out, info = dnc_with_info(updates, weights, num_malicious=2)
    assert not {3, 8} & set(info["selected"]) and torch.isfinite(out).all()
    out, info = dnc_with_info(updates, weights, num_malicious=1)  # more bad rows than c*f: still out
    assert not {3, 8} & set(info["selected"]) and len(info["selected"]) == 9 and torch.isfinite(out).all()
    # SignGuard: as in the official code, NaN entries count as 0; an infinite norm fails the norm filter
    out, info = signguard_with_info(updates, weights)
    assert 8 not in info["selected"] and torch.isfinite(out).all()


# ---------------------------------------------------------------- preconditions and wiring


def test_preconditions_raise_and_match_round_problem():
    updates, weights = make_updates(5, 10, seed=1)
    with pytest.raises(AggregationError, match=r"dnc needs n > ceil\(c\*f\).*n=5, f=5"):
        dnc(updates, weights, num_malicious=5)
    with pytest.raises(AggregationError, match=r"n=5, f=3, c=1.5"):
        dnc(updates, weights, num_malicious=3, filter_frac=1.5)  # ceil(4.5) = 5 removed
    assert dnc(updates, weights, num_malicious=4).shape == (10,)  # keeps one
    assert DnCParams(num_malicious=4).round_problem(5) is None
    assert DnCParams(num_malicious=5).round_problem(5)[0] == "num_malicious"
    assert DnCParams(num_malicious=3, filter_frac=1.5).round_problem(5) is not None
    with pytest.raises(AggregationError, match=r"signguard needs int\(bandwidth_quantile \* n\) >= 2.*n=3"):
        signguard(updates[:3], weights[:3])
    assert SignGuardParams().round_problem(3)[0] == "bandwidth_quantile"
    assert SignGuardParams().round_problem(4) is None
    assert SignGuardParams(bandwidth_quantile=0.1).round_problem(19) is not None
    assert SignGuardParams(bandwidth_quantile=0.1).round_problem(200) is None
    assert SignGuardParams(bandwidth_quantile=0.03).round_problem(200) is not None  # the estimate uses 50 rows at most
    with pytest.raises(ValidationError):
        SignGuardParams(lower=3.0, upper=3.0)
    with pytest.raises(AggregationError, match="no update passed both filters"):
        signguard(torch.zeros(6, 10), torch.ones(6))  # median norm 0: no norm is above 0.1 * 0


def test_defaults_are_the_papers():
    assert DnCParams().model_dump() == {"num_malicious": 1, "filter_frac": 1.0, "niters": 1, "subsample_dim": 10_000}
    assert SignGuardParams().model_dump() == {"lower": 0.1, "upper": 3.0, "coordinate_share": 0.1, "bandwidth_quantile": 0.5}
    for params in (DnCParams, SignGuardParams):
        assert all(field.description for field in params.model_fields.values())


def scenario(*overrides: str):
    return quick_scenario("attack=null", *overrides, base=QUICKSTART)


@pytest.mark.parametrize("spec,rule", [
    ("{name: dnc, num_malicious: 1}", lambda u, w, c: dnc_with_info(u, w, num_malicious=1, ctx=c)),
    ("signguard", lambda u, w, c: signguard_with_info(u, w, ctx=c)),
])
def test_pipeline_passes_the_context_and_reports_selected_client_ids(spec, rule):
    pipe = RoundPipeline(scenario(f"aggregator={spec}", "defenses=[]"))
    updates = torch.cat([mostly_positive(9, 300, seed=1), 30.0 * torch.ones(1, 300)])
    ids = tuple(range(100, 110))
    out = pipe.run(UpdateBatch(updates, torch.ones(10), ids), set(), ctx(5, d=300))
    expected, info = rule(updates, torch.ones(10), ctx(5, d=300))
    assert out.skipped is None and torch.equal(out.aggregate, expected)
    assert out.aggregator["selected"] == [ids[i] for i in info["selected"]] and 109 not in out.aggregator["selected"]


def test_scenarios_that_can_never_aggregate_are_refused():
    with pytest.raises(ScenarioError, match="dnc needs n > ceil"):
        scenario("aggregator={name: dnc, num_malicious: 10}")  # clients_per_round = 10
    with pytest.raises(ScenarioError, match="bandwidth_quantile"):
        scenario("aggregator={name: signguard, bandwidth_quantile: 0.1}")
    assert scenario("aggregator={name: dnc, num_malicious: 9}").aggregator.num_malicious == 9
    assert scenario("aggregator=signguard").aggregator.name == "signguard"


def test_duck_typed_context_is_enough():
    updates, weights = make_updates(8, 50, seed=2)
    plain = SimpleNamespace(generator=torch.Generator().manual_seed(3))
    assert torch.equal(dnc(updates, weights, subsample_dim=10, ctx=plain),
                       dnc(updates, weights, subsample_dim=10, ctx=ctx(3)))
