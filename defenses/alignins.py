"""AlignIns (Xu, Zhang, Hu, CVPR 2025): filter updates whose direction is oddly aligned, clip the rest.

"Detecting Backdoor Attacks in Federated Learning via Direction Alignment Inspection"
(arXiv 2503.07978; official code github.com/JiiahaoXU/AlignIns, `src/aggregation.py`,
`agg_alignins`). For the n updates Δ_1..Δ_n of a round and the global model θ:

1. Temporal direction alignment (TDA): ω_i = <Δ_i, θ> / (||Δ_i|| ||θ||), the cosine of each
   update with the current global model's flat weights (not with an aggregate of the updates).
2. Masked principal sign alignment (MPSA): the principal sign p = sgn(Σ_j sgn(Δ_j)) (coordinate
   wise majority of the signs; 0 on a tie), the mask of update i its k = ⌊ρ d⌋ largest-magnitude
   coordinates (top-k of |Δ_i|, ρ = `sparsity`), and ρ_i = |{c in top-k(i): sgn(Δ_i,c) = p_c}| / k.
3. Median-based Z-score (MZ-score) of each metric over the round: MZ(x_i) = |x_i − med(x)| / std(x),
   the median over the n values (the mean of the two middle ones for even n, numpy's median) and
   the population standard deviation (numpy's std, ddof = 0).
4. Filter: update i is kept when MZ(ω_i) < λ_c and MZ(ρ_i) < λ_s (strict, as the official code);
   the others are `removed`.
5. Post-filtering clipping: the kept updates are scaled to L2 norm at most the median norm of the
   kept updates (`clip_norm`), each by min(1, clip_norm / ||Δ_i||).
6. Aggregation is left to the scenario's rule: the official code averages the kept clipped updates
   weighted by the clients' data sizes, which is `fedavg` with its example counts.

Defaults: ρ = 0.3, λ_s = λ_c = 1.0, the official code's argparse defaults (`--sparsity`,
`--lambda_s`, `--lambda_c` in `src/federated.py`); the paper's text was not at hand to check its
per-dataset choices, only summaries of it (which agree on TDA against the global model, MPSA,
the MZ-score filter and the post-filtering clipping).

Where fedsim differs from the official code, and why:
- Every score is computed in float64 (the official code in float32): the MZ-scores compare small
  differences of cosines, and ties at the threshold should not depend on rounding.
- The cosine uses torch's `cosine_similarity` with eps = 1e-6, as the official
  `CosineSimilarity(dim=0, eps=1e-6)`.
- k is at least 1 (the official ⌊ρ d⌋ is 0 for ρ d < 1, and its ratio then 0/0).
- A metric whose n values are all equal (std = 0) gives every client MZ = 0 there: no client
  deviates. The official code divides 0 by 0, NaN fails `< λ`, and it removes every update.
- The clipping median of an even number of kept norms is torch's lower middle value, as the
  official `torch.median`; a zero update is left as it is (the official code divides it by 0).
- The official flat vectors hold every `state_dict` entry, BatchNorm statistics included; fedsim's
  defenses see the trainable coordinates only (the pipeline averages buffers aside).
- When every update is removed the official code returns a zero update; here the round is skipped
  (the pipeline's "removed every update"), which leaves the global model unchanged as well.

The MZ-score is scale-free: the standard deviation is at most the root mean square deviation from
the median, itself at most the largest deviation, so with λ ≤ 1 the update farthest from the
median is removed in every round whose scores are not all equal, attacked or not.

Rounds of fewer than 3 updates are refused (`round_problem`): with n = 2 each metric's two
MZ-scores are equal (both 1, or both 0), so the two updates are kept or removed together; with
n = 1 the one MZ-score is 0 and nothing is ever removed.
"""

from __future__ import annotations

import torch
from pydantic import Field

from fedsim.defenses.base import Defense
from fedsim.defenses.clipping import clip_log, clip_rows
from fedsim.registry import DEFENSES, Params
from fedsim.updates import RoundContext, UpdateBatch


class AlignInsParams(Params):
    sparsity: float = Field(0.3, gt=0, le=1, description="MPSA mask: the fraction ρ of each update's largest-magnitude "
                                                           "coordinates compared with the principal sign (official default 0.3)")
    lambda_s: float = Field(1.0, gt=0, description="keep an update only if the MZ-score of its MPSA is below this (official default 1.0)")
    lambda_c: float = Field(1.0, gt=0, description="keep an update only if the MZ-score of its TDA (cosine to the global "
                                                   "model) is below this (official default 1.0)")
    clip: bool = Field(True, description="post-filtering clipping of the kept updates to their median norm (the paper's "
                                         "last step; false for an ablation)")

    def round_problem(self, n: int):
        if n >= 3:
            return None
        return "", (f"alignins needs at least 3 updates, got n={n}: its MZ-scores "
                    + ("are 0 for a lone update, which is never removed" if n <= 1 else
                       "of two updates are equal, so both are kept or both removed")), n


def mz_scores(x: torch.Tensor) -> torch.Tensor:
    """|x_i − median(x)| / std(x) (median: mean of the two middle values; std: population), 0 where std = 0."""
    x = x.to(torch.float64)
    if x.numel() == 0:
        return x
    dev = (x - torch.quantile(x, 0.5)).abs()
    std = x.std(correction=0)
    return torch.zeros_like(dev) if float(std) == 0.0 else dev / std


def alignment_scores(updates: torch.Tensor, global_weights: torch.Tensor, sparsity: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(TDA [n], MPSA [n]) in float64: each row's cosine with the global weights, and the fraction of
    its ⌊ρ d⌋ (at least 1) largest-magnitude coordinates whose sign is the rows' majority sign."""
    n, d = updates.shape
    if n == 0 or d == 0:
        empty = torch.zeros(n, dtype=torch.float64, device=updates.device)
        return empty, empty.clone()
    g = global_weights.to(updates.device, torch.float64)
    tda = torch.nn.functional.cosine_similarity(updates.to(torch.float64), g[None, :], dim=1, eps=1e-6)
    signs = torch.sign(updates)  # signs, their sums and the magnitude order are exact in the input's dtype
    principal = torch.sign(signs.sum(dim=0))
    k = max(1, int(d * sparsity))
    top = torch.topk(updates.abs(), k, dim=1).indices  # [n, k]
    mpsa = (signs.gather(1, top) == principal[top]).to(torch.float64).mean(dim=1)
    return tda, mpsa


def alignins_filter(updates: torch.Tensor, global_weights: torch.Tensor, sparsity: float, lambda_s: float,
                    lambda_c: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Boolean keep mask [n] (MZ(TDA) < λ_c and MZ(MPSA) < λ_s) and the scores it came from."""
    tda, mpsa = alignment_scores(updates, global_weights, sparsity)
    mz_tda, mz_mpsa = mz_scores(tda), mz_scores(mpsa)
    keep = (mz_tda < lambda_c) & (mz_mpsa < lambda_s)
    return keep, {"tda": tda, "mpsa": mpsa, "mz_tda": mz_tda, "mz_mpsa": mz_mpsa}


@DEFENSES.register("alignins", AlignInsParams)
class AlignIns(Defense):
    """AlignIns: MZ-score filter on cosine-to-global-model and masked principal-sign agreement, then median-norm clipping (Xu et al. 2025)."""

    def before(self, batch: UpdateBatch, ctx: RoundContext) -> tuple[UpdateBatch, dict]:
        p = self.params
        keep, scores = alignins_filter(batch.updates, ctx.global_weights, p.sparsity, p.lambda_s, p.lambda_c)
        ids = batch.client_ids
        log: dict = {name: {int(c): float(v) for c, v in zip(ids, values.tolist())} for name, values in scores.items()}
        log["removed"] = [int(c) for c, k in zip(ids, keep.tolist()) if not k]
        kept = batch.select(keep.to(batch.updates.device))
        if not p.clip or kept.updates.shape[0] == 0:
            return kept, log
        clip_norm = torch.linalg.vector_norm(kept.updates, dim=1).median()  # lower middle value for an even count, as the official code
        clipped, kept_norms, factor = clip_rows(kept.updates, clip_norm)
        log.update(clip_log(kept.client_ids, kept_norms, factor))
        log["clip_norm"] = float(clip_norm)
        return kept.with_updates(clipped), log
