"""FLShield (Kabir, Song, Rashid, Mehnaz, IEEE S&P 2024): validate representative models on the
clients' data by their per-class loss impact, keep the better half, clip to the median norm.

"FLShield: A Validation Based Federated Learning Framework to Defend Against Poisoning Attacks"
(official code github.com/ehsanul9511/FLShield: `helper.py` `Helper.flshield`;
`flshield_utils/cluster_grads.py`, `validation_test.py`, `validation_processing.py`
`ValidationProcessor.run`/`fed_validation`, `impute_validation.py`). For the round's updates
Δ_1..Δ_n and the global model G:

1. Representative models. Bijective (the official configs' `bijective_flshield: true`): one per
   update, r_i = (1 − β) Δ_i + β Σ_{j≠i} w_ij Δ_j / Σ_{j≠i} w_ij with w_ij = ReLU(cos(Δ_j, Δ_i)) ·
   min(1, ||Δ_i|| / ||Δ_j||) and β = 0.25 (`contrib_adjustment`). Non-bijective: the updates are
   clustered (K-Means on the rows of the cosine-distance matrix, K in 2..min(n, 15) − 1 by the best
   silhouette score), a cluster's representative is its members' mean, a singleton's the ensemble
   above; below 10 updates every update is its own cluster.
2. Validation: every validator v (the round's clients, on their own data) computes, per class c,
   LIPC_v(r, c) = (L_v,c(G) − L_v,c(G + r)) / N_v,c, the drop in summed cross-entropy over its
   first ≤ 30 examples of class c, per example. A class a validator lacks is imputed (scikit-learn's
   IterativeImputer, 5 nearest features, median start, 10 iterations, as the official code; a
   column no validator has is set to 1e6 first).
3. Robust validation: the validators' [K · C] LIPC vectors are split by 2-means (Lloyd, 100
   iterations, random initial centres); the mean over the larger cluster (the cluster labelled 1 on
   a tie-less majority, else 0, as the official code) gives s(r, c); a representative's score is
   min_c s(r, c) (the worst class; `score: mean` the mean, the official `use_mean_LIPC`).
4. The ⌊K / 2⌋ lowest-scored representatives are rejected, with every update they represent
   (`removed`); the kept updates are clipped to the median L2 norm of all n updates (`clipped`), as
   the official weights min(1, median / ||Δ_i||).

Validation data (`validation`): `clients` (the paper: each sampled client validates on its own
partition, `validation_size` examples of it; attackers validate honestly) is simulated on the server
with the runtime's partitions; `server` splits the server's own sample (`server_size` examples from
`server_source`, as FLTrust's root dataset) into n equal shards, one per simulated validator.

Where fedsim differs from the official code, and why:
- The official validators use a held-out split of each client's data (`helper.val_data`); fedsim
  validates on (a sample of) the client's training partition, the data the client holds.
- The non-bijective singleton ensemble sets the own weight at the cluster index in the official
  code (`weight_vec[idx]`, which is the client index only when clustering is bijective); here at
  the client's own index. A representative whose peers all have cosine <= 0 is the update itself
  (the official code divides by zero).
- The official aggregate is the clipped, equally weighted mean of the kept updates; here the kept,
  clipped updates go to the scenario's rule (`fedavg` weights them by example counts).
- Malicious validators' crafted LIPCs (the paper's adaptive attacks) are not simulated.
- The 2-means and the validator samples are seeded from the round's generator.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
from pydantic import Field

from fedsim.defenses.base import Defense
from fedsim.defenses.clipping import clip_log, clip_rows
from fedsim.registry import DEFENSES, Params
from fedsim.updates import RoundContext, UpdateBatch

CLASS_CAP = 30  # examples per class each validator evaluates (official validation_test_fun)


class FLShieldParams(Params):
    bijective: bool = Field(True, description="one representative per update (official configs: bijective_flshield true); "
                                              "false: cluster the updates first")
    contrib_adjustment: float = Field(0.25, ge=0, lt=1, description="β: share of a representative coming from the "
                                                                    "cosine-weighted other updates (official 0.25)")
    validation: Literal["clients", "server"] = Field(
        "clients", description="who validates: the sampled clients on their own partitions (paper), or n shards of the server's own sample")
    validation_size: int = Field(300, ge=1, description="clients: examples of each validator's partition used (at most "
                                                        "30 per class are evaluated, as the official code)")
    server_size: int = Field(300, ge=1, description="server: size of the server's own sample, split among n validators")
    server_source: Literal["train", "test"] = Field("train", description="server: split the server's sample comes from")
    score: Literal["min", "mean"] = Field("min", description="a representative's score: its worst class's LIPC (official) "
                                                             "or the mean over classes (use_mean_LIPC)")
    clip: bool = Field(True, description="clip the kept updates to the median norm of all updates (official)")

    def round_problem(self, n: int):
        if n >= 2:
            return None
        return "", f"flshield rejects the lower half of n // 2 representatives: with n={n} it can remove nothing", n


def ensemble_weights(updates: torch.Tensor, beta: float) -> torch.Tensor:
    """[n, n]: row i the weights of representative i over the updates (bijective)."""
    u = updates.to(torch.float64)
    norms = torch.linalg.vector_norm(u, dim=1)
    safe = torch.where(norms > 0, norms, torch.ones_like(norms))
    cos = (u @ u.T) / (safe[:, None] * safe[None, :])
    w = torch.relu(cos) * torch.clamp(norms[:, None] / safe[None, :], max=1.0)  # w[i, j]: j's weight in i's ensemble
    w.fill_diagonal_(0.0)
    others = w.sum(dim=1, keepdim=True)
    w = torch.where(others > 0, beta * w / torch.where(others > 0, others, torch.ones_like(others)), torch.zeros_like(w))
    own = torch.where(others.squeeze(1) > 0, torch.full_like(norms, 1 - beta), torch.ones_like(norms))
    return w + torch.diag(own)


def cluster_updates(updates: torch.Tensor, seed: int) -> list[list[int]]:
    """Official `cluster_grads` (K-Means on cosine-distance rows, K by silhouette); singletons below 10."""
    n = updates.shape[0]
    if n < 10:
        return [[i] for i in range(n)]
    from sklearn.cluster import KMeans
    from sklearn.metrics import silhouette_score
    from sklearn.metrics.pairwise import cosine_distances

    d = cosine_distances(updates.double().cpu().numpy())
    np.fill_diagonal(d, 0)
    best, labels = -np.inf, None
    for k in range(2, min(n, 15)):
        lab = KMeans(n_clusters=k, random_state=seed, n_init=10).fit(d).labels_
        s = silhouette_score(d, lab, metric="precomputed") if 1 < len(set(lab)) < n else -1.0
        if s > best:
            best, labels = s, lab
    clusters = [sorted(np.flatnonzero(labels == c).tolist()) for c in np.unique(labels)]
    return sorted(clusters, key=len, reverse=True)


def representatives(updates: torch.Tensor, clusters: list[list[int]], beta: float) -> torch.Tensor:
    """[K, n] weights of each representative over the updates."""
    n = updates.shape[0]
    ens = ensemble_weights(updates, beta)
    rows = []
    for members in clusters:
        if len(members) == 1:
            rows.append(ens[members[0]])
        else:
            w = torch.zeros(n, dtype=torch.float64)
            w[members] = 1.0 / len(members)
            rows.append(w)
    return torch.stack(rows)


@torch.no_grad()
def class_losses(model: torch.nn.Module, x: np.ndarray, y: np.ndarray, classes: int) -> np.ndarray:
    """Summed cross-entropy per class [C] over the given examples."""
    model.eval()
    out = model(torch.from_numpy(np.asarray(x)))
    loss = torch.nn.functional.cross_entropy(out.float(), torch.from_numpy(np.asarray(y)).long(), reduction="none")
    return np.bincount(np.asarray(y), weights=loss.double().numpy(), minlength=classes)[:classes]


def capped(x: np.ndarray, y: np.ndarray, classes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The first ≤ 30 examples of each class, and the per-class counts [C]."""
    keep = np.zeros(len(y), dtype=bool)
    for c in range(classes):
        keep[np.flatnonzero(y == c)[:CLASS_CAP]] = True
    return x[keep], y[keep], np.bincount(y[keep], minlength=classes)[:classes]


def lipc_tensor(model_of, global_weights: torch.Tensor, reps: torch.Tensor, validators, classes: int) -> np.ndarray:
    """[V, K, C] loss impact per class: (L(G) − L(G + r)) / count, NaN where a validator lacks the class."""
    g = global_weights.cpu().float()
    glob = model_of(g)
    models = [model_of(g + r.float()) for r in reps]
    out = np.full((len(validators), len(models), classes), np.nan)
    for v, (x, y) in enumerate(validators):
        x, y, count = capped(x, y, classes)
        base = class_losses(glob, x, y, classes)
        has = count > 0
        for k, m in enumerate(models):
            out[v, k, has] = (base[has] - class_losses(m, x, y, classes)[has]) / count[has]
    return out


def impute(lipc: np.ndarray) -> np.ndarray:
    """Official `impute_validation`: all-NaN columns to 1e6, then IterativeImputer over validators."""
    v, k, c = lipc.shape
    flat = lipc.reshape(v, k * c).copy()
    if not np.isnan(flat).any():
        return lipc
    flat[:, np.isnan(flat).all(axis=0)] = 1e6
    from sklearn.experimental import enable_iterative_imputer  # noqa: F401
    from sklearn.impute import IterativeImputer

    import warnings

    from sklearn.exceptions import ConvergenceWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)  # the official 10 iterations often stop short of tol
        filled = IterativeImputer(n_nearest_features=5, initial_strategy="median", random_state=42, max_iter=10,
                                  tol=1e-3, keep_empty_features=True).fit_transform(flat)
    return filled.reshape(v, k, c)


def majority_mean(rows: torch.Tensor, generator: torch.Generator, iters: int = 100) -> tuple[torch.Tensor, torch.Tensor]:
    """Official `KMeans_Torch`: 2-means (random initial rows, `iters` Lloyd steps); the mean of the
    cluster labelled 1 if more than half are assigned to it, else of cluster 0; and the assignment."""
    if rows.shape[0] < 2:
        return rows.mean(dim=0), torch.zeros(rows.shape[0], dtype=torch.long)
    centers = rows[torch.randperm(rows.shape[0], generator=generator)[:2]].clone()
    for _ in range(iters):
        assign = torch.cdist(rows, centers).argmin(dim=1)
        for j in range(2):
            if (assign == j).any():
                centers[j] = rows[assign == j].mean(dim=0)
    assign = torch.cdist(rows, centers).argmin(dim=1)
    major = int(assign.double().mean() > 0.5)
    return rows[assign == major].mean(dim=0), assign


def rejected_representatives(scores: torch.Tensor) -> list[int]:
    """The ⌊K/2⌋ lowest scores (official argsort, stable)."""
    order = torch.argsort(scores, stable=True)
    return order[: len(scores) // 2].tolist()


def validator_sets(tools, client_ids, p: FLShieldParams, generator: torch.Generator):
    """[(x, y)] per validator: each client's partition sample, or n shards of the server's own data."""
    if p.validation == "server":
        x, y = tools.server_data(p.server_size, p.server_source)
        shards = np.array_split(np.arange(len(y)), len(client_ids))
        return [(x[s], y[s]) for s in shards]
    rt = getattr(tools, "rt", None)
    if rt is None:
        raise ValueError("flshield validation=clients needs the runtime's client partitions (server tools)")
    out = []
    for cid in client_ids:
        idx = np.asarray(rt.partitions[int(cid)])
        if len(idx) > p.validation_size:
            pick = torch.randperm(len(idx), generator=generator)[: p.validation_size].sort().values.numpy()
            idx = idx[pick]
        out.append((np.asarray(rt.data.x_train[idx]), np.asarray(rt.data.y_train[idx]).astype(np.int64)))
    return out


@DEFENSES.register("flshield", FLShieldParams)
class FLShield(Defense):
    """FLShield: representative models scored by their worst per-class loss impact on validators' data; the lower half rejected, the rest clipped (Kabir et al. 2024)."""

    def before(self, batch: UpdateBatch, ctx: RoundContext) -> tuple[UpdateBatch, dict]:
        p = self.params
        n = batch.updates.shape[0]
        ids = [int(c) for c in batch.client_ids]
        if n < 2:
            return batch, {"removed": []}
        if ctx.tools is None:
            return batch, {"note": "no server tools (bare tensors): flshield needs models and validation data; batch passed unchanged"}
        gen = torch.Generator().manual_seed(int(torch.randint(0, 2**62, (1,), generator=ctx.generator, device=ctx.generator.device)))
        updates = batch.updates.detach().to("cpu", torch.float64)
        clusters = [[i] for i in range(n)] if p.bijective else cluster_updates(updates, int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
        weights = representatives(updates, clusters, p.contrib_adjustment)
        reps = weights @ updates
        validators = validator_sets(ctx.tools, ids, p, gen)
        lipc = impute(lipc_tensor(ctx.tools.model_of, ctx.global_weights, reps, validators, int(ctx.tools.num_classes)))
        v, k, c = lipc.shape
        s, assign = majority_mean(torch.from_numpy(lipc.reshape(v, k * c)), gen)
        s = s.reshape(k, c)
        scores = s.min(dim=1).values if p.score == "min" else s.mean(dim=1)
        rejected = rejected_representatives(scores)
        keep = torch.ones(n, dtype=torch.bool)
        for r in rejected:
            keep[clusters[r]] = False
        log = {
            "removed": [ids[i] for i in range(n) if not keep[i]],
            "scores": {ids[clusters[j][0]] if p.bijective else j: float(scores[j]) for j in range(k)},
            "clusters": [[ids[i] for i in members] for members in clusters],
            "validator_majority": [ids[i] for i in range(v) if int(assign[i]) == int(assign.double().mean() > 0.5)] if v == n else None,
        }
        kept = batch.select(keep.to(batch.updates.device))
        if p.clip:
            bound = float(np.median(torch.linalg.vector_norm(updates, dim=1).numpy()))  # official np.median
            clipped, kept_norms, factor = clip_rows(kept.updates, bound)
            log.update(clip_log(kept.client_ids, kept_norms, factor))
            log["bound"] = bound
            kept = kept.with_updates(clipped)
        return kept, log
