"""Tables of the asynchrony sweeps (docs/asynchrony.md), printed from finished sweep folders.

Run the sweeps first (each a few minutes on two cores, scikit-learn's digits, no data directory):
    fedsim sweep scenarios/sweeps/asynchrony_attacks.yaml
    fedsim sweep scenarios/sweeps/asynchrony_defenses.yaml
    fedsim sweep scenarios/sweeps/asynchrony_time.yaml
then `.venv/bin/python benchmarks/asynchrony.py results/asynchrony_attacks results/asynchrony_defenses
results/asynchrony_time` (any of them). Each folder's runs are named by the sweep's cases
(`protocol_fedbuff__threat_alie__defense_median__seed_0`); a table is printed per folder:

- attacks (protocol x threat): final main accuracy and backdoor success (mean over seeds, each
  seed in brackets), the attackers' share of the updates the rule used, the mean staleness of the
  attackers' and the honest clients' updates, and the simulated time the 400 updates took;
- defenses (defense x protocol x threat): final main accuracy / backdoor success, and the
  attackers' share of the updates the rule used (after filters, and a choosing rule's choice);
- time (protocol): simulated seconds to each of the scenario's `systems.targets` (per seed), the
  final accuracy and the whole run's simulated time.

Simulated times come from the federation clock (devices, networks and the bytes and samples each
client really processed), not from this machine: nothing here is timed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from statistics import mean


def runs(folder: Path) -> list[dict]:
    out = []
    for run in sorted(p for p in folder.iterdir() if (p / "summary.json").exists()):
        case = dict(part.split("_", 1) for part in run.name.split("__") if "_" in part)
        summary = json.loads((run / "summary.json").read_text())
        rounds = [json.loads(line) for line in (run / "rounds.jsonl").read_text().splitlines() if line.strip()]
        out.append({"case": case, "summary": summary, "rounds": [r for r in rounds if r["round"] > 0]})
    return out


def share_and_staleness(rounds: list[dict]) -> tuple[float, float | None, float | None]:
    """Attackers' share of the updates the rule used (not removed by a defense, not left out by a
    choosing rule: the detection audit's `flagged`); mean staleness of attackers' and honest updates."""
    bad = total = 0
    stale = {True: [], False: []}
    for r in rounds:
        flagged = set((r.get("detection") or {}).get("flagged", []))
        aggregated = [p for p in r.get("aggregated") or [] if p not in flagged]
        attackers = set(r.get("attackers") or [])
        bad += sum(p in attackers for p in aggregated)
        total += len(aggregated)
        for pid, s in (r.get("staleness") or {}).items():
            stale[int(pid) in attackers].append(s)
    return (bad / total if total else 0.0), (mean(stale[True]) if stale[True] else None), \
        (mean(stale[False]) if stale[False] else None)


def cell(values: list[float | None], percent: bool = True) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    scale, fmt = (100, "{:.1f}") if percent else (1, "{:.2f}")
    each = "/".join(fmt.format(scale * v) for v in values)
    return f"{fmt.format(scale * mean(values))} ({each})" if len(values) > 1 else each


def group(rs: list[dict], *keys: str) -> dict[tuple, list[dict]]:
    out: dict[tuple, list[dict]] = {}
    for r in rs:
        out.setdefault(tuple(r["case"].get(k, "-") for k in keys), []).append(r)
    return out


def attacks_table(rs: list[dict]) -> None:
    print("| threat | protocol | main acc. % | backdoor % | attackers' share of used updates % | staleness attackers / honest "
          "| simulated s |")
    print("|---|---|---|---|---|---|---|")
    for (threat, protocol), cases in sorted(group(rs, "threat", "protocol").items()):
        stats = [share_and_staleness(r["rounds"]) for r in cases]
        s_att = [s[1] for s in stats if s[1] is not None]
        s_hon = [s[2] for s in stats if s[2] is not None]
        staleness = (f"{mean(s_att):.2f} / {mean(s_hon):.2f}" if s_att and s_hon else "0 / 0 (synchronous)")
        print(f"| {threat} | {protocol} | {cell([r['summary']['final_main_accuracy'] for r in cases])} "
              f"| {cell([r['summary']['final_backdoor_success'] for r in cases])} | {cell([s[0] for s in stats])} "
              f"| {staleness} | {cell([r['summary']['federation_time']['sim_time'] for r in cases], percent=False)} |")


def defenses_table(rs: list[dict]) -> None:
    by = group(rs, "defense", "protocol", "threat")
    defenses = sorted({k[0] for k in by}, key=lambda d: [r["case"].get("defense") for r in rs].index(d))
    protocols = sorted({k[1] for k in by}, key=lambda p: p != "sync")
    threats = sorted({k[2] for k in by}, reverse=True)
    head = [f"{t} / {p}" for t in threats for p in protocols]
    print("| defense | " + " | ".join(head) + " |")
    print("|---|" + "---|" * len(head))
    print("| | " + " | ".join("acc. % / backdoor % / attackers' share of used %" if t == "edge_case" else
                               "acc. % / attackers' share of used %" for t in threats for _ in protocols) + " |")
    for d in defenses:
        cells = []
        for t in threats:
            for p in protocols:
                cases = by.get((d, p, t), [])
                acc = cell([r["summary"]["final_main_accuracy"] for r in cases])
                share = cell([share_and_staleness(r["rounds"])[0] for r in cases])
                if t == "edge_case":
                    cells.append(f"{acc} / {cell([r['summary']['final_backdoor_success'] for r in cases])} / {share}")
                else:
                    cells.append(f"{acc} / {share}")
        print(f"| {d} | " + " | ".join(cells) + " |")


def time_table(rs: list[dict]) -> None:
    targets = sorted({t for r in rs for t in r["summary"]["federation_time"]["time_to_accuracy"]}, key=float)
    print("| protocol | " + " | ".join(f"to {float(t):.0%} (s)" for t in targets) + " | final acc. % | simulated s |")
    print("|---|" + "---|" * (len(targets) + 2))
    for (protocol,), cases in sorted(group(rs, "protocol").items(), key=lambda kv: kv[0][0] != "sync"):
        cells = []
        for t in targets:
            reached = [r["summary"]["federation_time"]["time_to_accuracy"].get(t) for r in cases]
            cells.append("/".join("never" if x is None else f"{x['sim_time']:.2f}" for x in reached))
        print(f"| {protocol} | " + " | ".join(cells) + f" | {cell([r['summary']['final_main_accuracy'] for r in cases])} "
              f"| {cell([r['summary']['federation_time']['sim_time'] for r in cases], percent=False)} |")


def main(folders: list[str]) -> int:
    if not folders:
        print(__doc__)
        return 2
    for name in folders:
        folder = Path(name)
        rs = runs(folder)
        if not rs:
            print(f"{folder}: no finished runs")
            continue
        print(f"\n{folder.name} ({len(rs)} runs)\n")
        if all("defense" in r["case"] for r in rs):
            defenses_table(rs)
        elif all("threat" in r["case"] for r in rs):
            attacks_table(rs)
        else:
            time_table(rs)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
