"""A run killed mid-way resumes from its last completed round and ends exactly where an
uninterrupted run ends (server state, defense state and client memory all restored)."""

from __future__ import annotations

import pytest

from conftest import run_local
from fedsim.server.record import without_times
from fedsim.runs.folder import RunFolder
from fedsim.runs.results import read_rounds
from fedsim.scenario import load_scenario

OVERRIDES = [
    "federation.rounds=5", "federation.num_clients=8", "federation.clients_per_round=5",
    "attack.schedule.every=2", "defenses=[foolsgold]",
]


class Killed(Exception):
    pass


def metrics(rounds):
    return without_times(rounds)


def run(scenario, run_dir, kill_after=None):
    def progress(record):
        if kill_after is not None and record["round"] == kill_after:
            raise Killed  # as if the process died right after round `kill_after` was written
    # fresh node contexts; each client keeps its memory in its own state folder
    return run_local(scenario, RunFolder(run_dir), progress=progress, checkpoints=True, client_states=True).summary


def killed_beside_full(tmp_path, kill_after: int, extra=()):
    """The scenario run whole, and again killed after round `kill_after`: (scenario, full, cut)."""
    scenario = load_scenario("scenarios/quickstart.yaml", OVERRIDES + list(extra))
    full_dir = RunFolder.create(scenario, tmp_path / "full").path
    run(scenario, full_dir)
    cut_dir = RunFolder.create(scenario, tmp_path / "cut").path
    with pytest.raises(Killed):
        run(scenario, cut_dir, kill_after=kill_after)
    return scenario, full_dir, cut_dir


CLOCK = ("systems={round: {name: over_selection, factor: 1.4}, availability: {offline: 0.2, dropout: 0.2}, "
         "adacomm: {tau0: 4, interval: 0.05}}")  # the clock's time, starts and AdaComm's state resume too
# asynchronous: the clients in flight and waiting, their model versions, the recent honest rows resume too
FEDBUFF = "systems={round: {name: fedbuff, buffer_size: 3}, jitter: 0.3, availability: {offline: 0.2, dropout: 0.2}}"
FEDASYNC = "systems={round: {name: fedasync, alpha: 0.5}, jitter: 0.3}"


@pytest.mark.parametrize("extra", [[], ["evaluation.initial=true"], [CLOCK], [FEDBUFF], [FEDASYNC, "defenses=[norm_clipping]"]])
def test_resumed_run_matches_uninterrupted(tmp_path, extra):
    scenario, full_dir, cut_dir = killed_beside_full(tmp_path, 2, extra)
    assert max(r["round"] for r in read_rounds(cut_dir)) == 2
    summary = run(scenario, cut_dir)  # resume
    assert metrics(read_rounds(cut_dir)) == metrics(read_rounds(full_dir))
    assert summary["rounds_completed"] == 5


def test_lines_without_checkpoint_are_redone(tmp_path):
    scenario, full_dir, cut_dir = killed_beside_full(tmp_path, 3)
    for path in (cut_dir / "checkpoint").glob("round-3.pt"):
        path.unlink()  # the checkpoint of round 3 was lost: round 3 must be recomputed
    run(scenario, cut_dir)
    assert metrics(read_rounds(cut_dir)) == metrics(read_rounds(full_dir))


def test_finished_run_is_not_rerun(tmp_path):
    scenario = load_scenario("scenarios/quickstart.yaml", OVERRIDES)
    run_dir = RunFolder.create(scenario, tmp_path).path
    run(scenario, run_dir)
    before = (run_dir / "rounds.jsonl").read_text()
    run(scenario, run_dir)
    assert (run_dir / "rounds.jsonl").read_text() == before


def test_stateful_rule_and_defense_resume_identically(tmp_path):
    """Centered clipping's previous aggregate and FLDetector's history live in the server checkpoint:
    a run killed after round 3 and resumed ends where the uninterrupted run ends."""
    scenario = load_scenario("scenarios/quickstart.yaml", OVERRIDES + [
        "aggregator={name: centered_clipping, tau: 0.5}", "defenses=[{name: fldetector, window: 2}]",
        "federation.clients_per_round=8"])
    full_dir = RunFolder.create(scenario, tmp_path / "full").path
    run(scenario, full_dir)
    cut_dir = RunFolder.create(scenario, tmp_path / "cut").path
    with pytest.raises(Killed):
        run(scenario, cut_dir, kill_after=3)
    run(scenario, cut_dir)
    assert metrics(read_rounds(cut_dir)) == metrics(read_rounds(full_dir))
    assert any("scores" in r.get("defenses", {}).get("fldetector", {}) for r in read_rounds(full_dir))


def test_a_torn_last_line_is_dropped_and_its_round_redone(tmp_path):
    """A process killed while appending a line leaves it cut short: it is not a record, resume
    redoes its round and the file ends as an uninterrupted run's; damage elsewhere is an error."""
    from fedsim.runs.results import rounds_torn

    scenario, full_dir, cut_dir = killed_beside_full(tmp_path, 3)
    rounds_file = RunFolder(cut_dir).rounds_file
    with open(rounds_file, "a") as fh:
        fh.write('{"round": 4, "sampled": [0, 1')  # the kill came mid-write
    assert rounds_torn(cut_dir) and [r["round"] for r in read_rounds(cut_dir)] == [1, 2, 3]
    run(scenario, cut_dir)  # resume
    assert not rounds_torn(cut_dir) and metrics(read_rounds(cut_dir)) == metrics(read_rounds(full_dir))
    lines = rounds_file.read_text().splitlines()
    rounds_file.write_text("\n".join([lines[0], lines[1][:40], *lines[2:]]) + "\n")
    with pytest.raises(ValueError, match="line 2 is not a round record"):
        read_rounds(cut_dir)


DAMAGE = {
    "truncated": lambda data: data[: len(data) // 2],
    "one bit flipped": lambda data: data[:-100] + bytes([data[-100] ^ 0x04]) + data[-99:],
    "header gone": lambda data: data[40:],
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_newest_checkpoint_is_refused_and_the_older_one_used(tmp_path, caplog, damage):
    """A bit flipped deep in the tensor data still loads with torch.load: only the checksum sees it."""
    import torch

    scenario, full_dir, cut_dir = killed_beside_full(tmp_path, 3)
    newest = RunFolder(cut_dir).checkpoints / "round-3.pt"
    newest.write_bytes(DAMAGE[damage](newest.read_bytes()))
    if damage == "one bit flipped":  # the payload alone would be taken as valid
        from fedsim.runs.checkpoint import HEADER
        torch.load(__import__("io").BytesIO(newest.read_bytes()[len(HEADER) + 32:]), weights_only=True)
    with caplog.at_level("WARNING", logger="fedsim"):
        summary = run(scenario, cut_dir)  # resumes after round 2, redoes round 3
    assert any("round-3.pt is refused" in r.getMessage() for r in caplog.records)
    assert metrics(read_rounds(cut_dir)) == metrics(read_rounds(full_dir)) and summary["rounds_completed"] == 5


def test_a_checkpoint_from_another_scenario_is_refused(tmp_path, caplog):
    """round-3.pt copied in from a run of another seed: refused by its scenario fingerprint, the
    run's own round-2 checkpoint is used and the result is this scenario's."""
    import shutil

    scenario, full_dir, cut_dir = killed_beside_full(tmp_path, 3)
    other = load_scenario("scenarios/quickstart.yaml", OVERRIDES + ["seed=7"])
    other_dir = RunFolder.create(other, tmp_path / "other").path
    with pytest.raises(Killed):
        run(other, other_dir, kill_after=3)
    shutil.copy(RunFolder(other_dir).checkpoints / "round-3.pt", RunFolder(cut_dir).checkpoints / "round-3.pt")
    with caplog.at_level("WARNING", logger="fedsim"):
        run(scenario, cut_dir)
    assert any("round-3.pt is refused: written by another scenario" in r.getMessage() for r in caplog.records)
    assert metrics(read_rounds(cut_dir)) == metrics(read_rounds(full_dir))
