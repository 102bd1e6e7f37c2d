"""FLAME (Nguyen et al., USENIX Security 2022): cluster out odd models, clip to the median norm, add noise.

1. Filter: pairwise cosine distances between the local *models* w_i = G + Δ_i, HDBSCAN on them
   (min_cluster_size = n//2 + 1, min_samples = 1, metric="precomputed"); only the largest cluster
   is kept. HDBSCAN runs with allow_single_cluster=True: with min_cluster_size > n/2 there can be
   only one cluster, and without that flag HDBSCAN never selects the root, so it would label every
   point noise. With it, the kept set is the densest core of at least min_cluster_size models, so
   an honest model on the fringe may be dropped too. If HDBSCAN still labels every point noise,
   all updates are kept and the log says so (`note`).
2. Adaptive clipping: e_i = ||Δ_i||, S = median of e over all n updates (the usual median, the mean
   of the two middle values for even n); each kept Δ_i is scaled by min(1, S / e_i).
3. Aggregation is left to the scenario's aggregator. FLAME takes the plain mean of the kept clipped
   models, so use `fedavg`; the example-count weights are kept as given, so fedavg equals FLAME's
   plain mean only when those counts are equal.
4. Noise: `after` adds N(0, (λS)²) to every coordinate of the aggregate (equivalently of the new
   global model). S is this round's, remembered on the instance between `before` and `after`; it is
   round-local, not checkpoint state.

The constants (λ = 0.001 for image tasks, 0.01 for NLP; min_cluster_size = n/2 + 1,
min_samples = 1) are marked [recalled] in the reference notes: check them against the paper.
"""

from __future__ import annotations

import numpy as np
import torch
from pydantic import Field

from fedsim.defenses.base import Defense
from fedsim.defenses.clipping import clip_log, clip_rows, gaussian_like
from fedsim.registry import DEFENSES, Params
from fedsim.updates import RoundContext, UpdateBatch


class FlameParams(Params):
    noise_lambda: float = Field(0.001, ge=0, description="noise std as a multiple of the median update norm S (0.001 image tasks, 0.01 NLP)")
    min_cluster_size: int | None = Field(None, ge=2, description="HDBSCAN min_cluster_size; None means n//2 + 1")
    min_samples: int = Field(1, ge=1, description="HDBSCAN min_samples")

    def round_problem(self, n: int):
        return cluster_problem("flame", n, self.min_cluster_size)


def cluster_problem(defense: str, n: int, min_cluster_size: int | None):
    """`round_problem` of a majority-cluster filter (FLAME, FreqFed): HDBSCAN's min_cluster_size
    (n//2 + 1 when None) must be below n, else its one cluster is every update and none is removed
    (`majority_cluster` keeps all of fewer than 3 updates)."""
    if (min_cluster_size or n // 2 + 1) < n:
        return None
    if min_cluster_size is None:
        return "", f"{defense} needs at least 3 updates to cluster, got n={n}: every update would be kept", n
    return ("min_cluster_size", f"{defense} needs more than min_cluster_size={min_cluster_size} updates to remove any, "
            f"got n={n}: its one cluster would keep every update", min_cluster_size)


def cosine_distances(x: torch.Tensor) -> np.ndarray:
    """[n, n] float64 matrix 1 - cos(x_i, x_j), clamped to >= 0 with an exact zero diagonal."""
    x = x.to(torch.float64)
    norms = torch.linalg.vector_norm(x, dim=1, keepdim=True)
    xn = x / torch.where(norms > 0, norms, torch.ones_like(norms))
    dist = (1.0 - xn @ xn.T).clamp_(min=0.0)
    dist.fill_diagonal_(0.0)
    dist = 0.5 * (dist + dist.T)  # exact symmetry for HDBSCAN
    return dist.cpu().numpy()


def majority_cluster(dist: np.ndarray, min_cluster_size: int, min_samples: int) -> tuple[np.ndarray, str | None]:
    """Boolean mask of the largest HDBSCAN cluster, and a note when everyone is kept for lack of one."""
    n = dist.shape[0]
    if n < 3:
        return np.ones(n, dtype=bool), f"{n} updates are too few to cluster; all kept"
    from sklearn.cluster import HDBSCAN  # imported here: scikit-learn costs ~1 s at start-up

    labels = HDBSCAN(
        min_cluster_size=min(max(min_cluster_size, 2), n),
        min_samples=min(min_samples, n),
        metric="precomputed",
        allow_single_cluster=True,
        copy=True,
    ).fit(dist).labels_
    clustered = labels >= 0
    if not clustered.any():
        return np.ones(n, dtype=bool), "hdbscan found no cluster; all updates kept"
    biggest = int(np.argmax(np.bincount(labels[clustered])))
    return labels == biggest, None


@DEFENSES.register("flame", FlameParams)
class Flame(Defense):
    """FLAME: HDBSCAN filter on model cosine distances, clip to the median norm, Gaussian noise (Nguyen et al. 2022)."""

    def __init__(self, params) -> None:
        super().__init__(params)
        self._noise_std: tuple[int, float] | None = None  # (round, λS) set by before(), read by after()

    def before(self, batch: UpdateBatch, ctx: RoundContext) -> tuple[UpdateBatch, dict]:
        n = batch.updates.shape[0]
        models = ctx.global_weights.to(batch.updates.device, torch.float64)[None, :] + batch.updates.to(torch.float64)
        mcs = self.params.min_cluster_size or n // 2 + 1
        keep_np, note = majority_cluster(cosine_distances(models), mcs, self.params.min_samples)
        keep = torch.from_numpy(keep_np).to(batch.updates.device)

        norms = torch.linalg.vector_norm(batch.updates, dim=1)
        median = float(torch.quantile(norms.to(torch.float64), 0.5)) if n else 0.0
        self._noise_std = (ctx.round, float(self.params.noise_lambda) * median)

        kept = batch.select(keep)
        clipped, kept_norms, factor = clip_rows(kept.updates, median)
        log = clip_log(kept.client_ids, kept_norms, factor)
        log["norms"] = {int(c): float(v) for c, v in zip(batch.client_ids, norms.tolist())}
        log["removed"] = [int(c) for c, k in zip(batch.client_ids, keep_np.tolist()) if not k]
        if note:
            log["note"] = note
        return kept.with_updates(clipped), log

    def after(self, aggregate: torch.Tensor, ctx: RoundContext) -> tuple[torch.Tensor, dict]:
        if self._noise_std is None or self._noise_std[0] != ctx.round:
            raise RuntimeError(f"flame.after called for round {ctx.round} without before() in that round")
        std = self._noise_std[1]
        self._noise_std = None
        return aggregate + gaussian_like(aggregate, std, ctx.generator), {"noise_std": std}
