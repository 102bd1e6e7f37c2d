"""Regenerate the golden rounds.jsonl metrics that tests/test_golden.py compares against (issue #17).

Run this ONLY when a change is meant to alter a run's metrics (a new default, a fixed bug in the
training or aggregation maths, ...), and say so in the commit message together with the reason:
the goldens are the guard that refactors (validation, upload checks, engine moves) leave every
valid run's numbers exactly as they were. A refactor that makes tests/test_golden.py fail is a
regression to fix, not a reason to regenerate.

    .venv/bin/python tests/golden/make_golden.py            # all scenarios, into tests/golden/
    .venv/bin/python tests/golden/make_golden.py detox      # one scenario

To record from an older commit's code (as the first goldens were, from 8f604e1), from this
checkout's root (the old commit in a worktree beside it, run with this checkout's venv):

    REPO=$PWD && git worktree add ../golden-base <commit>
    cp tests/golden/make_golden.py ../golden-base/tests/golden/
    cd ../golden-base && PYTHONPATH=$PWD "$REPO/.venv/bin/python" \
        tests/golden/make_golden.py --out "$REPO/tests/golden"

Each golden file holds the rounds.jsonl lines of one small in-process run (LocalGrid, no Ray) of
scenarios/quickstart.yaml or scenarios/fedma/digits_mlp.yaml with the overrides in SCENARIOS,
without the wall-clock fields (fedsim.server.record.TIME_FIELDS); everything else in a line is kept.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
if str(REPO / "tests") not in sys.path:
    sys.path.insert(0, str(REPO / "tests"))  # local_grid


QUICKSTART = "scenarios/quickstart.yaml"
FEDMA = "scenarios/fedma/digits_mlp.yaml"
SMALL = ["federation.num_clients=8", "federation.clients_per_round=5"]
TOPK = SMALL + ["federation.rounds=5", "attack.schedule.every=2", "attack.schedule.first=1",
                "compression={name: topk, fraction: 0.05}"]  # topk keeps its error feedback by default

# name -> (scenario file, overrides, kill after this round and resume; None: one uninterrupted run)
SCENARIOS: dict[str, tuple[str, list[str], int | None]] = {
    "quickstart": (QUICKSTART, [], None),  # as shipped: 15 rounds, 10 of 20 clients
    "robust_defense": (QUICKSTART, [
        "federation.rounds=4", "federation.num_clients=10", "federation.clients_per_round=7",
        "attack.schedule.every=2", "attack.schedule.first=1",
        "aggregator={name: multikrum, num_malicious: 1}",
        "defenses=[{name: norm_clipping, delta: 1.0}]",
    ], None),
    "topk_error_feedback": (QUICKSTART, TOPK, None),
    "cuttlefish": (QUICKSTART, SMALL + [
        "federation.rounds=5", "federation.clients_per_round=4", "model.hidden=[64, 64]",
        "attack.schedule.every=2",
        "lowrank={name: cuttlefish, window: 2, tail: 2, min_rounds: 2, threshold: 100.0}",
    ], None),
    "detox": (QUICKSTART, [
        "federation.rounds=3", "federation.num_clients=16", "federation.clients_per_round=15",
        "federation.local_epochs=1",
        "aggregator={name: detox, group_size: 3, inner: multikrum}",  # 5 groups: multikrum f=1 needs 5
    ], None),
    "fedma": (FEDMA, [
        "federation.num_clients=4", "federation.clients_per_round=4", "federation.rounds=2",
        "federation.local_epochs=2", "aggregator.retrain_epochs=2", "federation.round_timeout=60",
    ], None),
    # scenario topk_error_feedback with checkpoints, killed right after round 2's line, then resumed
    "resume_topk": (QUICKSTART, TOPK, 2),
}


class Killed(Exception):
    """As if the process died right after a round's line was written (tests/test_resume.py)."""


def strip(rounds: list[dict]) -> list[dict]:
    from fedsim.server.record import without_times

    return without_times(rounds)


def run_scenario(name: str, parent: Path) -> list[dict]:
    """Run scenario `name` in-process under `parent`; its rounds.jsonl lines without the times."""
    from fedsim.client.app import make_client_app
    from fedsim.runs.folder import RunFolder
    from fedsim.runs.results import read_rounds
    from fedsim.scenario import load_scenario
    from fedsim.server.app import run_server
    from fedsim.flower.local_grid import LocalGrid

    path, overrides, kill_after = SCENARIOS[name]
    scenario = load_scenario(str(REPO / path), overrides)
    run_dir = RunFolder.create(scenario, parent).path

    def once(kill=None) -> None:
        def progress(record):
            if kill is not None and record["round"] == kill:
                raise Killed
        state_dir = RunFolder(run_dir).client_states if kill_after is not None else None  # the clients' own state folder
        grid = LocalGrid(make_client_app(scenario, state_dir), scenario.federation.num_clients)  # fresh node contexts
        run_server(grid, scenario, run_dir, progress, checkpoints=kill_after is not None)

    if kill_after is not None:
        try:
            once(kill_after)
        except Killed:
            pass
        else:
            raise AssertionError(f"{name}: the run was not killed after round {kill_after}")
        done = [r["round"] for r in read_rounds(run_dir)]
        assert max(done) == kill_after, f"{name}: killed run holds rounds {done}"
    once()
    return strip(read_rounds(run_dir))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", default=list(SCENARIOS), help="scenarios (default: all)")
    parser.add_argument("--out", type=Path, default=HERE, help="folder for the golden files")
    args = parser.parse_args()
    import fedsim

    print(f"fedsim from {Path(fedsim.__file__).parent}", file=sys.stderr)
    for name in args.names:
        with tempfile.TemporaryDirectory() as tmp:
            rounds = run_scenario(name, Path(tmp))
        out = args.out / f"{name}.json"
        out.write_text(json.dumps(rounds, indent=1, sort_keys=True) + "\n")
        print(f"{name}: {len(rounds)} rounds -> {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
