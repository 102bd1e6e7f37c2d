"""The round driver (fedsim/server/driver.py) without Flower: what a round is made of, checked by hand.

The strategy is a thin adapter over it; these tests open rounds, aggregate hand-made batches and
resume from a checkpoint with no grid, no message and no Flower import."""

from __future__ import annotations

import subprocess
import sys

import torch
from conftest import quick_scenario, update_batch

from fedsim.runs.checkpoint import load_server
from fedsim.runs.folder import RunFolder
from fedsim.runtime import runtime_for
from fedsim.server.driver import RoundDriver


def test_the_driver_and_the_round_close_import_no_flower():
    code = ("import sys, fedsim.server.driver, fedsim.server.closing, fedsim.server.pipeline; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'flwr'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_a_round_opens_with_the_seeded_sample_largest_client_first():
    driver = RoundDriver(runtime_for(quick_scenario("federation.clients_per_round=4")))
    plan = driver.open_round(3)
    again = RoundDriver(runtime_for(quick_scenario("federation.clients_per_round=4"))).open_round(3)
    assert plan.sampled == again.sampled == sorted(plan.sampled) and len(plan.sampled) == 4  # seeded by the round
    sizes = [len(driver.rt.partitions[p]) for p in plan.order]
    assert sorted(plan.order) == plan.sampled and sizes == sorted(sizes, reverse=True)
    assert plan.configs[plan.order[0]] == {"server-round": 3, "lr": driver.rt.lr(3)}
    assert driver.pending.round == 3 and driver.pending.sampled == plan.sampled


def test_detox_groups_share_their_first_members_shard():
    sc = quick_scenario("federation.num_clients=9", "federation.clients_per_round=7",
                        aggregator={"name": "detox", "group_size": 3, "inner": "median"})
    plan = RoundDriver(runtime_for(sc)).open_round(1)
    assert [len(g) for g in plan.groups] == [3, 4]  # the last group absorbs the leftovers
    for group in plan.groups:
        assert {plan.configs[p]["data-partition"] for p in group} == {group[0]}


def test_aggregate_steps_the_global_model_by_the_weighted_mean():
    driver = RoundDriver(runtime_for(quick_scenario()))
    plan = driver.open_round(1)
    d = driver.layout.dim
    batch = update_batch(torch.randn(3, d), ids=plan.sampled, weights=[1.0, 2.0, 3.0])
    before = driver.global_vec.clone()
    assert driver.aggregate(batch, set())
    mean = (batch.updates * batch.weights[:, None]).sum(0) / batch.weights.sum()
    assert torch.allclose(driver.global_vec, before + mean, atol=1e-6)
    record = driver.pending
    assert record.aggregated == plan.sampled
    assert record.global_norm == float(torch.linalg.vector_norm(driver.global_vec)) and record.model_params == d


def test_a_checkpoint_resumes_the_same_model_and_round(tmp_path):
    sc = quick_scenario("server.optimizer=adam", "server.lr=0.1")  # an optimizer with state to carry
    folder = RunFolder.create(sc, tmp_path)
    driver = RoundDriver(runtime_for(sc), checkpoint_to=folder)
    for rnd in (1, 2):
        plan = driver.open_round(rnd)
        driver.aggregate(update_batch(torch.randn(3, driver.layout.dim), ids=plan.sampled), set())
        driver.checkpoint(rnd)
    resumed = RoundDriver(runtime_for(sc))
    resumed.resume_from(load_server(folder, at_most=2))
    assert resumed.offset == 2 and torch.equal(resumed.global_vec, driver.global_vec)
    step = update_batch(torch.randn(3, driver.layout.dim), ids=[0, 1, 2])
    for d in (driver, resumed):  # the optimizer's moments came back too: the next step is the same
        d.open_round(3)
        d.aggregate(step, set())
    assert torch.equal(resumed.global_vec, driver.global_vec)
