"""The detection audit: what the round's defenses and rule did to the real attackers.

A client is *flagged* when its accepted upload did not reach the aggregate as sent: a filter
removed it (FLAME, and any defense that drops rows), a choosing rule left it out (Krum,
Multi-Krum: not `selected`), or a redundancy vote outvoted it (DETOX: `outvoted`, or a member of a
dropped group). Against the round's attackers among the accepted uploads this gives TP/FP/FN/TN,
TPR, FPR, precision and F1. Two more columns cover the defenses that do not exclude:
`attacker_weight_share`, the attackers' share of the weights that reached the rule (example counts,
or a down-weighting defense's weights such as FoolsGold's), and `clipped`, how many attackers and
honest clients a clipping defense scaled down.

Rates with an empty denominator are None (no attacker this round: no TPR; nothing flagged: no
precision). The run's totals (summary.json) add the counts over rounds before dividing (micro
averages); the false-alarm rate with no attack is the FPR of the rounds in which no attacker took part.
"""

from __future__ import annotations

from typing import Iterable


def _ratio(num: int, den: int) -> float | None:
    return num / den if den else None


def rates(tp: int, fp: int, fn: int, tn: int) -> dict:
    """TPR, FPR, precision and F1 from the four counts (None where undefined)."""
    precision, tpr = _ratio(tp, tp + fp), _ratio(tp, tp + fn)
    f1 = 2 * tp / (2 * tp + fp + fn) if tp else (0.0 if (fp or fn) else None)
    return {"tpr": tpr, "fpr": _ratio(fp, fp + tn), "precision": precision, "f1": f1}


def flagged_clients(accepted: Iterable[int], aggregated: Iterable[int], aggregator: dict | None) -> set[int]:
    """Accepted clients whose upload did not reach the aggregate as sent (see the module's doc)."""
    accepted, reached = set(accepted), set(aggregated)
    flagged = accepted - reached
    info = aggregator or {}
    if "selected" in info:
        flagged |= reached - set(info["selected"])
    flagged |= set(info.get("outvoted", []))
    for group in info.get("dropped", []):
        flagged |= set(group.get("members", []))
    return flagged & accepted


def round_detection(accepted: list[int], attackers: Iterable[int], aggregated: list[int], aggregator: dict | None,
                    defenses: dict, weights: dict[int, float] | None) -> dict:
    """The round's `detection` entry of rounds.jsonl.

    `accepted`: clients whose upload was decoded; `aggregated`: those that reached the rule;
    `weights`: client -> weight at the rule's input (None when the round was skipped before it).
    """
    bad = set(attackers) & set(accepted)
    flagged = flagged_clients(accepted, aggregated, aggregator)
    tp, fp = len(flagged & bad), len(flagged - bad)
    fn, tn = len(bad - flagged), len(set(accepted) - bad - flagged)
    out = {"flagged": sorted(flagged), "tp": tp, "fp": fp, "fn": fn, "tn": tn, **rates(tp, fp, fn, tn)}
    if weights:
        total = sum(weights.values())
        out["attacker_weight_share"] = sum(w for c, w in weights.items() if c in bad) / total if total > 0 else None
    clipped = set()
    for info in defenses.values():
        clipped |= {int(c) for c in info.get("clipped", {})}
    out["clipped"] = {"attackers": len(clipped & bad), "honest": len(clipped - bad)}
    return out


def run_detection(rounds: list[dict]) -> dict | None:
    """Totals over the run's rounds (summary.json), or None when no round has a detection entry."""
    lines = [r for r in rounds if isinstance(r.get("detection"), dict)]
    if not lines:
        return None

    def total(key, which):
        return sum(r["detection"][key] for r in which)

    attacked = [r for r in lines if r["detection"]["tp"] + r["detection"]["fn"] > 0]
    quiet = [r for r in lines if r["detection"]["tp"] + r["detection"]["fn"] == 0]
    counts = {k: total(k, lines) for k in ("tp", "fp", "fn", "tn")}
    shares = [r["detection"]["attacker_weight_share"] for r in attacked
              if r["detection"].get("attacker_weight_share") is not None]
    fp_quiet, tn_quiet = total("fp", quiet), total("tn", quiet)
    return {
        **counts, **rates(**counts),
        "rounds": len(lines), "rounds_with_attackers": len(attacked),
        "false_alarm_rate_without_attackers": _ratio(fp_quiet, fp_quiet + tn_quiet),
        "mean_attacker_weight_share": sum(shares) / len(shares) if shares else None,
        "clipped_attackers": sum(r["detection"]["clipped"]["attackers"] for r in lines),
        "clipped_honest": sum(r["detection"]["clipped"]["honest"] for r in lines),
    }
