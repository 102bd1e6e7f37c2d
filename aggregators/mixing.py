"""Mixing before a robust rule: bucketing and nearest-neighbour mixing, each wrapping an `inner` rule.

Both replace the updates by averages of several of them and hand those to any [n, d] rule, which
then sees less heterogeneity among the honest inputs at the price of each Byzantine update
reaching more than one of them. The inner rule is a spec like DETOX's, `{name: <aggregator>,
<its params>}` (a bare name works too); its own parameters, f included, are its own. Any
registered [n, d] rule may be the inner one except those that need client groups (DETOX); an
inner rule that reads the round's context (centered clipping, ...) gets the wrapper's.

**Bucketing** (Karimireddy, He, Jaggi, "Byzantine-Robust Learning on Heterogeneous Datasets via
Bucketing", ICLR 2022, Algorithm 1): shuffle the n updates with a random permutation, cut them
into ceil(n / s) buckets of s consecutive ones (the last holds the n mod s left over, as in the
official code `epfml/byzantine-robust-noniid-optimizer`, `bucketing_wrapper`, and ByzFL), average
each bucket, and run the inner rule on the bucket means. The permutation comes from the round's
seeded generator (`ctx.generator`, hence `with_context=True`); the server sorts the rows by
client id first, so a run is reproducible. A direct call without a context (or as DETOX's inner
rule, which passes none) draws it from a generator seeded with 0. Bucket means are unweighted, as
in the paper (its variance reduction, sigma^2 / s, assumes equal shares); each bucket carries the
summed example counts of its members to the inner rule, so weighted inner rules (fedavg,
multikrum, rfa) weigh buckets by data. With s = 1 this is the inner rule on shuffled rows, so the
inner rule itself for an order-free one; bucketing around fedavg is fedavg when example counts are
equal (otherwise the mean of unweighted bucket means, weighted by bucket totals). The official
code keeps f unchanged for the inner rule (Krum on ceil(n / s) inputs with the same f): each
Byzantine update spoils at most one bucket.

**Nearest-neighbour mixing, NNM** (Allouah, Farhadkhani, Guerraoui, Gupta, Pinot, Stephan, "Fixing
by Mixing: A Recipe for Optimal Byzantine ML under Heterogeneity", AISTATS 2023, Algorithm 1):
replace every update x_i by the unweighted mean of its n - f nearest neighbours in Euclidean
distance, itself included, then run the inner rule on the n mixed vectors. The paper (and ByzFL,
its authors' library) gives no tie rule: here x_i is always its own first neighbour and equal
distances go to the lower row index (stable sort), so the result does not depend on sort
internals. Distances are those Krum uses (`distances.pairwise_sq_distances`: a row holding NaN or
inf is infinitely far from all others, so it only enters neighbourhoods that must take it). Mixed
row i keeps client i's example count as its weight. f = 0 makes every row the plain mean.

Both report what the round log and the detection audit need: the inner rule's name and, when the
inner rule chooses (Krum, Multi-Krum, ...), `selected`: the rows whose updates entered the chosen
bucket means or mixed vectors; the other rows count as left out.
"""

from __future__ import annotations

import math
from typing import Annotated, Any

import torch
from pydantic import BaseModel, BeforeValidator, Field, SerializeAsAny

from fedsim.aggregators.base import AggregationError, check_inputs, parse_nested_rule, call_rule, vector_rule_names
from fedsim.aggregators.distances import pairwise_sq_distances
from fedsim.registry import AGGREGATORS, Params
from fedsim.updates import RoundContext

DEFAULT_INNER = "krum"
FALLBACK_SEED = 0  # bucketing's permutation when called without a round context


# ---------------------------------------------------------------- inner rule


def inner_rule_names() -> list[str]:
    """Registered [n, d] rules that can run on mixed updates (not those that need client groups)."""
    def nestable(name: str) -> bool:
        entry = AGGREGATORS.get(name)
        return not entry.traits.needs_groups and not entry.traits.top_level_only

    return [n for n in vector_rule_names() if nestable(n)]


def parse_inner_rule(value: Any) -> BaseModel:
    """An inner rule spec validated against the registry: `name` plus that rule's parameters; a
    bare name is shorthand for `{name: ...}`, and a mapping without `name` means Krum."""
    def why_not(name: str) -> str:
        if name in AGGREGATORS:
            return f"{name} cannot be an inner rule (it needs client groups, holds its own data or is not an [n, d] rule)"
        return f"unknown inner aggregator {name!r}"

    return parse_nested_rule(value, DEFAULT_INNER, inner_rule_names(), why_not)


def call_inner(wrapper: str, spec: BaseModel, rows: torch.Tensor, weights: torch.Tensor, ctx: RoundContext | None,
               made: str) -> tuple[torch.Tensor, dict | None]:
    """The inner rule on the rows a wrapper made (`made` says what they are, for the error)."""
    try:
        return call_rule(spec, rows, weights, ctx)
    except AggregationError as err:
        raise AggregationError(f"{wrapper}: inner rule {spec.name} failed on {rows.shape[0]} {made}: {err}") from err


def wrapper_info(spec: BaseModel, inner_info: dict | None, members: list[list[int]], inputs: int) -> dict[str, Any]:
    """The wrapper's report: the inner rule and, if it chose inputs, the rows behind them."""
    info: dict[str, Any] = {"inner": spec.name, "inner_inputs": inputs}
    if inner_info is not None and "selected" in inner_info:
        info["selected"] = sorted({row for i in inner_info["selected"] for row in members[i]})
    return info


def inner_problem(wrapper: str, inner: BaseModel, n: int, inputs: int, made: str):
    """`round_problem` of the inner rule on the `inputs` it will get from n updates, as the wrapper's."""
    problem = inner.round_problem(inputs)
    if problem is None:
        return None
    param, reason, value = problem
    return f"inner.{param}", f"{wrapper}: {n} clients make {inputs} {made} for the inner rule {inner.name}; {reason}", value


# A field holding an inner rule spec, validated against the registry (DETOX's `inner` works the same way).
InnerRule = Annotated[SerializeAsAny[BaseModel], BeforeValidator(parse_inner_rule)]


def inner_field(what: str) -> Any:
    return Field(default_factory=lambda: parse_inner_rule(DEFAULT_INNER),
                 description=f"robust rule on the {what}: {{name: <aggregator>, <its params>}}")


# ---------------------------------------------------------------- bucketing


def bucket_count(n: int, s: int) -> int:
    return math.ceil(n / s)


def bucket_of_rows(n: int, s: int, generator: torch.Generator) -> torch.Tensor:
    """[n] each row's bucket: position in a random permutation, integer-divided by s."""
    perm = torch.randperm(n, generator=generator)
    bucket = torch.empty(n, dtype=torch.long)
    bucket[perm] = torch.arange(n) // s
    return bucket


def bucket_means(updates: torch.Tensor, weights: torch.Tensor, bucket: torch.Tensor,
                 count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[count, d] unweighted mean of each bucket's rows and [count] its summed weights.

    Summed with index_add_ rather than a 0/1 matrix product, so a row holding NaN or inf spoils
    only its own bucket (0 * NaN would reach every bucket)."""
    sizes = torch.bincount(bucket, minlength=count)
    sums = torch.zeros(count, updates.shape[1], dtype=updates.dtype, device=updates.device)
    sums.index_add_(0, bucket.to(updates.device), updates)
    totals = torch.zeros(count, dtype=weights.dtype, device=weights.device).index_add_(0, bucket.to(weights.device), weights)
    return sums / sizes.to(updates.device, updates.dtype)[:, None], totals


class BucketingParams(Params):
    s: int = Field(2, ge=1, description="bucket size: shuffled updates averaged per bucket (paper's experiments: 2)")
    inner: InnerRule = inner_field("bucket means")

    def round_problem(self, n: int):
        return inner_problem("bucketing", self.inner, n, bucket_count(n, self.s), f"buckets of s={self.s}")


def bucketing_with_info(
    updates: torch.Tensor,
    weights: torch.Tensor,
    s: int = 2,
    inner: Any = DEFAULT_INNER,
    ctx: RoundContext | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """Bucketing's aggregate and its report (the inner rule, and the rows behind its choice)."""
    check_inputs(updates, weights)
    spec = parse_inner_rule(inner)
    n = updates.shape[0]
    count = bucket_count(n, s)
    generator = ctx.generator if ctx is not None else torch.Generator().manual_seed(FALLBACK_SEED)
    bucket = bucket_of_rows(n, s, generator)
    means, totals = bucket_means(updates, weights, bucket, count)
    out, inner_info = call_inner("bucketing", spec, means, totals, ctx, f"bucket means of s={s}")
    members = [[] for _ in range(count)]
    for row, b in enumerate(bucket.tolist()):
        members[b].append(row)
    return out, wrapper_info(spec, inner_info, members, count)


@AGGREGATORS.register("bucketing", BucketingParams, with_context=True, with_info=bucketing_with_info)
def bucketing(updates: torch.Tensor, weights: torch.Tensor, **params: Any) -> torch.Tensor:
    """Bucketing: the inner rule on the means of random buckets of s updates (Karimireddy et al. 2022)."""
    return bucketing_with_info(updates, weights, **params)[0]


# ---------------------------------------------------------------- nearest-neighbour mixing


def nearest_neighbours(updates: torch.Tensor, k: int) -> torch.Tensor:
    """[n, k] each row's k nearest rows (itself first, then by distance, ties to the lower index)."""
    dist = pairwise_sq_distances(updates)
    dist.fill_diagonal_(-1.0)  # itself first, even before an identical row
    return torch.sort(dist, dim=1, stable=True).indices[:, :k]


def nnm_mix(updates: torch.Tensor, num_malicious: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, d] each row replaced by the unweighted mean of its n - f nearest rows, and [n, n - f]
    the neighbours used."""
    n = updates.shape[0]
    k = n - num_malicious
    if k < 1:
        raise AggregationError(f"nnm needs f < n, got n={n}, f={num_malicious}")
    neighbours = nearest_neighbours(updates, k)
    finite = torch.isfinite(updates).all(dim=1)
    mixing = torch.zeros(n, n, dtype=updates.dtype, device=updates.device)
    mixing.scatter_(1, neighbours.to(updates.device), 1.0)
    clean = torch.where(finite[:, None], updates, torch.zeros_like(updates))  # 0 * NaN would spoil every row
    mixed = (mixing @ clean) / k
    for i in torch.nonzero(~finite[neighbours].all(dim=1)).flatten().tolist():  # only rows mixing a non-finite row
        mixed[i] = updates[neighbours[i]].mean(dim=0)
    return mixed, neighbours


class NNMParams(Params):
    num_malicious: int = Field(1, ge=0, description="f: each update becomes the mean of its n - f nearest (itself included)")
    inner: InnerRule = inner_field("mixed updates")

    def round_problem(self, n: int):
        if self.num_malicious >= n:
            return "num_malicious", f"nnm needs f < n, got n={n}, f={self.num_malicious}", self.num_malicious
        return inner_problem("nnm", self.inner, n, n, "mixed updates")


def nnm_with_info(
    updates: torch.Tensor,
    weights: torch.Tensor,
    num_malicious: int = 1,
    inner: Any = DEFAULT_INNER,
    ctx: RoundContext | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """NNM's aggregate and its report (the inner rule, and the rows behind its choice)."""
    check_inputs(updates, weights)
    spec = parse_inner_rule(inner)
    mixed, neighbours = nnm_mix(updates, num_malicious)
    n = updates.shape[0]
    out, inner_info = call_inner("nnm", spec, mixed, weights, ctx, "mixed updates")
    return out, wrapper_info(spec, inner_info, neighbours.tolist(), n)


@AGGREGATORS.register("nnm", NNMParams, with_context=True, with_info=nnm_with_info)
def nnm(updates: torch.Tensor, weights: torch.Tensor, **params: Any) -> torch.Tensor:
    """Nearest-neighbour mixing: each update averaged with its n - f nearest, then the inner rule (Allouah et al. 2023)."""
    return nnm_with_info(updates, weights, **params)[0]
