"""The server-kill campaign of tests/test_chaos_server.py, with its figures printed (README, "Faults").

    .venv/bin/python benchmarks/chaos.py [--errors ENOSPC,EACCES] [--keep DIR]

The scenario of the test (quickstart, 3 rounds, 6 clients, 3 a round, an attacker every other round,
FoolsGold, top-k with error feedback: every kind of state a resume restores) is run whole once in a
real process that lists its writes, then once per kill point: a process SIGKILLed before that write
(or, torn, inside it; or with that write and every later one failing with a full disk / a read-only
folder), then resumed in a fresh process. Each resumed run is compared with the whole run: every
rounds.jsonl line (times left out), summary.json, the final global model bit for bit, and no temp
file left. Nothing here is timed but the campaign's wall clock.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from kill_points import campaign  # noqa: E402
from test_chaos_server import OVERRIDES  # noqa: E402

from fedsim.scenario import load_scenario  # noqa: E402


def kind(point) -> str:
    if point.error:
        return f"write fails ({point.error})"
    return "killed inside a write" if point.torn else "killed before a write"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--errors", default="ENOSPC,EACCES", help="errno names injected at each opening (comma-separated)")
    parser.add_argument("--keep", type=Path, default=None, help="keep the runs in this folder (default: a temp folder)")
    args = parser.parse_args()
    scenario = load_scenario(REPO / "scenarios/quickstart.yaml", OVERRIDES)
    workdir = args.keep or Path(tempfile.mkdtemp(prefix="fedsim-chaos-"))
    workdir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    errors = tuple(e for e in args.errors.split(",") if e)
    points, outcomes = campaign(scenario, workdir, log=lambda line: print(line, flush=True), errors=errors)
    seconds = time.perf_counter() - started
    by_kind, same = Counter(kind(o.point) for o in outcomes), Counter(kind(o.point) for o in outcomes if o.identical)
    print()
    print("| fault injected | points | resumed identically |")
    print("|---|---:|---:|")
    for name in by_kind:
        print(f"| {name} | {by_kind[name]} | {same[name]} |")
    lost = sum(o.lines_lost for o in outcomes)
    print(f"\n{len(outcomes)} faults injected into a real server process, {sum(same.values())} runs resumed "
          f"identically, {lost} rounds.jsonl records lost; {seconds:.0f} s on this machine")
    return 0 if all(o.identical for o in outcomes) and lost == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
