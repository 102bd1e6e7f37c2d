"""An attacker's memory across its attack rounds and its report of the trigger it planted.

Whole rounds through the real strategy and ClientApp on the in-process grid, with the `trigger`
attack given a memory (a counter) and a report (its count and a trigger value) by monkeypatching:
the counter must grow from one attack round of the same attacker to the next, the server must
measure the backdoor with the report of the round, and the report must not count as upload bytes.
"""

from __future__ import annotations

import numpy as np
import torch

from fedsim.attacks.base import ClientAttack
from fedsim.attacks.trigger import TriggerBackdoor
from fedsim.client.app import make_client_app
from fedsim.flower.local_grid import LocalGrid
from fedsim.runs.checkpoint import load_server
from fedsim.runs.folder import RunFolder
from fedsim.runs.results import read_rounds
from fedsim.scenario import load_scenario
from fedsim.server.app import run_server

SETTINGS = ["federation.rounds=5", "federation.num_clients=8", "federation.clients_per_round=4",
            "attack={name: trigger, size: 2, num_attackers: 1, schedule: {name: fixed_frequency, every: 2, first: 1}}"]


def run(tmp_path, monkeypatch, report: bool):
    seen: list[int] = []  # the count each attack round starts from
    asked: list = []  # the reports the server built backdoor test sets from

    def local_train(self, job):
        seen.append(int(job.memory.get("count", np.zeros(1))[0]))
        job.memory["count"] = np.array([seen[-1] + 1])
        return ClientAttack.local_train(self, job)

    def shared_state(self, job):
        return {"count": job.memory["count"].copy(), "value": np.array([-1.0], dtype=np.float32)} if report else None

    plain = TriggerBackdoor.backdoor_test_set

    def backdoor_test_set(self, runtime, shared=None):
        asked.append(None if shared is None else int(shared["count"][0]))
        x, y = plain(self, runtime)
        if shared is not None:  # the reported value stamped instead of white: another backdoor set
            x = np.where(x == x.max(), shared["value"][0], x).astype(x.dtype)
        return x, y

    monkeypatch.setattr(TriggerBackdoor, "local_train", local_train)
    monkeypatch.setattr(TriggerBackdoor, "shared_state", shared_state)
    monkeypatch.setattr(TriggerBackdoor, "backdoor_test_set", backdoor_test_set)
    scenario = load_scenario("scenarios/quickstart.yaml", SETTINGS)
    run_dir = RunFolder.create(scenario, tmp_path).path
    run_server(LocalGrid(make_client_app(scenario), scenario.federation.num_clients), scenario, run_dir, checkpoints=True)
    return read_rounds(run_dir), seen, asked, run_dir


def test_memory_grows_across_attack_rounds_and_the_report_sets_the_backdoor(tmp_path, monkeypatch):
    rounds, seen, asked, run_dir = run(tmp_path / "a", monkeypatch, report=True)
    attack_rounds = [r["round"] for r in rounds if r["attackers"]]
    assert attack_rounds == [1, 3, 5]
    assert [r["rounds_since_attack"] for r in rounds] == [0, 1, 0, 1, 0]
    assert all(set(r.get("attacker_train_seconds", {})) == {str(a) for a in r["attackers"]} for r in rounds)
    assert all(s > 0 for r in rounds for s in r.get("attacker_train_seconds", {}).values())
    assert seen == [0, 1, 2]  # the same attacker continues from its previous attack round
    # the evaluator's first set (no report yet), then one per attack round, in order
    assert asked == [None, 1, 2, 3]
    saved = load_server(run_dir, 5)
    assert int(saved["extra"]["backdoor_report"]["count"][0]) == 3
    assert torch.equal(saved["extra"]["backdoor_report"]["value"], torch.tensor([-1.0]))

    plain_rounds, plain_seen, plain_asked, _ = run(tmp_path / "b", monkeypatch, report=False)
    assert plain_seen == [0, 1, 2] and plain_asked == [None]
    # the report is a measurement channel: the attacker's upload bytes are the same without it
    assert [r["bytes_up"] for r in rounds] == [r["bytes_up"] for r in plain_rounds]
    # and the backdoor is measured on the reported set from the first attack round on
    assert [r["main_accuracy"] for r in rounds] == [r["main_accuracy"] for r in plain_rounds]
    assert [r["backdoor_success"] for r in rounds] != [r["backdoor_success"] for r in plain_rounds]


def test_rounds_since_attack_after_a_resume_is_found_from_the_seeded_schedule():
    from fedsim.runtime import runtime_for
    from fedsim.server.driver import RoundDriver

    scenario = load_scenario("scenarios/quickstart.yaml", ["federation.rounds=12", "attack.schedule.every=5",
                                                            "attack.schedule.first=2"])
    walked = RoundDriver(runtime_for(scenario))
    expected = [walked.rounds_since_attack(r, bool(walked.sample(r)[1])) for r in range(1, 13)]
    assert expected == [None, 0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0]
    for start in (3, 9, 12):  # a fresh strategy, as after `--resume`, continuing at round `start`
        resumed = RoundDriver(runtime_for(scenario))
        assert resumed.rounds_since_attack(start, bool(resumed.sample(start)[1])) == expected[start - 1]
