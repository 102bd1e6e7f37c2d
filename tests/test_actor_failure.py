"""Failure tolerance through the real Ray backend: a client whose actor process dies mid-round.

Flower's actor pool hands a crashed actor back to the pool, so without a restart policy every later
message routed to it fails too, for the rest of the run. fedsim's simulation asks Ray to restart
client actors (backend_config: max_restarts), and the message that was running when the process
died is retried once on the restarted actor (max_task_retries=1): a one-off crash costs nothing, a
client that crashes its actor every time is reported in rounds.jsonl and the round aggregates the
rest. Messages submitted while the actor restarts wait for it instead of failing.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fedsim.runs.results import read_rounds
from fedsim.scenario import load_scenario
from fedsim.engine.simulate import backend_config, simulate

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.simulation


def test_client_actors_are_restarted_after_a_crash():
    """The actor options ask Ray to restart a dead client actor instead of leaving it dead in the
    pool, and to retry the interrupted message once, not forever (a client that always crashes
    would otherwise restart its actor in a loop)."""
    scenario = load_scenario(REPO / "scenarios/quickstart.yaml")
    resources = backend_config(scenario, verbose=False)["client_resources"]
    assert resources["max_restarts"] != 0 and resources["max_task_retries"] == 1


def test_a_client_whose_actor_dies_is_reported_and_the_rounds_go_on(tmp_path):
    """Partition 2's ClientApp kills its own Ray worker process (os._exit) every time it trains, and
    partition 4's only the first time. The task running when an actor dies is retried once on the
    restarted actor: partition 4 recovers, partition 2 dies again and is reported; both rounds
    aggregate the other 5, and no other client's message is lost to the restarting actor. Messages go
    to the actors in cohorts (fedsim/engine/cohorts.py): a cohort whose task dies is sent again one
    message per task, so partition 2 costs its cohort one extra run, not its cohort's updates."""
    from failing_app import client_app_with_failures

    scenario = load_scenario(REPO / "scenarios/quickstart.yaml", [
        "federation.rounds=2", "federation.num_clients=6", "federation.clients_per_round=6", "attack=null",
    ])
    crashes = tmp_path / "crashes"
    crashes.mkdir()
    folder = str(crashes)

    def crash(pid, rnd):
        if pid == 2 or (pid == 4 and not os.path.exists(os.path.join(folder, "p4-crashed"))):
            with open(os.path.join(folder, f"p{pid}-crashed"), "a") as fh:
                fh.write(f"{rnd}\n")
            os._exit(1)  # the whole actor process dies, as on a segfault or the OOM killer

    app = client_app_with_failures(scenario, crash)
    run_dir = simulate(scenario, run_dir=tmp_path / "run", client_app=app)
    rounds = read_rounds(run_dir)
    assert [r["round"] for r in rounds] == [1, 2]
    for r in rounds:
        assert set(r["rejected"]) == {"2"} and "actor" in r["rejected"]["2"].lower()
        assert r["aggregated"] == [0, 1, 3, 4, 5]
    # each round: partition 2 takes its cohort's task down (unless partition 4 did so first, in round 1),
    # then alone it is run and retried once
    runs = (crashes / "p2-crashed").read_text().split()
    assert runs.count("1") in (2, 3) and runs.count("2") == 3 and len(runs) in (5, 6)
    assert (crashes / "p4-crashed").read_text().split() == ["1"]
