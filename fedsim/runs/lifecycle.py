"""A backdoor's lifecycle, read off the round lines: when it was implanted, how long it survived
after the attacker stopped, the area under its success curve, and what the attack cost.

Definitions (threshold θ = `evaluation.implant_threshold`, success s_t = `backdoor_success` of
round t, on evaluated training rounds only: round 0, the initial model, never counts):

- `rounds_to_implant`: the first round t with s_t ≥ θ, counted from the first attack round
  (1 = implanted in the round the attack began); None if never.
- `last_attack_round`: the last round in which an attacker took part.
- `lifespan`: rounds after the last attack round until s_t first falls below θ (0 = already
  below θ one round later); None when the run ended first (it survived `rounds_after` rounds) or
  the backdoor never reached θ at the last attack round.
- `half_life`: rounds after the last attack round until s_t ≤ s_last / 2 (s_last: success at the
  last attack round); None when the run ended first.
- `auc`: the mean of s_t over the evaluated training rounds (the area under the success curve,
  normalised to [0, 1]); `auc_after_attack`: the same after the last attack round.
- cost: `attacker_rounds` (attack rounds with an attacker), `attacker_bytes_up` (what the
  attackers uploaded, from `bytes_up_per_client`), `attacker_train_seconds` (client-side
  attackers' local training, as they reported it; wall-clock, so it varies between runs).

The standard durability experiment attacks in listed rounds only (`schedule: {name: rounds,
rounds: [...]}`) and runs on without attack after the last of them.
"""

from __future__ import annotations


def backdoor_lifecycle(rounds: list[dict], threshold: float) -> dict | None:
    """The lifecycle numbers of a run's lines (see the module's doc), or None without a backdoor metric."""
    lines = sorted((r for r in rounds if r.get("round", 0) > 0), key=lambda r: r["round"])
    success = {r["round"]: r["backdoor_success"] for r in lines if r.get("backdoor_success") is not None}
    if not success:
        return None
    attack_rounds = [r["round"] for r in lines if r.get("attackers")]
    def attackers_bytes(line: dict) -> int:
        per_client = {str(k): int(v) for k, v in line.get("bytes_up_per_client", {}).items()}
        return sum(per_client.get(str(a), 0) for a in line.get("attackers", []))

    out: dict = {"threshold": threshold, "attacker_rounds": len(attack_rounds),
                 "attacker_bytes_up": sum(attackers_bytes(r) for r in lines),
                 "attacker_train_seconds": sum(sum(r.get("attacker_train_seconds", {}).values()) for r in lines)}
    values = list(success.values())
    out["auc"] = sum(values) / len(values)
    if not attack_rounds:
        out.update(first_attack_round=None, last_attack_round=None, rounds_to_implant=None, lifespan=None,
                   half_life=None, auc_after_attack=None)
        return out
    first, last = attack_rounds[0], attack_rounds[-1]
    implanted = [t for t, s in success.items() if t >= first and s >= threshold]
    out["first_attack_round"], out["last_attack_round"] = first, last
    out["rounds_to_implant"] = implanted[0] - first + 1 if implanted else None
    after = [(t, s) for t, s in success.items() if t > last]
    out["auc_after_attack"] = sum(s for _, s in after) / len(after) if after else None
    at_last = success.get(last)
    out["lifespan"] = None
    if at_last is not None and at_last >= threshold:
        below = [t for t, s in after if s < threshold]
        out["lifespan"] = below[0] - last - 1 if below else None
    out["half_life"] = None
    if at_last is not None and at_last > 0:
        halved = [t for t, s in after if s <= at_last / 2]
        out["half_life"] = halved[0] - last if halved else None
    out["rounds_after"] = len(after)
    return out
