"""DETOX (Rajput, Wang, Charles, Papailiopoulos, NeurIPS 2019): majority vote in redundant groups,
then a robust rule across the group winners.

Every client of a group of r trains on the same data with the same seed, so honest members send
bit-identical updates. A strict majority vote inside each group keeps the group honest unless
more than half of it is Byzantine; the robust rule then runs on about n / r inputs instead of n,
which is what makes the whole rule nearly linear in n for the quadratic rules (Multi-Krum, Bulyan).

Conventions chosen where the paper and the official code (`hwang595/DETOX`, `draco_lite_master.py`,
`util.group_assign`) differ or say nothing:

- Groups: consecutive runs of r rows; the last group absorbs all leftover rows (the code's
  `group_assign` absorbs one, and silently loses a worker when two are left over). Fewer rows
  than r make one group. The caller may pass explicit `groups` (row indices) instead.
- Vote: on the whole flattened update, not per layer as the code does, so a winner is always one
  client's complete update. Equality is exact: rows are bucketed by a SHA-256 hash of their bytes
  and confirmed with `np.array_equal` (the code's test), so a hash collision cannot merge
  different rows. Agreeing rows are thus bit-identical (0.0 and -0.0 differ) and hold no NaN
  (NaN never equals itself, so rows holding NaN never win). A strict majority of the group's
  actual members (> len(group) / 2) is required; a group without one is dropped and logged. The
  code's Boyer-Moore pass has no verification step and returns its last candidate even with no
  majority.
- Winner weight: the smallest example count among the members that sent the winning update.
  Honest members share one data batch, so this is that batch's count, and a Byzantine member
  that joins a majority can lower its group's weight but never raise it.
- Order of operations: the paper's Figure 1 (vote, optional mean inside super-groups of
  `super_group_size` consecutive winners, then the robust `inner` rule across them). The code's
  `coord-median` mode is this with `inner: median`, except that it shuffles the winners into
  buckets and its `--bucket-size` is the number of buckets, not their size. Its `bulyan` mode is
  `inner: {name: bulyan, selection: krum_single_pass}` without super-groups. Its `multi-krum`
  mode (Multi-Krum on two random halves, then their mean) is not reproduced. Super-group means
  are weighted by the winners' weights and weigh their total.
- The inner rule's f is its own parameter: the worst case after the vote is
  `effective_byzantine_groups(q, r)` = floor(q / ceil(r / 2)) (the code's `effective_s`).
- `redundancy: false` is a degraded, "DETOX-style" hierarchical mode for clients that did not
  share data: no vote, the example-count-weighted mean of each group, weighing the group's total,
  then the inner rule across the groups.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from pydantic import BaseModel, Field, SerializeAsAny, field_validator

from fedsim.aggregators.base import AggregationError, check_inputs, parse_nested_rule, call_rule, vector_rule_names
from fedsim.registry import AGGREGATORS, PROTOCOLS, Params

DEFAULT_INNER = "multikrum"


# ---------------------------------------------------------------- groups


def consecutive_groups(n: int, group_size: int) -> list[list[int]]:
    """Groups of `group_size` consecutive rows; the last one absorbs the leftovers."""
    if group_size < 1:
        raise ValueError(f"detox: group_size must be >= 1, got {group_size}")
    count = max(1, n // group_size)
    groups = [list(range(g * group_size, (g + 1) * group_size)) for g in range(count - 1)]
    return groups + [list(range((count - 1) * group_size, n))]


def check_groups(groups: Sequence[Sequence[int]], n: int) -> list[list[int]]:
    """The groups as lists, after checking that they put every row in exactly one group.

    A wrong grouping is a caller bug, not a round to skip, hence ValueError and not
    AggregationError.
    """
    groups = [[int(i) for i in group] for group in groups]
    if not groups or any(not group for group in groups):
        raise ValueError("detox: groups must be a non-empty list of non-empty groups")
    flat = sorted(i for group in groups for i in group)
    if flat != list(range(n)):
        raise ValueError(
            f"detox: groups must hold every row index 0..{n - 1} exactly once, got {groups}"
        )
    return groups


# ---------------------------------------------------------------- vote


def row_digest(row: np.ndarray) -> bytes:
    """SHA-256 of the row's bytes: bit-identical rows share it, so agreeing rows are found in O(d).

    Any hash would do (equality is confirmed afterwards); SHA-256 runs on the CPU's SHA
    instructions where present, twice as fast as blake2b on this project's hosts.
    """
    return hashlib.sha256(np.ascontiguousarray(row).view(np.uint8)).digest()


def equality_classes(rows: np.ndarray, members: Sequence[int]) -> list[list[int]]:
    """The members split into sets of identical rows, each set in member order.

    Rows agree when their bytes hash alike and `np.array_equal` holds: bit-identical rows without
    NaN. The hash only buckets, so colliding distinct rows stay apart. Both run on numpy views:
    one torch.equal call cost ~15 ms at d = 1e5 on a loaded 2-core host (thread dispatch), numpy
    ~0.1 ms.
    """
    buckets: dict[bytes, list[list[int]]] = {}
    classes: list[list[int]] = []
    for i in members:
        bucket = buckets.setdefault(row_digest(rows[i]), [])
        match = next((c for c in bucket if np.array_equal(rows[c[0]], rows[i])), None)
        if match is None:
            match = [i]
            bucket.append(match)
            classes.append(match)
        else:
            match.append(i)
    return classes


def majority_vote(
    updates: torch.Tensor, groups: Sequence[Sequence[int]]
) -> tuple[list[int | None], dict[str, Any]]:
    """Per group, the first member whose exact update a strict majority sent, or None.

    `info` says which groups were dropped and why, which rows were outvoted (sent something else
    than their group's majority) and, per winner, the rows that voted for it.
    """
    rows = updates.detach().cpu().numpy()
    winners: list[int | None] = []
    dropped: list[dict[str, Any]] = []
    outvoted: list[int] = []
    voters: list[list[int]] = []
    for g, members in enumerate(groups):
        classes = equality_classes(rows, members)
        largest = max(classes, key=len)  # ties go to the earlier class; a tie is no majority
        if 2 * len(largest) > len(members):
            winners.append(largest[0])
            voters.append(largest)
            outvoted.extend(i for i in members if i not in largest)
        else:
            winners.append(None)
            voters.append([])
            dropped.append({
                "group": g,
                "members": list(members),
                "reason": f"no strict majority: largest agreeing set {len(largest)} of {len(members)}",
            })
    return winners, {"dropped": dropped, "outvoted": sorted(outvoted), "voters": voters}


# ---------------------------------------------------------------- inner rule spec


def parse_inner(value: Any) -> BaseModel:
    """An inner rule spec validated against the registry: `name` plus that rule's parameters.

    A plain string is shorthand for `{name: ...}` and a mapping without `name` means Multi-Krum,
    as for the scenario's own component sections.
    """
    def why_not(name: str) -> str:
        if name in AGGREGATORS and AGGREGATORS.get(name).traits.top_level_only:
            return f"{name} runs only as the scenario's own aggregator, not nested"
        if name in AGGREGATORS and AGGREGATORS.get(name).traits.needs_groups:
            return f"{name} cannot nest itself: a group rule forms its own groups"
        if name in PROTOCOLS:
            return f"{name} is a round protocol, not an [n, d] rule"
        return f"unknown inner aggregator {name!r}"

    allowed = [n for n in vector_rule_names() if not AGGREGATORS.get(n).traits.needs_groups
               and not AGGREGATORS.get(n).traits.top_level_only]
    return parse_nested_rule(value, DEFAULT_INNER, allowed, why_not)



# ---------------------------------------------------------------- parameters


class DetoxParams(Params):
    group_size: int = Field(3, ge=1, description="r, clients per redundant group (odd)")
    inner: SerializeAsAny[BaseModel] = Field(
        default_factory=lambda: parse_inner(DEFAULT_INNER),
        description="robust rule across the group winners: {name: <aggregator>, <its params>}",
    )
    super_group_size: int | None = Field(
        None,
        ge=1,
        description="average this many consecutive winners before the inner rule; none: no averaging",
    )
    redundancy: bool = Field(
        True, description="true: majority vote in groups of identical-data clients; false: group means"
    )

    def round_problem(self, n: int):
        """The inner rule's precondition on the group winners a round of n clients yields (all
        groups surviving the vote: fewer only when attackers win, which is the defense working)."""
        inputs = max(1, n // self.group_size)
        if self.super_group_size is not None:
            inputs = max(1, inputs // self.super_group_size)
        problem = self.inner.round_problem(inputs)
        if problem is None:
            return None
        param, reason, value = problem
        return f"inner.{param}", f"detox: {n} clients make {inputs} inputs of the inner rule {self.inner.name}; {reason}", value

    @field_validator("group_size")
    @classmethod
    def _odd(cls, value: int) -> int:
        if value % 2 == 0:
            raise ValueError(f"group_size must be odd so that a strict majority exists, got {value}")
        return value

    @field_validator("inner", mode="before")
    @classmethod
    def _inner_from_registry(cls, value: Any) -> BaseModel:
        return parse_inner(value)


# ---------------------------------------------------------------- rule


def effective_byzantine_groups(q: int, r: int) -> int:
    """Most groups q Byzantine clients can win in groups of r: floor(q / ceil(r / 2))."""
    return q // math.ceil(r / 2)


def expected_bad_groups(P: int, q: int, r: int) -> float:
    """Expected groups won by q Byzantines placed uniformly at random among P clients (r | P).

    Each group is a uniform r-subset, so by linearity: (P / r) * P[Hypergeom(P, q, r) > r / 2].
    """
    from scipy.stats import hypergeom  # imported here: scipy.stats costs ~1 s at start-up

    return (P // r) * float(hypergeom(P, q, r).sf(r // 2))


def weighted_group_means(
    rows: torch.Tensor, weights: torch.Tensor, groups: Sequence[Sequence[int]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """[g, d] example-count-weighted mean of each group's rows, and [g] each group's total weight."""
    means, totals = [], []
    for members in groups:
        idx = torch.tensor(members, dtype=torch.long)
        total = weights[idx].sum()
        if not torch.isfinite(total) or total <= 0:
            raise AggregationError(f"detox: group {list(members)} has total weight {float(total)}")
        means.append((weights[idx] / total).to(rows.dtype) @ rows[idx])
        totals.append(total)
    return torch.stack(means), torch.stack(totals)


def vote_winners(
    updates: torch.Tensor, weights: torch.Tensor, groups: list[list[int]]
) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """[k, d] the surviving groups' winning rows, [k] their weights (least voter weight), info."""
    winners, info = majority_vote(updates, groups)
    kept = [(w, voters) for w, voters in zip(winners, info["voters"]) if w is not None]
    if not kept:
        raise AggregationError(
            f"detox: the vote dropped all {len(groups)} groups (no strict majority in any)"
        )
    rows = updates[torch.tensor([w for w, _ in kept], dtype=torch.long)]
    row_weights = torch.stack([weights[torch.tensor(v, dtype=torch.long)].min() for _, v in kept])
    return rows, row_weights, info


def detox_with_info(
    updates: torch.Tensor,
    weights: torch.Tensor,
    *,
    groups: Sequence[Sequence[int]] | None = None,
    group_size: int = 3,
    inner: Any = DEFAULT_INNER,
    super_group_size: int | None = None,
    redundancy: bool = True,
    ctx: Any = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """DETOX's aggregate and a JSON-friendly record of the vote, for the round log. `ctx` (the
    round's context) goes on to an inner rule that reads it."""
    check_inputs(updates, weights)
    spec = parse_inner(inner)
    groups = check_groups(groups, updates.shape[0]) if groups is not None else consecutive_groups(
        updates.shape[0], group_size
    )
    if redundancy:
        rows, row_weights, info = vote_winners(updates, weights, groups)
    else:
        rows, row_weights = weighted_group_means(updates, weights, groups)
        info = {"dropped": [], "outvoted": [], "voters": []}
    survivors = rows.shape[0]
    if super_group_size is not None:
        supers = consecutive_groups(survivors, super_group_size)
        rows, row_weights = weighted_group_means(rows, row_weights, supers)
    info.update(
        groups=len(groups), surviving_groups=survivors, inner_inputs=rows.shape[0], inner=spec.name
    )
    try:
        out = call_rule(spec, rows, row_weights, ctx)[0]
    except AggregationError as err:
        raise AggregationError(
            f"detox: inner rule {spec.name} failed on {rows.shape[0]} inputs from {survivors} surviving "
            f"groups of {len(groups)}: {err}"
        ) from err
    return out, info


# The strategy forms the groups (and gives members the same data) and logs the vote.
def secure_groups(spec) -> tuple[str, str, Any] | None:
    """Under secure aggregation each group is securely summed on its own, so the vote (which compares
    the members' updates) cannot run: only `redundancy: false` fits (field, why, value)."""
    if spec.redundancy:
        return ("aggregator.redundancy", "DETOX's majority vote compares the group members' individual updates. Set "
                "redundancy: false: each group is then securely aggregated and the inner rule runs across the group "
                "means", True)
    return None


@AGGREGATORS.register("detox", DetoxParams, needs_groups=True, with_info=detox_with_info, with_context=True,
                      secure_sum=secure_groups)
def detox(updates: torch.Tensor, weights: torch.Tensor, **params: Any) -> torch.Tensor:
    """DETOX: majority vote inside redundant client groups, then a robust rule across groups."""
    return detox_with_info(updates, weights, **params)[0]

