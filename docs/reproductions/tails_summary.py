"""The table in docs/attack-of-the-tails.md, computed from the run folders' rounds.jsonl.

Usage: python docs/reproductions/tails_summary.py results/tails
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def summarize(run: Path) -> dict:
    rounds = [json.loads(line) for line in (run / "rounds.jsonl").read_text().splitlines() if line.strip()]
    start = next((r for r in rounds if r["round"] == 0), None)
    fl = [r for r in rounds if r["round"] > 0]
    hits = [r for r in fl if r["attackers"]]
    bd = [r["backdoor_success"] for r in fl]
    picks = [r for r in hits if "selected" in r.get("aggregator", {})]
    chose_attacker = sum(1 for r in picks if set(r["aggregator"]["selected"]) & set(r["attackers"]))
    sent = [v for r in hits for v in r["attacker_update_norms"].values()]
    return {
        "run": json.loads((run / "summary.json").read_text())["name"] if (run / "summary.json").exists() else run.name,
        "rounds": len(fl),
        "baseline": start["backdoor_success"] if start else None,
        "peak": max(bd), "mean": sum(bd) / len(bd), "final": bd[-1],
        "acc0": start["main_accuracy"] if start else None, "acc": fl[-1]["main_accuracy"],
        "sent_norm": sum(sent) / len(sent),
        "honest_norm": sum(r["honest_update_norm_median"] for r in fl) / len(fl),
        "krum": f"{chose_attacker}/{len(picks)}" if picks else "-",
    }


def main(folder: Path) -> None:
    fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    print("| run | rounds | backdoor, round 0 | peak | mean | final | main acc, round 0 → 20 | attacker ‖Δ‖ sent | honest median ‖Δ‖ | Krum chose the attacker |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for run in sorted(p.parent for p in folder.glob("*/summary.json")):  # finished runs only
        s = summarize(run)
        print(f"| {s['run']} | {s['rounds']} | {fmt(s['baseline'])} | {fmt(s['peak'])} | {fmt(s['mean'])} | {fmt(s['final'])} "
              f"| {fmt(s['acc0'])} → {fmt(s['acc'])} | {s['sent_norm']:.1f} | {s['honest_norm']:.2f} | {s['krum']} |")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "results/tails"))
