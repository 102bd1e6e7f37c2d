"""DETOX: the majority vote, the group-count bounds, and the hierarchy around the inner rules.

Oracles: rows built so that the vote's answer is known by construction, the worst-case count
floor(q / ceil(r / 2)) from the paper, the hypergeometric expectation checked by enumerating every
placement, and the inner rules applied by hand to the rows that should survive.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from pydantic import ValidationError

from fedsim.aggregators.base import vector_rule_names
import fedsim.aggregators.detox as detox_module
from fedsim.aggregators import AggregationError
from fedsim.aggregators.detox import (
    DetoxParams,
    check_groups,
    consecutive_groups,
    detox,
    detox_with_info,
    effective_byzantine_groups,
    expected_bad_groups,
    majority_vote,
)
from fedsim.aggregators.krum import multikrum
from fedsim.registry import AGGREGATORS
from fedsim.registry import component_kwargs

D = 12
MALICIOUS = torch.full((D,), -100.0)


def honest_rows(count: int, d: int = D, seed: int = 0) -> torch.Tensor:
    """Distinct random rows, one per group (what the group's honest members all send)."""
    return torch.randn(count, d, generator=torch.Generator().manual_seed(seed))


def redundant(unique: torch.Tensor, r: int = 3) -> torch.Tensor:
    """Each unique row repeated r times in a row: groups of honest members sharing data and seed."""
    return unique.repeat_interleave(r, dim=0).clone()


def attacker_rows(P: int, r: int, attackers: list[int]) -> torch.Tensor:
    """P rows in groups of r, honest rows per group, the same malicious row at `attackers`."""
    updates = redundant(honest_rows(P // r), r)
    updates[attackers] = MALICIOUS
    return updates


def groups_won_by_attackers(updates: torch.Tensor, r: int) -> int:
    winners, _ = majority_vote(updates, consecutive_groups(updates.shape[0], r))
    return sum(w is not None and torch.equal(updates[w], MALICIOUS) for w in winners)


# ---------------------------------------------------------------- groups


def test_consecutive_groups_last_absorbs_leftovers():
    assert consecutive_groups(9, 3) == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert consecutive_groups(8, 3) == [[0, 1, 2], [3, 4, 5, 6, 7]]
    assert consecutive_groups(2, 3) == [[0, 1]]
    assert consecutive_groups(3, 1) == [[0], [1], [2]]


def test_groups_must_partition_the_rows():
    assert check_groups(((2, 0), [1]), 3) == [[2, 0], [1]]
    for bad in ([[0, 1], [1, 2]], [[0, 1]], [[0, 1, 2, 3]], [[0, 1, 2], []], []):
        with pytest.raises(ValueError) as err:
            check_groups(bad, 3)
        assert not isinstance(err.value, AggregationError)  # a caller bug, not a round to skip


# ---------------------------------------------------------------- vote


def test_vote_returns_the_majority_row_bit_exactly():
    h = honest_rows(1)[0]
    updates = torch.stack([h + 1.0, h.clone(), h.clone()])
    winners, info = majority_vote(updates, [[0, 1, 2]])
    assert winners == [1]
    assert updates[1].numpy().tobytes() == h.numpy().tobytes()
    assert info["outvoted"] == [0] and info["dropped"] == [] and info["voters"] == [[1, 2]]
    out = detox(updates, torch.ones(3), inner="median")  # one group: the inner rule sees one row
    assert out.numpy().tobytes() == h.numpy().tobytes()


def test_two_byzantine_of_three_win_one_of_three_is_outvoted():
    h0, h1 = honest_rows(2)
    updates = torch.stack([MALICIOUS, MALICIOUS, h0, h1, MALICIOUS, h1])
    winners, info = majority_vote(updates, [[0, 1, 2], [3, 4, 5]])
    assert torch.equal(updates[winners[0]], MALICIOUS)
    assert torch.equal(updates[winners[1]], h1)
    assert info["outvoted"] == [2, 4]


def test_no_majority_drops_the_group():
    rows = honest_rows(5)
    updates = torch.cat([rows[:3], redundant(rows[3:4]), rows[4:5].repeat(2, 1), rows[:1]])
    winners, info = majority_vote(updates, [[0, 1, 2], [3, 4, 5], [6, 7, 8]])
    assert winners == [None, 3, 6]
    assert info["dropped"] == [
        {"group": 0, "members": [0, 1, 2], "reason": "no strict majority: largest agreeing set 1 of 3"}
    ]
    tie = torch.cat([rows[:1].repeat(2, 1), rows[1:2].repeat(2, 1)])  # 2 vs 2 is no strict majority
    assert majority_vote(tie, [[0, 1, 2, 3]])[0] == [None]
    with pytest.raises(AggregationError, match="dropped all 1 groups"):
        detox(rows[:3], torch.ones(3), inner="median")


def test_hash_collisions_never_merge_distinct_rows(monkeypatch):
    monkeypatch.setattr(detox_module, "row_digest", lambda row: b"same")
    h = honest_rows(1)[0]
    one_ulp = torch.nextafter(h, torch.full_like(h, math.inf))
    updates = torch.stack([h, one_ulp, h + 1.0, h, h.clone(), one_ulp])
    winners, info = majority_vote(updates, [[0, 1, 2], [3, 4, 5]])
    assert winners == [None, 3]
    assert info["outvoted"] == [5]


def test_agreement_is_bit_identity_without_nan():
    nan = torch.full((D,), math.nan)
    assert majority_vote(torch.stack([nan, nan, nan]), [[0, 1, 2]])[0] == [None]
    zero = torch.zeros(D)
    assert majority_vote(torch.stack([zero, -zero, zero]), [[0, 1, 2]])[1]["outvoted"] == [1]


# ---------------------------------------------------------------- how many groups attackers win


@pytest.mark.parametrize("q", range(8))
def test_adversarial_placement_wins_exactly_the_worst_case_bound(q):
    P, r = 15, 3
    need = math.ceil(r / 2)  # attackers per group to win it
    attackers = [g * r + k for g in range(P // r) for k in range(need)][: (q // need) * need]
    attackers += [g * r for g in range(q // need, P // r)][: q - len(attackers)]  # the rest alone
    assert len(attackers) == q
    assert groups_won_by_attackers(attacker_rows(P, r, attackers), r) == q // 2
    assert effective_byzantine_groups(q, r) == q // 2


@pytest.mark.parametrize("q", range(8))
def test_random_placement_never_beats_the_bound(q):
    P, r = 15, 3
    gen = torch.Generator().manual_seed(100 + q)
    for _ in range(200):
        attackers = torch.randperm(P, generator=gen)[:q].tolist()
        won = groups_won_by_attackers(attacker_rows(P, r, attackers), r)
        assert won <= effective_byzantine_groups(q, r)


@pytest.mark.parametrize("q", [1, 2, 3, 4])
def test_expected_bad_groups_is_the_mean_over_every_placement(q):
    P, r = 15, 3
    placements = itertools.combinations(range(P), q)
    wins = [groups_won_by_attackers(attacker_rows(P, r, list(c)), r) for c in placements]
    assert sum(wins) / len(wins) == pytest.approx(expected_bad_groups(P, q, r), rel=1e-12)


def test_expected_bad_groups_closed_form():
    # q = 3, r = 3: a group is bad with 2 or 3 attackers: (C(3,2) C(12,1) + C(3,3)) / C(15,3).
    assert expected_bad_groups(15, 3, 3) == pytest.approx(5 * (3 * 12 + 1) / 455, rel=1e-12)
    cases = [(7, 3), (5, 5), (2, 1), (2, 5)]
    assert [effective_byzantine_groups(q, r) for q, r in cases] == [3, 1, 2, 0]


# ---------------------------------------------------------------- the hierarchy


def test_without_redundancy_it_is_the_inner_rule_over_weighted_group_means():
    updates = honest_rows(17, seed=3)
    weights = torch.randint(1, 100, (17,), generator=torch.Generator().manual_seed(4)).float()
    groups = consecutive_groups(17, 3)  # five groups, the last of five rows
    means = torch.stack(
        [sum(weights[i] * updates[i] for i in g) / sum(weights[i] for i in g) for g in groups]
    )
    totals = torch.stack([sum(weights[i] for i in g) for g in groups])
    out = detox(updates, weights, redundancy=False, inner={"name": "multikrum", "num_malicious": 1})
    torch.testing.assert_close(out, multikrum(means, totals, num_malicious=1), rtol=1e-6, atol=1e-6)


def test_median_over_voted_groups_is_the_median_of_the_unique_honest_updates():
    unique = honest_rows(7, seed=5)
    updates = redundant(unique)
    updates[torch.arange(7) * 3 + 1] = MALICIOUS  # one attacker per group: outvoted everywhere
    out, info = detox_with_info(updates, torch.ones(21), inner="median")
    assert torch.equal(out, AGGREGATORS.get("median").obj(unique, torch.ones(7)))
    assert info["outvoted"] == (torch.arange(7) * 3 + 1).tolist()
    assert info["surviving_groups"] == info["inner_inputs"] == 7


def test_super_groups_average_consecutive_winners_before_the_inner_rule():
    unique = honest_rows(9, seed=6)
    member_weights = torch.arange(1, 10).float().repeat_interleave(3)  # group g weighs g + 1
    out = detox(redundant(unique), member_weights, inner="median", super_group_size=2)
    supers = [[0, 1], [2, 3], [4, 5], [6, 7, 8]]
    means = torch.stack([sum((g + 1) * unique[g] for g in s) / sum(g + 1 for g in s) for s in supers])
    expected = AGGREGATORS.get("median").obj(means, torch.ones(4))
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)


def test_winner_weighs_the_least_weight_among_its_voters():
    h0, h1 = honest_rows(2, seed=7)
    updates = torch.stack([h0, h0, h0 + 3.0, h1, h1, h1])
    weights = torch.tensor([10.0, 1e6, 5.0, 30.0, 30.0, 30.0])  # row 1 copies h0 but claims 1e6
    out = detox(updates, weights, inner="fedavg")
    torch.testing.assert_close(out, (10.0 * h0 + 30.0 * h1) / 40.0)


def test_explicit_groups_need_not_be_consecutive():
    unique = honest_rows(5, seed=8)
    order = torch.randperm(15, generator=torch.Generator().manual_seed(9))
    updates = redundant(unique)[order]
    position = torch.argsort(order)  # row of updates that holds original row i
    groups = [position[3 * g : 3 * g + 3].tolist() for g in range(5)]
    out = detox(updates, torch.ones(15), groups=groups, inner="median")
    assert torch.equal(out, AGGREGATORS.get("median").obj(unique, torch.ones(5)))


INNER_NAMES = [name for name in vector_rule_names()
               if not AGGREGATORS.get(name).traits.needs_groups and not AGGREGATORS.get(name).traits.top_level_only]


def test_a_top_level_only_rule_is_refused_as_the_inner_rule():
    with pytest.raises(ValueError, match="fltrust runs only as the scenario.s own aggregator"):
        DetoxParams(inner={"name": "fltrust"})


def test_the_listed_inner_rules_are_all_registered():
    assert {"krum", "multikrum", "median", "trimmed_mean", "bulyan", "rfa", "fedavg"} <= set(INNER_NAMES)


@pytest.mark.parametrize("name", INNER_NAMES)
def test_every_registered_rule_works_as_the_inner_rule(name):
    unique = honest_rows(9, seed=10)  # 9 groups: enough for Bulyan with f = 1 (n >= 7)
    group_weights = torch.arange(5, 14).float()
    updates = redundant(unique)
    weights = group_weights.repeat_interleave(3)
    attackers = torch.arange(9) * 3 + 2
    updates[attackers] = MALICIOUS
    weights[attackers] = 1e6  # outvoted: neither their rows nor their weights count
    entry = AGGREGATORS.get(name)
    expected = entry.obj(unique, group_weights, **entry.params().model_dump())
    assert torch.equal(detox(updates, weights, inner={"name": name}), expected)


def test_params_round_trip_and_strategy_call_agree():
    unique = honest_rows(6, seed=11)
    updates, weights = redundant(unique), torch.ones(18)
    params = DetoxParams(inner={"name": "multikrum", "num_malicious": 1, "num_selected": 3})
    assert params.model_dump()["inner"] == {"name": "multikrum", "num_malicious": 1, "num_selected": 3}
    assert DetoxParams.model_validate(params.model_dump()) == params
    spec = AGGREGATORS.get("detox").spec_model().model_validate({"name": "detox", **params.model_dump()})
    from_yaml = detox(updates, weights, **params.model_dump())
    from_strategy = detox(updates, weights, groups=consecutive_groups(18, 3), **component_kwargs(spec))
    assert torch.equal(from_yaml, from_strategy)
    assert torch.equal(from_yaml, multikrum(unique, torch.ones(6), num_malicious=1, num_selected=3))
    assert DetoxParams(inner="median").inner.name == "median"
    assert DetoxParams(inner={"num_malicious": 2}).inner.name == "multikrum"


def test_bad_inner_specs_are_validation_errors():
    unknown = r"unknown inner aggregator 'nope'; allowed: .*bulyan.*multikrum"
    with pytest.raises(ValidationError, match=unknown):
        DetoxParams(inner={"name": "nope"})
    with pytest.raises(ValidationError, match="detox cannot nest itself"):
        DetoxParams(inner={"name": "detox"})
    with pytest.raises(ValidationError, match="num_malicious"):
        DetoxParams(inner={"name": "krum", "num_malicious": -1})
    with pytest.raises(ValidationError, match="beta"):
        DetoxParams(inner={"name": "median", "beta": 0.1})  # median takes no parameters
    with pytest.raises(ValidationError, match="odd"):
        DetoxParams(group_size=4)


def test_inner_precondition_failure_names_detox_survivors_and_rule():
    rows = honest_rows(5, seed=12)
    updates = redundant(rows)
    updates[0:3] = torch.stack([rows[0], rows[1], rows[2]])  # group 0: no majority
    updates[3:6] = torch.stack([rows[0], rows[1], rows[2]])  # group 1: no majority
    expected = (
        r"detox: inner rule multikrum failed on 3 inputs from 3 surviving groups of 5: "
        r"multikrum needs n >= 2f \+ 3"
    )
    with pytest.raises(AggregationError, match=expected):
        detox(updates, torch.ones(15))


def test_the_round_context_reaches_an_inner_rule_that_reads_it():
    """Centered clipping inside DETOX starts from the previous aggregate the pipeline hands DETOX."""
    from fedsim.aggregators.centered_clipping import centered_clipping
    from fedsim.models.layout import ModelLayout
    from fedsim.updates import RoundContext

    unique = honest_rows(5, seed=12)
    previous = torch.full((unique.shape[1],), 0.3)
    ctx = RoundContext(2, torch.zeros(unique.shape[1]), ModelLayout(names=("w",), shapes=((unique.shape[1],),)),
                       torch.Generator().manual_seed(0), previous_aggregate=previous)
    inner = {"name": "centered_clipping", "tau": 0.05, "center": "previous"}
    got = detox(redundant(unique), torch.ones(15), inner=inner, ctx=ctx)
    want = centered_clipping(unique, torch.ones(5), tau=0.05, center="previous", ctx=ctx)
    assert torch.allclose(got, want)
    assert not torch.allclose(got, centered_clipping(unique, torch.ones(5), tau=0.05, center="previous", ctx=None))
