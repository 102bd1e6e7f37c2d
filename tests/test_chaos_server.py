"""The server process killed with SIGKILL between any two of its writes (tests/kill_points.py):
`--resume` finds a consistent state and ends bit for bit where the uninterrupted run ends, and no
round line already written is lost.

The scenario has everything a resume must restore: a stateful defense (FoolsGold's history), an
attacker every other round, clients with memory (top-k error feedback, in the run folder's
client-state files), three rounds so that an old checkpoint is pruned. The default run kills at a
few points of each kind; the slow one at every write and at every write cut in half.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kill_points import campaign, kill_points, run_child
from fedsim.scenario import load_scenario

REPO = Path(__file__).resolve().parents[1]
OVERRIDES = ["federation.rounds=3", "federation.num_clients=6", "federation.clients_per_round=3",
             "attack.schedule.every=2", "attack.schedule.first=2", "defenses=[foolsgold]",
             "compression={name: topk, fraction: 0.05}"]

pytestmark = pytest.mark.chaos


def scenario():
    return load_scenario(REPO / "scenarios/quickstart.yaml", OVERRIDES)


def one_of_each_kind(points):
    """A torn rounds.jsonl line, a client's state file and a checkpoint killed before their rename, the
    removal of a pruned checkpoint, the summary's temp file cut in half."""
    def first(test):
        return next(p for p in points if test(p))

    return [
        first(lambda p: p.torn and p.event == "open rounds.jsonl" and p.number > 10),
        first(lambda p: p.event.startswith("rename checkpoint/clients/")),
        first(lambda p: p.event.startswith("rename checkpoint/.round-2")),
        first(lambda p: p.event.startswith("remove checkpoint/round-")),
        first(lambda p: p.torn and ".summary.json" in p.event),
    ]


def test_writes_of_a_run_are_the_kill_points(tmp_path):
    """The events the campaign kills at are the run's real writes: each round's client states,
    checkpoint and line, a pruned checkpoint, the summary; each temp file is renamed."""
    from kill_points import new_run

    run = new_run(scenario(), tmp_path, "whole")
    run_child(run, tmp_path / "events")
    events = (tmp_path / "events").read_text().splitlines()
    assert events.count("open rounds.jsonl") == 3
    assert sum(e.startswith("rename checkpoint/.round-") for e in events) == 3
    assert sum(e.startswith("rename checkpoint/clients/") for e in events) == 9  # 3 clients a round
    assert events[-1] == "rename " + events[-2].split(" ", 1)[1] + " -> summary.json"
    assert "remove checkpoint/round-1.pt" in events
    opened = [e.split(" ", 1)[1] for e in events if e.startswith("open ") and ".tmp" in e]
    assert all(any(e.startswith(f"rename {o} -> ") for e in events) for o in opened)
    assert len(kill_points(events)) == len(events) + len(opened) + 3


def test_killed_at_one_point_of_each_kind_resumes_identically(tmp_path):
    points, outcomes = campaign(scenario(), tmp_path, select=one_of_each_kind, log=lambda _: None)
    assert len(outcomes) == 5
    assert [o.problems for o in outcomes] == [[]] * 5 and all(o.lines_lost == 0 for o in outcomes)


@pytest.mark.slow
def test_killed_at_every_write_resumes_identically(tmp_path):
    points, outcomes = campaign(scenario(), tmp_path, log=print)
    failed = {o.point.label: o.problems for o in outcomes if not o.identical}
    assert not failed and len(outcomes) == len(points) and sum(o.lines_lost for o in outcomes) == 0


@pytest.mark.slow
@pytest.mark.simulation
def test_fedsim_run_killed_on_ray_resumes_identically(tmp_path):
    """The real `fedsim run` (Ray-simulated clients) SIGKILLed before round 2's line and while writing
    round 3's checkpoint; `fedsim run --resume` ends as the run left alone."""
    from fedsim.runs.results import read_rounds
    from fedsim.server.record import without_times

    def fedsim(root: Path, kill_at: int, *argv: str) -> int:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}
        return subprocess.run([sys.executable, str(REPO / "tests/kill_points.py"), "cli", str(root),
                               str(root / "events"), str(kill_at), *argv], env=env, capture_output=True,
                              text=True, timeout=300, cwd=REPO).returncode

    args = ["run", str(REPO / "scenarios/quickstart.yaml"), *[a for o in OVERRIDES for a in ("--set", o)]]
    whole = tmp_path / "whole"
    assert fedsim(whole, 0, *args, "--output", str(whole)) == 0
    events = (whole / "events").read_text().splitlines()
    (reference,) = [p for p in whole.iterdir() if p.is_dir()]
    second_line = [i for i, e in enumerate(events) if e.endswith("/rounds.jsonl")][1] + 1
    third_checkpoint = next(i for i, e in enumerate(events) if ".round-3.pt.tmp" in e) + 1
    for kill_at in (second_line, third_checkpoint):
        root = tmp_path / f"cut-{kill_at}"
        assert fedsim(root, kill_at, *args, "--output", str(root)) == -signal.SIGKILL
        (cut,) = [p for p in root.iterdir() if p.is_dir()]
        assert fedsim(root, 0, "run", "--resume", str(cut)) == 0
        assert without_times(read_rounds(cut)) == without_times(read_rounds(reference))
