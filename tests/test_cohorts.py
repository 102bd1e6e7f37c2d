"""Cohort execution: the engine hands an actor several messages in one task, and the ClientApp
trains a cohort's honest clients together (fedsim/engine/cohorts.py, fedsim/client/cohort.py).

Oracles: the sequential path (the same scenario with `federation.vectorize: off`, every client
trained alone) for the metrics; a count of the sequential trainer's calls for who trained where;
the schema for what is refused."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from conftest import quick_scenario, run_local

from fedsim.engine.cohorts import Cohort, WorkerCounts, cohorts_of
from fedsim.scenario import ScenarioError


def message(run_id: int, n: int):
    return SimpleNamespace(metadata=SimpleNamespace(run_id=run_id), n=n)


def test_a_sweep_is_dealt_round_robin_into_one_cohort_per_worker_and_run():
    msgs = [message(1, i) for i in range(7)] + [message(2, 100)]
    cohorts = cohorts_of(msgs, workers=3)
    assert all(isinstance(c, Cohort) for c in cohorts)
    assert [[m.n for m in c] for c in cohorts] == [[0, 3, 6], [1, 4], [2, 5], [100]]  # largest-first order dealt
    assert [len(c) for c in cohorts_of(msgs[:2], workers=8)] == [1, 1]  # never an empty cohort


def test_worker_counts_follow_the_workers_of_each_queue():
    counts, q1, q2 = WorkerCounts(), object(), object()
    assert counts.of(q1) == 1  # before any worker started: one cohort
    counts.join(q1), counts.join(q1), counts.join(q2)
    assert (counts.of(q1), counts.of(q2)) == (2, 1)
    counts.leave(q1)
    assert counts.of(q1) == 1


def final_metrics(run) -> dict:
    return {k: v for k, v in run.rounds[-1].items() if k in ("accuracy", "loss", "train_loss")}


@pytest.fixture
def count_sequential_training(monkeypatch):
    """Each call of the sequential trainer (`fedsim.training.train`, honest clients and attackers): its examples."""
    import fedsim.client.steps as steps
    import fedsim.training as training

    calls = []
    real = training.train

    def counting(model, x, y, cfg, seed, *a, **k):
        calls.append(len(x))
        return real(model, x, y, cfg, seed, *a, **k)

    monkeypatch.setattr(steps, "train", counting)
    monkeypatch.setattr(training, "train", counting)
    return calls


def test_a_vectorised_cohort_gives_the_sequential_runs_metrics(tmp_path, count_sequential_training):
    scenario = quick_scenario("federation.momentum=0.9", "federation.weight_decay=0.0005", "federation.batch_size=16")
    off = run_local(scenario.model_copy(update={"federation": scenario.federation.model_copy(update={"vectorize": "off"})}),
                    tmp_path / "off")
    trained_alone = len(count_sequential_training)
    on = run_local(scenario.model_copy(update={"federation": scenario.federation.model_copy(update={"vectorize": "on"})}),
                   tmp_path / "on")
    assert trained_alone == 6 and len(count_sequential_training) == 6  # 3 clients x 2 rounds, alone only when off
    a, b = final_metrics(off), final_metrics(on)
    assert a.keys() == b.keys() and a
    for key in a:  # fp32 rounding of the vectorised steps only (fedsim/cohort/vectorized.py states the tolerance)
        assert math.isclose(a[key], b[key], rel_tol=1e-4, abs_tol=1e-5), (key, a[key], b[key])


def test_a_vectorised_run_is_reproducible_bit_for_bit(tmp_path):
    scenario = quick_scenario("federation.vectorize=on")
    first = run_local(scenario, tmp_path / "a")
    second = run_local(scenario, tmp_path / "b")
    drop = ("time", "seconds", "timing")
    strip = [[{k: v for k, v in line.items() if not any(d in k for d in drop)} for line in run.rounds]
             for run in (first, second)]
    assert strip[0] == strip[1]


def test_attackers_and_unvectorisable_models_train_alone(tmp_path, count_sequential_training):
    from fedsim.cohort.store import cohort_store
    from fedsim.runtime import runtime_for

    scenario = quick_scenario("federation.vectorize=on", "federation.rounds=1", "federation.clients_per_round=6",
                              attack={"name": "label_flip", "attacker_ids": [1, 4]})
    rt = runtime_for(scenario)
    (line,) = run_local(scenario, tmp_path / "attack").rounds
    assert line["attackers"] and len(line["sampled"]) > len(line["attackers"])
    attackers_data = sorted(rt.client_size(pid, attacking=True) for pid in line["attackers"])
    assert sorted(count_sequential_training) == attackers_data  # only attackers trained alone
    assert not cohort_store(rt)  # every update the cohort trained was claimed
    auto = quick_scenario("federation.vectorize=auto", "federation.rounds=1", model={"name": "resnet20"},
                          data={"dataset": "digits"})
    count_sequential_training.clear()
    run_local(auto, tmp_path / "bn")
    assert len(count_sequential_training) == 3  # BatchNorm: auto trains each client alone


def test_vectorize_on_is_refused_where_clients_cannot_train_vectorised():
    from fedsim.preflight import preflight

    with pytest.raises(ScenarioError, match="federation.vectorize"):
        preflight(quick_scenario("federation.vectorize=on", model={"name": "resnet20"}))
    with pytest.raises(ScenarioError, match="federation.vectorize.*secaggplus"):
        preflight(quick_scenario("federation.vectorize=on", secure_aggregation={"name": "secaggplus"}))
    with pytest.raises(ScenarioError, match="vectorize"):
        quick_scenario("federation.vectorize=sometimes")


def test_a_client_whose_global_model_differs_trains_alone():
    from fedsim.cohort.store import cohort_store, take_pretrained
    from fedsim.client.steps import LocalResult
    from fedsim.runtime import runtime_for

    rt = runtime_for(quick_scenario())
    start = torch.zeros(4)
    cohort_store(rt)[3, 1] = (start, LocalResult(torch.ones(4), 5, {"loss": 0.1}))
    assert take_pretrained(rt, 3, 1, torch.ones(4)) is None  # another model: not this update
    cohort_store(rt)[3, 1] = (start, LocalResult(torch.ones(4), 5, {"loss": 0.1}))
    assert take_pretrained(rt, 3, 1, start.clone()).num_examples == 5
    assert take_pretrained(rt, 3, 1, start) is None  # claimed once
