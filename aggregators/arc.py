"""ARC, adaptive robust clipping, before an `inner` rule (Allouah, Guerraoui, Gupta, Jellouli, Rizk,
Stephan, "The Vital Role of Gradient Clipping in Byzantine-Resilient Distributed Learning", arXiv
2405.14432, 2024, Algorithm 1).

A pre-aggregation, like bucketing and NNM (`mixing.py`): it rewrites the updates and hands them
to any [n, d] rule (`inner: {name: <aggregator>, <its params>}`, Krum by default as for the other
wrappers; the paper pairs ARC with coordinate-wise trimmed mean, median, geometric median,
Multi-Krum and NNM compositions). ARC clips the k = floor(2 (f / n) (n - f)) largest updates to
the norm of the (k + 1)-th largest, leaving the others as they are:

    C = ||x_(k+1)||  (norms in decreasing order),      ARC(x)_i = min(1, C / ||x_i||) x_i

so the threshold adapts to the round instead of being a tuned constant. With f = 0 nothing is
clipped and ARC is the inner rule itself. Unlike bucketing and NNM it needs no f of its own for
the inner rule: the inner rule keeps its own parameters. ARC needs n > 2f here (the paper's
f < n / 2; ByzFL accepts any f <= n).

Conventions and where ByzFL (0.0.11, `byzfl.ARC`) differs:

- k is computed in integers, 2 f (n - f) // n. ByzFL computes `int((2 * f / n) * (n - f))` in
  floating point; the two agree for every n <= 241 with 2f < n, and first part at n = 242,
  f = 33, where the float product falls just under the integer 10 and ByzFL clips 9 updates
  (28 such (n, f) pairs up to n = 2000). fedsim follows the paper's formula.
- Equal norms: the threshold is a norm value, so which of two equal-norm updates counts as
  "larger" does not change the output.
- Norms are taken in float64 (a float32 update of huge entries has a norm that float32 cannot
  hold). An update holding NaN or inf has no direction to keep: it counts as the largest and is
  replaced by zeros, the limit of clipping a vector of unbounded norm (as centered clipping lets
  such an update add nothing). ByzFL would return it as NaN.
- ByzFL clips its input in place (the caller's array changes); this rule returns new tensors.

The report: which rows were clipped, the threshold C, and the inner rule's (`selected` when it
chooses rows).
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import Field

from fedsim.aggregators.base import check_inputs
from fedsim.aggregators.mixing import DEFAULT_INNER, call_inner, InnerRule, inner_field, inner_problem, parse_inner_rule, wrapper_info
from fedsim.aggregators.subsets import check_majority, majority_problem
from fedsim.registry import AGGREGATORS, Params
from fedsim.updates import RoundContext


def clip_count(n: int, num_malicious: int) -> int:
    """k = floor(2 (f / n) (n - f)), in exact integer arithmetic."""
    return (2 * num_malicious * (n - num_malicious)) // n


def arc_clip(updates: torch.Tensor, num_malicious: int, clipped: int | None = None) -> tuple[torch.Tensor, torch.Tensor, float]:
    """[n, d] the updates with the k largest clipped to the (k + 1)-th largest norm, [n] which rows
    were clipped (norm above the threshold, or non-finite), and the threshold. `clipped` overrides k."""
    n = updates.shape[0]
    check_majority("arc", n, num_malicious)
    k = clip_count(n, num_malicious) if clipped is None else clipped
    finite = torch.isfinite(updates).all(dim=1)
    norms = torch.linalg.vector_norm(updates.double(), dim=1)
    norms = torch.where(finite, norms, torch.inf)
    if k == 0:
        return torch.where(finite[:, None], updates, torch.zeros_like(updates)), ~finite, float(norms.max())
    threshold = torch.sort(norms, descending=True).values[k]  # the (k + 1)-th largest
    over = norms > threshold
    scale = torch.where(over, threshold / norms, torch.ones_like(norms))
    scale = torch.where(finite, scale, torch.zeros_like(scale))
    out = torch.where(finite[:, None], updates, torch.zeros_like(updates))
    out = (out.double() * scale[:, None]).to(updates.dtype)
    return out, over | ~finite, float(threshold)


class ARCParams(Params):
    num_malicious: int = Field(1, ge=0, description="f: clips the floor(2f(n-f)/n) largest updates to the next largest norm; needs n > 2f")
    inner: InnerRule = inner_field("clipped updates")

    def round_problem(self, n: int):
        problem = majority_problem("arc", n, self.num_malicious)
        if problem is not None:
            return problem
        return inner_problem("arc", self.inner, n, n, "clipped updates")


def arc_with_info(
    updates: torch.Tensor,
    weights: torch.Tensor,
    num_malicious: int = 1,
    inner: Any = DEFAULT_INNER,
    ctx: RoundContext | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """ARC's aggregate and its report (the rows clipped, the threshold, and the inner rule's choice)."""
    check_inputs(updates, weights)
    spec = parse_inner_rule(inner)
    clipped, was_clipped, threshold = arc_clip(updates, num_malicious)
    n = updates.shape[0]
    out, inner_info = call_inner("arc", spec, clipped, weights, ctx, "clipped updates")
    info = wrapper_info(spec, inner_info, [[i] for i in range(n)], n)
    info["clipped"] = torch.nonzero(was_clipped).flatten().tolist()
    info["clip_threshold"] = threshold
    return out, info


@AGGREGATORS.register("arc", ARCParams, with_context=True, with_info=arc_with_info)
def arc(updates: torch.Tensor, weights: torch.Tensor, **params: Any) -> torch.Tensor:
    """Adaptive robust clipping of the largest updates, then the inner rule (Allouah et al. 2024)."""
    return arc_with_info(updates, weights, **params)[0]
