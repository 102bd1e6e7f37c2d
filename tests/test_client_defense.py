"""A defense's client part (the registry's `client_training`) and its inference part (`inference`):
honest clients train through it, attackers never do, cohort training steps aside, the evaluator
measures the model the defense deploys with its rejection rule, and the scenarios it cannot run
with are refused at validation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import TAIL_ATTACK, quick_scenario, run_local
from fedsim.client import cohort as cohort_module
from fedsim.client.cohort import cohort_refusal
from fedsim.client.steps import client_defense, local_update
from fedsim.cohort.store import cohort_store
from fedsim.defenses import flip as flip_module
from fedsim.runtime import Runtime
from fedsim.scenario import ScenarioError
from fedsim.server.evaluation import CentralEvaluator

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ATTACK = TAIL_ATTACK
FLIP = {"name": "flip", "warmup_steps": 5, "steps": 3, "confidence_threshold": 0.0}


class Spy:
    """Stands in for FLIP's client part: records who called it, returns a zero update."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int, int]] = []  # (round, partition id, examples)

    def __call__(self, spec, job):
        self.calls.append((job.rnd, job.pid, len(job.x)))
        job.memory["spy.rounds"] = np.append(job.memory.get("spy.rounds", np.zeros(0, np.int64)), job.rnd)
        return torch.zeros_like(job.global_vec), {"loss": 0.0}


def test_no_client_defense_without_one():
    assert client_defense(Runtime(quick_scenario())) is None
    assert client_defense(Runtime(quick_scenario(defenses=[{"name": "norm_clipping"}]))) is None
    spec, fn = client_defense(Runtime(quick_scenario(defenses=[{"name": "norm_clipping"}, FLIP])))
    assert spec.name == "flip" and fn is flip_module.flip_train


def test_hook_trains_honest_clients_only_and_cohort_training_steps_aside(tmp_path, monkeypatch):
    spy, grouped = Spy(), []
    monkeypatch.setattr(flip_module, "flip_train", spy)
    monkeypatch.setattr(cohort_module, "train_group", lambda group: grouped.append(group))
    scenario = quick_scenario(attack=ATTACK, defenses=[FLIP])
    rt = Runtime(scenario)
    assert "defense flip trains the honest clients its own way" in cohort_refusal(rt)
    rounds = run_local(scenario, tmp_path).rounds  # the LocalGrid hands its cohorts to prepare_cohort
    called = {(r, p) for r, p, _ in spy.calls}
    expected = {(line["round"], p) for line in rounds for p in line["sampled"] if p not in line["attackers"]}
    assert called == expected and len(spy.calls) == len(expected)
    assert all(line["attackers"] for line in rounds)  # an attacker in every round, never through the hook
    assert grouped == []  # no cohort was trained together


def test_update_a_cohort_left_is_not_taken_and_memory_is_the_clients(monkeypatch):
    spy = Spy()
    monkeypatch.setattr(flip_module, "flip_train", spy)
    rt = Runtime(quick_scenario(defenses=[FLIP]))
    start = rt.initial_weights()
    cohort_store(rt)[1, 0] = (start, "a cohort's update")  # what take_pretrained would hand back
    memory: dict = {}
    result = local_update(rt, 0, start, 1, {}, memory)
    assert spy.calls == [(1, 0, len(rt.client_data(0)[1]))] and torch.equal(result.delta, torch.zeros_like(start))
    local_update(rt, 0, start, 2, {}, memory)
    assert memory["spy.rounds"].tolist() == [1, 2]  # the dict it is given is the one it gets next round


def test_evaluator_measures_the_deployed_model_with_its_rejection():
    rt = Runtime(quick_scenario(defenses=[{**FLIP, "confidence_threshold": 0.6}]))
    ev = CentralEvaluator(rt)
    # four inputs whose first pixel selects a row of fixed logits
    table = torch.tensor([[4.0, 0.0, 0.0], [1.0, 0.9, 0.0], [0.0, 5.0, 0.0], [0.0, 0.0, 0.1]])
    ev.x = np.zeros((4, 1, 8, 8), np.float32)
    ev.x[:, 0, 0, 0] = np.arange(4)
    ev.y = np.array([0, 0, 2, 2])
    ev.backdoor, ev.beyond_clean, ev.source = None, None, None

    class Fixed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def forward(self, x):
            return table[x[:, 0, 0, 0].long()] + self.w

    conf = torch.softmax(table, 1).amax(1)
    pred = table.argmax(1).numpy()
    accepted = (conf >= 0.6).numpy()
    assert accepted.tolist() == [True, False, True, False]
    # by hand: input 0 correct and confident, 1 correct (class 0) but rejected, 2 wrong, 3 correct (argmax 2) but rejected
    assert (pred == ev.y).tolist() == [True, True, False, True]
    out = ev(Fixed())
    assert out["main_accuracy"] == pytest.approx(1 / 4)
    ev.inference = []  # without the defense: three of four
    assert ev(Fixed())["main_accuracy"] == pytest.approx(3 / 4)


@pytest.mark.parametrize("extra,field", [
    ({"secure_aggregation": "secaggplus", "defenses": [{"name": "lockdown"}]}, "defenses.0"),  # FLIP runs under it
    ({"aggregator": {"name": "fedma"}}, "defenses"),
    ({"aggregator": {"name": "detox", "group_size": 3, "redundancy": True}}, "aggregator.redundancy"),
    ({"defenses": [FLIP, {"name": "lockdown"}]}, "defenses.1"),
])
def test_protocols_that_cannot_run_a_client_part_are_refused(extra, field):
    raw = {"federation": {"num_clients": 6, "clients_per_round": 6}, "defenses": [FLIP], **extra}
    with pytest.raises(ScenarioError) as err:
        quick_scenario(**raw)
    assert any(p[0] == field for p in err.value.problems), err.value.problems


def test_vectorize_on_is_refused_with_a_client_part():
    from fedsim.preflight import vectorize_problems

    problems = vectorize_problems(Runtime(quick_scenario("federation.vectorize=on", defenses=[FLIP])))
    assert problems and "defense flip trains the honest clients its own way" in problems[0][1]
