"""The edge-case attacker's modes, schedules and the normal-case variants, against their definitions."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedsim.attacks.edge_case import replacement_factor
from fedsim.attacks.schedules import EveryRound, ExplicitRounds, FixedFrequency, FixedPool, sample_round
from fedsim.client.steps import local_update
from fedsim.runtime import Runtime
from fedsim.scenario import validate_scenario


def runtime(**attack) -> Runtime:
    spec = {"name": "edge_case", "attacker_ids": [3], **attack}
    return Runtime(validate_scenario({"seed": 5, "federation": {"num_clients": 10, "lr": 0.1}, "attack": spec}))


CONFIG = {"server-round": 1, "lr": 0.1, "round_total_examples": 830}


def attacker_update(rt: Runtime) -> tuple[torch.Tensor, int]:
    delta, n, _, _ = local_update(rt, 3, rt.initial_weights(), 1, CONFIG)
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


def test_southwest_planes_on_cifar10_format(tmp_path, real_data_dir):
    """The CIFAR-10 task's edge set: Southwest planes labelled truck (9); honest copies are airplanes (0)."""
    import pickle

    rng = np.random.default_rng(0)
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {b"labels": rng.integers(0, 10, 120).tolist(), b"data": rng.integers(0, 256, (120, 3072), dtype=np.uint8)}
        with open(folder / name, "wb") as f:
            pickle.dump(batch, f)
    (tmp_path / "southwest_edgecase.npz").symlink_to(real_data_dir / "southwest_edgecase.npz")
    scenario = validate_scenario({
        "data": {"dataset": "cifar10", "dir": str(tmp_path)}, "model": "vgg9",
        "federation": {"num_clients": 10},
        "attack": {"name": "edge_case", "attacker_ids": [3], "edge_set": "southwest", "num_edge": 100, "num_clean": 400,
                   "honest_copies": "almost_edge", "honest_copy_share": 0.2},
    })
    rt = Runtime(scenario)
    x, y = rt.attack.training_set(rt, 3)
    assert x.shape == (500, 3, 32, 32) and (y[:100] == 9).all()  # the paper's 100 edge + 400 clean
    x_bd, targets = rt.attack.backdoor_test_set(rt)
    assert x_bd.shape == (196, 3, 32, 32) and (targets == 9).all()
    holder = rt.attack._copy_holders(rt)[0]
    assert (rt.attack.honest_extra_data(rt, holder)[1] == 0).all()
