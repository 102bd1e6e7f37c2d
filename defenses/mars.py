"""MARS (Wan, Ning, Huang, Hong, Hu, Zhou, Zhang, Zhu, Zhou, NeurIPS 2025): backdoor energy of the
neurons, its concentrated top values, Wasserstein K-Means to split off the backdoored models.

"MARS: A Malignity-Aware Backdoor Defense in Federated Learning" (arXiv 2509.20383; official code
github.com/yunming181920/MARS, `defenses/mars.py`: `CBE`, `kmeans_wasserstein_clustering`,
`detect_anomaly`; SecretFlow ships a port, `agg_mars.py`, whose README states the same three steps).
For the local models W_k = G + Δ_k of a round:

1. Backdoor energy (BE) of each neuron: the upper bound of its Lipschitz constant, as in CLP
   (Zheng et al., ECCV 2022). For channel c of a convolution followed by BatchNorm,
   BE_c = σ_max(W_c · |γ_c / σ_c|), W_c the channel's kernel reshaped to [in, kh·kw], γ_c the BN
   scale and σ_c = sqrt(running_var_c + 1e-5); σ_max is the largest singular value.
2. Concentrated backdoor energy (CBE): in each layer the BE values at or above the layer's
   (1 − u) quantile (u = 0.05, numpy's linear interpolation), kept in channel order, concatenated
   over the layers into one vector per model.
3. Wasserstein K-Means: the [n, n] matrix of 1-D Wasserstein distances between the CBE vectors
   (each taken as an empirical distribution), K-Means with K = 2 on its rows, the two cluster
   centres the means of their members' CBE vectors. When the Wasserstein distance between the two
   centres is at most ε (0.03) nothing is removed; otherwise the cluster whose centre has the
   larger L1 norm is removed (`removed`), the other is aggregated by the scenario's rule (the
   official code: FedAvg of the rest).

Defaults: u = 0.05 and ε = 0.03, the official code's constants; K-Means with random_state 0 there,
here seeded from the round's generator.

Where fedsim differs from the official code, and why:
- Layers: the official `CBE` scores only convolutions followed by BatchNorm (its ResNets). fedsim's
  mlp, lenet and vgg9 have no BatchNorm: for them (and for any model without such a pair,
  `layers: auto`) every convolution and Linear layer but the output layer is scored, with scale 1:
  BE_c = σ_max(W_c), which for a Linear neuron is the L2 norm of its weight row. `layers: all`
  adds the output layer; `layers: bn` insists on conv-BN pairs. With BatchNorm the running
  variance is the global model's: the server's defenses see the trainable coordinates only, the
  running statistics are averaged aside (fedsim/server/pipeline.py).
- The top values are the k = m − ⌈(1 − u)(m − 1)⌉ largest of a layer of m neurons (at least 1),
  which is the official `>= quantile` selection whenever the values are distinct (ties may add
  values there, which would make the CBE lengths differ between models).
- The Wasserstein distance of two equal-length samples is the mean absolute difference of their
  sorted values, computed for all pairs at once (scipy's `wasserstein_distance`, pair by pair, in
  the official code: the same number).
- K-Means runs with n_init = 10 (sklearn's default when the official code was written; it is
  "auto", one start, in current sklearn).
- Without the server's tools the BatchNorm pairs cannot be read: the layout alone is used
  (every weight of two or more dimensions but the output layer).
- The official `aggr` computes TPR/FPR against hard-coded attacker indices; fedsim's audit reads
  `removed` instead.
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np
import torch
from pydantic import Field

from fedsim.defenses.base import Defense
from fedsim.registry import DEFENSES, Params
from fedsim.updates import RoundContext, UpdateBatch

BN_EPS = 1e-5


class MARSParams(Params):
    u: float = Field(0.05, gt=0, lt=1, description="share of each layer's neurons whose backdoor energies enter the CBE "
                                                   "(the values at or above the 1 - u quantile; official 0.05)")
    epsilon: float = Field(0.03, ge=0, description="remove nothing when the Wasserstein distance between the two cluster "
                                                   "centres is at most this (official 0.03)")
    layers: Literal["auto", "bn", "all"] = Field(
        "auto", description="layers scored: conv+BatchNorm pairs when the model has them, else every conv/Linear but the "
                            "output layer (auto); only conv+BN pairs, as the official code (bn); every conv/Linear (all)")
    n_init: int = Field(10, ge=1, description="K-Means restarts")

    def round_problem(self, n: int):
        if n >= 3:
            return None
        return "", f"mars needs at least 3 updates to split them into two clusters, got n={n}", n


def top_count(m: int, u: float) -> int:
    """How many of m distinct values lie at or above their (1 − u) quantile (linear interpolation)."""
    pos = (1.0 - u) * (m - 1)
    return max(1, m - math.ceil(pos - 1e-12))


def neuron_energy(weight: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """BE [n, out] of weights [n, out, in, ...]: σ_max of each neuron's [in, rest] matrix times |scale| [n, out]."""
    w = weight.to(torch.float64)
    if w.dim() == 3:  # Linear [n, out, in]: σ_max of a 1 x in row is its L2 norm
        be = torch.linalg.vector_norm(w, dim=-1)
    else:  # conv [n, out, in, kh, kw]: each output channel's kernel as an [in, kh·kw] matrix
        be = torch.linalg.matrix_norm(w.reshape(w.shape[0], w.shape[1], w.shape[2], -1), ord=2)
    if scale is not None:
        be = be * scale.to(torch.float64).abs()
    return be


def concentrated(be: torch.Tensor, u: float) -> torch.Tensor:
    """The top-k of each row of BE [n, m] in channel order, k = top_count(m, u)."""
    k = top_count(be.shape[1], u)
    idx = torch.topk(be, k, dim=1).indices.sort(dim=1).values
    return be.gather(1, idx)


def wasserstein_matrix(cbe: torch.Tensor) -> torch.Tensor:
    """[n, n] 1-D Wasserstein distances between the rows taken as equal-weight samples."""
    s = cbe.to(torch.float64).sort(dim=1).values
    return torch.cdist(s, s, p=1) / s.shape[1]


def wasserstein_1d(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.to(torch.float64).sort().values - b.to(torch.float64).sort().values).abs().mean())


def mars_split(cbe: torch.Tensor, epsilon: float, seed: int, n_init: int = 10) -> tuple[np.ndarray, dict]:
    """Boolean removal mask [n] and the clustering facts, from the CBE vectors [n, m]."""
    from sklearn.cluster import KMeans

    dist = wasserstein_matrix(cbe).numpy()
    labels = KMeans(n_clusters=2, random_state=seed, n_init=n_init).fit(dist).labels_
    c64 = cbe.to(torch.float64)
    centers = [c64[torch.from_numpy(labels == j)].mean(dim=0) for j in (0, 1)]
    gap = wasserstein_1d(centers[0], centers[1])
    l1 = [float(c.abs().sum()) for c in centers]
    info = {"center_distance": gap, "center_l1": l1, "labels": labels.tolist()}
    if gap <= epsilon:
        return np.zeros(len(labels), dtype=bool), info
    return labels == int(np.argmax(l1)), info


def scored_layers(ctx: RoundContext, layers: str) -> list[tuple[str, str | None, torch.Tensor | None]]:
    """(weight name, BN weight name or None, global running variance or None) of the scored layers."""
    lay = ctx.layout
    pairs = []
    if ctx.tools is not None:
        model = ctx.tools.model_of(ctx.global_weights.cpu())
        prev = None
        for name, m in model.named_modules():
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and prev is not None and m.affine and m.running_var is not None:
                pairs.append((prev + ".weight", name + ".weight", m.running_var.detach().cpu()))
                prev = None
            elif isinstance(m, torch.nn.Conv2d):
                prev = name
            elif len(list(m.children())) == 0:
                prev = None
        pairs = [p for p in pairs if p[0] in lay.names and p[1] in lay.names]
    if layers == "bn":
        if not pairs:
            raise ValueError("mars layers=bn: the model has no convolution followed by BatchNorm")
        return pairs
    if layers == "auto" and pairs:
        return pairs
    weights = [n for n, s in zip(lay.names, lay.shapes) if len(s) >= 2]
    if layers == "auto" and len(weights) > 1:  # the output layer left out, unless it is the only one
        weights = weights[:-1]
    if not weights:
        raise ValueError(f"mars: the model has no conv/Linear weight to score (layers={layers}); have {lay.names}")
    return [(w, None, None) for w in weights]


def cbe_vectors(updates: torch.Tensor, ctx: RoundContext, layers: str, u: float) -> torch.Tensor:
    """CBE [n, m] of the local models G + Δ_k."""
    lay, n = ctx.layout, updates.shape[0]
    g = ctx.global_weights.to(updates.device, torch.float64)
    local = updates.to(torch.float64) + g[None, :]
    parts = []
    for w_name, bn_name, var in scored_layers(ctx, layers):
        w = local[:, lay.slice(w_name)].reshape(n, *lay.shapes[lay.names.index(w_name)])
        scale = None
        if bn_name is not None:
            gamma = local[:, lay.slice(bn_name)]
            scale = gamma / torch.sqrt(var.to(gamma.device, torch.float64).clamp(min=0) + BN_EPS)[None, :]
        parts.append(concentrated(neuron_energy(w, scale), u))
    return torch.cat(parts, dim=1)


@DEFENSES.register("mars", MARSParams)
class MARS(Defense):
    """MARS: neurons' backdoor energy (CLP's Lipschitz bound), top-u concentration, Wasserstein 2-means; drops the high-energy cluster (Wan et al. 2025)."""

    def before(self, batch: UpdateBatch, ctx: RoundContext) -> tuple[UpdateBatch, dict]:
        n = batch.updates.shape[0]
        if n < 2:
            return batch, {"removed": []}
        p = self.params
        if not any(len(shape) >= 2 for shape in ctx.layout.shapes):  # nothing has neurons to bound
            return batch, {"removed": [], "note": "no conv/Linear weight matrix in the model: no backdoor energy to measure"}
        cbe = cbe_vectors(batch.updates, ctx, p.layers, p.u).cpu()
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=ctx.generator, device=ctx.generator.device))
        remove, info = mars_split(cbe, p.epsilon, seed, p.n_init)
        ids = [int(c) for c in batch.client_ids]
        log = {
            "removed": [c for c, r in zip(ids, remove.tolist()) if r],
            "cbe_l1": {c: float(v) for c, v in zip(ids, cbe.to(torch.float64).abs().sum(dim=1).tolist())},
            "clusters": {c: int(v) for c, v in zip(ids, info["labels"])},
            "center_distance": info["center_distance"],
            "center_l1": info["center_l1"],
        }
        keep = torch.from_numpy(~remove).to(batch.updates.device)
        return batch.select(keep), log
