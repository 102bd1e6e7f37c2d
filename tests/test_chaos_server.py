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

from kill_points import campaign, kill_points, run_child, written_file
from fedsim.scenario import load_scenario

REPO = Path(__file__).resolve().parents[1]
OVERRIDES = ["federation.rounds=3", "federation.num_clients=6", "federation.clients_per_round=3",
             "attack.schedule.every=2", "attack.schedule.first=2", "defenses=[foolsgold]",
             "compression={name: topk, fraction: 0.05}"]

pytestmark = pytest.mark.chaos


def scenario():
    return load_scenario(REPO / "scenarios/quickstart.yaml", OVERRIDES)


def one_of_each_kind(points):
    """A torn rounds.jsonl line; a client's state file and a checkpoint killed before their rename;
    a full disk while writing round 2's checkpoint, a folder turned read-only for round 3's line."""
    def first(test):
        return next(p for p in points if test(p))

    return [
        first(lambda p: p.torn and p.event == "open rounds.jsonl" and p.number > 10),
        first(lambda p: p.event.startswith("rename checkpoint/clients/")),
        first(lambda p: p.event.startswith("rename checkpoint/.round-2")),
        first(lambda p: p.error == "ENOSPC" and ".round-2.pt.tmp" in p.event),
        [p for p in points if p.error == "EACCES" and p.event == "open rounds.jsonl"][2],
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
    assert len(kill_points(events, errors=("ENOSPC",))) == len(events) + 2 * (len(opened) + 3)


def test_killed_or_failing_at_one_point_of_each_kind_resumes_identically(tmp_path):
    """A failed write (the error injected at that write and every write after it, as a full disk
    or a read-only folder stays so) ends the run with exit code 1 and an error naming the file; no
    temp file or half checkpoint is left or used; resumed once writable, the run ends as the run
    left alone. So does a run killed at each point."""
    points, outcomes = campaign(scenario(), tmp_path, select=one_of_each_kind, log=lambda _: None,
                                errors=("ENOSPC", "EACCES"))
    assert len(outcomes) == 5
    assert [o.problems for o in outcomes] == [[]] * 5 and all(o.lines_lost == 0 for o in outcomes)


@pytest.mark.slow
def test_killed_at_every_write_resumes_identically(tmp_path):
    """Every write killed, and every opening torn. (A failing write at every opening too:
    benchmarks/chaos.py; the quick test fails one of each kind.)"""
    points, outcomes = campaign(scenario(), tmp_path, log=print)
    failed = {o.point.label: o.problems for o in outcomes if not o.identical}
    assert not failed and len(outcomes) == len(points) and sum(o.lines_lost for o in outcomes) == 0


@pytest.mark.slow
@pytest.mark.simulation
def test_fedsim_run_killed_on_ray_resumes_identically(tmp_path):
    """The real `fedsim run` (Ray-simulated clients) SIGKILLed while writing round 3's checkpoint
    (round 2's line written, its client actors busy); `fedsim run --resume` ends as the run left alone."""
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
    third_checkpoint = next(i for i, e in enumerate(events) if ".round-3.pt.tmp" in e) + 1
    for kill_at in (third_checkpoint,):
        root = tmp_path / f"cut-{kill_at}"
        assert fedsim(root, kill_at, *args, "--output", str(root)) == -signal.SIGKILL
        (cut,) = [p for p in root.iterdir() if p.is_dir()]
        assert fedsim(root, 0, "run", "--resume", str(cut)) == 0
        assert without_times(read_rounds(cut)) == without_times(read_rounds(reference))



@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs (a real file system that fills up), or a skip where this process may not mount one."""
    disk = tmp_path / "disk"
    disk.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({made.stderr.strip() or made.returncode}): needs root or CAP_SYS_ADMIN")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def pages(size: int) -> int:
    return -(-size // 4096) * 4096  # tmpfs allots whole pages


@pytest.mark.slow
@pytest.mark.simulation
def test_fedsim_run_on_a_disk_that_fills_up_stops_naming_the_file_and_resumes(tmp_path, small_disk):
    """`fedsim run` (Ray) on a real tmpfs with room for round 1 and half of round 2's checkpoint:
    the kernel's ENOSPC ends it with exit code 1 and an error naming round-2.pt and the resume
    command; no temp file is left; once space is freed, `fedsim run --resume` ends as the run left alone."""
    import shutil

    from kill_points import new_run
    from fedsim.runs.results import read_rounds
    from fedsim.server.record import without_times

    plain = OVERRIDES[:-1]  # no client memory: the Ray workers write no state files of their own
    reference = new_run(load_scenario(REPO / "scenarios/quickstart.yaml", plain), tmp_path, "whole")  # its sizes, lines
    run_child(reference, tmp_path / "events")
    checkpoint = (reference / "checkpoint" / "round-3.pt").stat().st_size
    line = len((reference / "rounds.jsonl").read_text().splitlines()[0]) + 1
    room = pages((reference / "scenario.yaml").stat().st_size) + pages(checkpoint) + pages(line) + pages(checkpoint // 2)
    filler = small_disk / "filler"
    filler.write_bytes(b"\0" * (shutil.disk_usage(small_disk).free - room))
    args = ["run", str(REPO / "scenarios/quickstart.yaml"), *[a for o in plain for a in ("--set", o)],
            "--output", str(small_disk)]
    env = {**os.environ, "COLUMNS": "1000"}  # the error on one line
    failed = subprocess.run([sys.executable, "-m", "fedsim.cli", *args], capture_output=True, text=True,
                            timeout=300, cwd=REPO, env=env)
    (cut,) = [p for p in small_disk.iterdir() if p.is_dir()]
    assert failed.returncode == 1, failed.stderr[-2000:]
    assert f"cannot write {cut / 'checkpoint' / 'round-2.pt'}: No space left on device" in failed.stderr, failed.stderr
    assert f"fedsim run --resume {cut}" in failed.stderr
    assert [r["round"] for r in read_rounds(cut)] == [1] and not list(cut.rglob(".*.tmp*"))
    filler.unlink()
    resumed = subprocess.run([sys.executable, "-m", "fedsim.cli", "run", "--resume", str(cut)], capture_output=True,
                             text=True, timeout=300, cwd=REPO)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert without_times(read_rounds(cut)) == without_times(read_rounds(reference))


@pytest.mark.slow
@pytest.mark.simulation
def test_fedsim_sweep_with_a_write_that_fails_stops_naming_the_file_and_reruns_to_the_end(tmp_path):
    """A sweep of two runs (on one Ray engine) whose sixth write fails with ENOSPC, and every one
    after it: exit code 1, an error naming the file and the command that continues; that command
    then finishes both runs."""
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(f"base: {REPO / 'scenarios/quickstart.yaml'}\nname: tiny\n"
                     "federation: {rounds: 2, num_clients: 6, clients_per_round: 3}\nattack: null\nsweep: {seed: [0, 1]}\n")
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]),
           "COLUMNS": "1000"}
    failed = subprocess.run([sys.executable, str(REPO / "tests/kill_points.py"), "cli", str(out), str(tmp_path / "events"),
                             "6:ENOSPC", "sweep", str(sweep), "--output", str(out)], env=env, capture_output=True,
                            text=True, timeout=300, cwd=REPO)
    failing = written_file((tmp_path / "events").read_text().splitlines()[5])
    assert failed.returncode == 1, failed.stderr[-2000:]
    assert f"error: cannot write {out / failing}: No space left on device; the sweep stopped" in failed.stderr
    assert f"continue with: fedsim sweep {sweep} --output {out}" in failed.stderr
    again = subprocess.run([sys.executable, "-m", "fedsim.cli", "sweep", str(sweep), "--output", str(out)],
                           capture_output=True, text=True, timeout=300, cwd=REPO)
    assert again.returncode == 0, again.stderr[-2000:]
    assert all((out / "tiny" / run / "summary.json").exists() for run in ("seed_0", "seed_1"))
