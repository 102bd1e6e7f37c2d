"""The edge-case attacker's modes, schedules and the normal-case variants, against their definitions."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attacks.edge_case import replacement_factor
from attacks.schedules import EveryRound, ExplicitRounds, FixedFrequency, FixedPool, sample_round
from fedsim.client_app import local_update
from fedsim.runtime import Runtime
from fedsim.scenario import validate_scenario


def runtime(**attack) -> Runtime:
    spec = {"name": "edge_case", "attacker_ids": [3], **attack}
    return Runtime(validate_scenario({"seed": 5, "federation": {"num_clients": 10, "lr": 0.1}, "attack": spec}))


CONFIG = {"server-round": 1, "lr": 0.1, "round_total_examples": 830}


def attacker_update(rt: Runtime) -> tuple[torch.Tensor, int]:
    delta, n, _ = local_update(rt, 3, rt.initial_weights(), 1, CONFIG)
    return delta, n


def test_attacker_dataset_is_edge_plus_clean():
    rt = runtime(num_edge=30, num_clean=50)
    x, y = rt.attack.training_set(rt, 3)
    edge = rt.attack.edge_set(rt)
    assert len(x) == 80 and (y[:30] == 1).all()
    np.testing.assert_array_equal(x[:30], edge.x_train[:30])
    # the clean part keeps true labels: each clean row is a training row with its own label
    rows = {r.tobytes(): lab for r, lab in zip(rt.data.x_train, rt.data.y_train)}
    assert all(rows[r.tobytes()] == lab for r, lab in zip(x[30:], y[30:]))


def test_blackbox_update_is_unconstrained_and_pgd_stays_inside_eps():
    free, _ = attacker_update(runtime(mode="blackbox"))
    eps = 0.3 * float(torch.linalg.vector_norm(free))
    projected, _ = attacker_update(runtime(mode="pgd", eps=eps, project_every=3))
    assert torch.linalg.vector_norm(free) > eps
    assert torch.linalg.vector_norm(projected) <= eps * (1 + 1e-5)


def test_replacement_scales_by_exactly_the_inverse_weight():
    pgd, n = attacker_update(runtime(mode="pgd", eps=0.5))
    replaced, _ = attacker_update(runtime(mode="pgd_replacement", eps=0.5))
    gamma = replacement_factor(CONFIG["round_total_examples"], n)
    assert gamma == pytest.approx(830 / 166)
    torch.testing.assert_close(replaced, pgd * gamma, rtol=1e-6, atol=1e-7)


def test_fit_clip_bound_makes_the_scaled_update_fit():
    delta, n = attacker_update(runtime(mode="pgd_replacement", fit_clip_bound=1.0))
    assert torch.linalg.vector_norm(delta) <= 1.0 * (1 + 1e-5)
    rt = runtime(mode="pgd_replacement", fit_clip_bound=1.0)
    assert rt.attack.radius({**CONFIG, "num_examples": n}) == pytest.approx(n / 830)


def test_eps_decays_with_the_round():
    rt = runtime(mode="pgd", eps=2.0, eps_decay=0.9)
    assert rt.attack.radius({"server-round": 3}) == pytest.approx(2.0 * 0.81)


@pytest.mark.parametrize("variant, pool", [("normal", "rest"), ("almost_edge", "next")])
def test_normal_case_variants_give_honest_clients_true_labels(variant, pool):
    rt = runtime(honest_copies=variant, honest_copy_share=0.3, num_edge=20)
    holders = rt.attack._copy_holders(rt)
    assert len(holders) == 3 and 3 not in holders  # the attacker never holds the copies
    edge = rt.attack.edge_set(rt)
    got = [rt.attack.honest_extra_data(rt, h) for h in holders]
    xs = np.concatenate([g[0] for g in got])
    expected = edge.x_train[20:] if pool == "rest" else edge.x_train[20:40]
    np.testing.assert_array_equal(xs, expected)
    assert all((g[1] == 7).all() for g in got)  # true label: the source class
    others = [c for c in range(10) if c not in holders]
    assert all(rt.attack.honest_extra_data(rt, c) is None for c in others)
    n_plain = len(rt.partitions[holders[0]])
    assert len(rt.client_data(holders[0])[1]) == n_plain + len(got[0][1])


def test_fixed_frequency_replaces_one_sampled_client():
    rng = np.random.default_rng(0)
    for rnd in range(1, 13):
        sampled, strikers = sample_round(FixedFrequency(every=4, first=2), rnd, 30, 10, [7, 9], rng)
        assert len(sampled) == 10 and len(set(sampled)) == 10
        if rnd in (2, 6, 10):
            assert len(strikers) == 1 and strikers[0] in sampled
        else:
            assert strikers == [] and 7 not in sampled and 9 not in sampled


def test_every_round_and_explicit_rounds():
    rng = np.random.default_rng(0)
    assert all(sample_round(EveryRound(), r, 20, 5, [1], rng)[1] == [1] for r in range(1, 6))
    hits = [r for r in range(1, 10) if sample_round(ExplicitRounds(rounds=[2, 5]), r, 20, 5, [1], rng)[1]]
    assert hits == [2, 5]


def test_fixed_pool_attackers_are_the_sampled_pool_members():
    rng = np.random.default_rng(1)
    pool = list(range(0, 40, 2))
    seen = 0
    for rnd in range(1, 30):
        sampled, strikers = sample_round(FixedPool(), rnd, 40, 10, pool, rng)
        assert strikers == [c for c in sampled if c in pool]
        seen += len(strikers)
    assert 0.3 < seen / (29 * 10) < 0.7  # half the clients are in the pool: about half the seats
