"""CrowdGuard (Rieger, Krauß, Miettinen, Dmitrienko, Sadeghi, NDSS 2024): clients validate each
other's models on their own data by the behaviour of the models' hidden layers, vote, and the
server keeps the models the majority of votes calls benign.

In the real protocol every validating client receives all of the round's local models and runs
the analysis below inside a trusted execution environment (SGX), so that neither its data nor the
models leak; the server's vote aggregation runs in an enclave too. fedsim simulates the clients'
side on the server: validating client v is each of the round's clients, its data its own partition
(`rt.client_data(pid)`, the clean examples an honest client trains on, also for attackers: every
validator votes honestly here, which is the worst case for the defense's majority, not the best).

Validation by client v with data X_v (labels y), the round's local models θ_1..θ_n (own index o)
and the global model G (official: `CrowdGuardClientValidation.validate_models`):

1. Hidden-layer outputs h_l(θ, x) of every Conv2d and Linear layer l (official:
   `predict_internal_states`, the outputs of those modules), for every model and sample.
2. Distances to the global model, per sample s, model i, layer l, for each metric
   (cosine: 1 - cos; Euclidean: ‖·‖_2):  D[s,i,l] = dist(h_l(θ_i, x_s), h_l(G, x_s)).
3. Relative to v's own model: R[s,i,l] = D[s,i,l] / D[s,o,l] (0 where D[s,o,l] = 0); averaged over
   the samples of each label y: R̄[y,i,l]; then r = R̄ - 1 and the signed square r·|r|.
4. Each model's feature vector: the values of all labels and layers side by side.
5. Iterative pruning (per metric), starting with nothing pruned, over the models other than v's
   own and not yet pruned:
   - add the column-wise median vector, standardise each column (zero mean, unit variance), take
     the first principal component's score of each row;
   - split the scores at their median into the distances above and below it, and test: Welch-free
     Student t-test, two-sample Kolmogorov-Smirnov and Levene, any p < `p_value` (0.01); a
     boxplot outlier beyond `whis` (5.5) interquartile ranges; or a 3σ outlier (max |s - mean|/std
     >= `sigma`, 3). Any of these: the set still has a poisoned model;
   - single-linkage agglomerative clustering of the scores into 2 clusters; the rows outside the
     median vector's cluster join the pruned set;
   - continue while a test fired and the pruned set grew, stop (keeping the previous pruned set)
     if it would exceed ⌊(n - 1)/2⌋ models.
   The union over the two metrics is v's "poisoned" vote; v votes benign for every other model.
6. The server (official tutorial `defend`): single-linkage agglomerative clustering of the n
   binary vote vectors into 2 clusters, DBSCAN (eps 0.5, min_samples 1) on the biggest cluster
   (binary votes: identical vectors form a cluster), and the biggest DBSCAN cluster's vote vector
   decides: the models it calls benign are kept, the rest `removed`; the scenario's rule then
   aggregates the kept ones (official: FedAvg).

Where fedsim differs and why:
- The official tutorial validates against a freshly initialised `Net()` as its global model; here
  the round's global model, as the paper describes.
- In the tutorial, trimming a pruned set that grew past ⌊(n - 1)/2⌋ (removing the members nearest
  or farthest from the median) computes a list that is never used: the loop then stops with the
  previous pruned set. That effective behaviour is what is implemented.
- Boxplot outliers are computed with numpy's percentiles (matplotlib's `boxplot_stats`, which the
  tutorial calls through `plt.boxplot`, uses the same) instead of drawing a plot.
- `max_samples` caps each validator's data (a seeded subsample; default: all of it).
- A model with no Conv2d or Linear layer cannot be inspected and is refused.

Cost per round: every one of the n validators runs n + 1 models over its own data (n·(n + 1)
forward passes over a partition), plus O(n²) small PCA/clustering steps; in deployment that is
each client's work, in fedsim it is the server's.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
from pydantic import Field

from fedsim.defenses.base import Defense
from fedsim.registry import DEFENSES, Params
from fedsim.updates import RoundContext, UpdateBatch

BENIGN, POISONED = 1, 0
EVAL_BATCH = 500


class CrowdGuardParams(Params):
    p_value: float = Field(0.01, gt=0, lt=1, description="significance level of the t, KS and Levene tests (official: 0.01)")
    whis: float = Field(5.5, gt=0, le=100, description="boxplot whisker length in interquartile ranges for outliers (official: 5.5)")
    sigma: float = Field(3.0, gt=0, le=100, description="a score this many standard deviations from the mean is an outlier (official: 3)")
    dbscan_eps: float = Field(0.5, gt=0, le=100, description="DBSCAN eps on the vote vectors at the server (official: 0.5)")
    max_samples: int | None = Field(None, ge=1, le=1_000_000, description="validation examples per client (a seeded subsample; null: its whole partition)")

    def round_problem(self, n: int):
        if n < 3:
            return ("", f"crowdguard needs at least 3 updates to prune any (it prunes at most ⌊(n - 1)/2⌋), got n={n}", n)
        return None


@torch.no_grad()
def hidden_outputs(model: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """The outputs of every Conv2d and Linear module, flattened per sample: [S, F_l] per layer."""
    layers = [m for m in model.modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear))]
    if not layers:
        raise ValueError(f"crowdguard inspects Conv2d and Linear layers; {type(model).__name__} has none")
    model.eval()
    outs: list[list[torch.Tensor]] = [[] for _ in layers]
    hooks = [m.register_forward_hook(lambda _m, _i, o, k=k: outs[k].append(o.detach().flatten(1).to(torch.float64)))
             for k, m in enumerate(layers)]
    try:
        for s in range(0, x.shape[0], EVAL_BATCH):
            model(x[s:s + EVAL_BATCH])
    finally:
        for h in hooks:
            h.remove()
    return [torch.cat(o) for o in outs]


def layer_distances(local: list[list[torch.Tensor]], glob: list[torch.Tensor], metric: str) -> torch.Tensor:
    """D [S, n, L]: per sample, model and layer, the distance of the local model's output to the global one's."""
    cols = []
    for l, g in enumerate(glob):
        h = torch.stack([m[l] for m in local], dim=1)  # [S, n, F]
        if metric == "cosine":
            cols.append(1 - torch.nn.functional.cosine_similarity(h, g[:, None, :], dim=2, eps=1e-12))
        else:
            cols.append(torch.linalg.vector_norm(h - g[:, None, :], dim=2))
    return torch.stack(cols, dim=2)


def relation_features(dist: torch.Tensor, labels: np.ndarray, own: int) -> np.ndarray:
    """[n, labels·L]: per label the mean over its samples of D / D_own, minus 1, squared with its sign."""
    own_d = dist[:, own:own + 1, :]
    rel = torch.where(own_d != 0, dist / torch.where(own_d != 0, own_d, torch.ones_like(own_d)), torch.zeros_like(dist))
    labels = np.asarray(labels)
    blocks = []
    for y in dict.fromkeys(labels.tolist()):  # labels in order of first appearance, as the tutorial
        r = rel[torch.from_numpy(labels == y)].mean(dim=0) - 1  # [n, L]
        blocks.append(r * r.abs())
    return torch.cat(blocks, dim=1).numpy()


def first_component(rows: np.ndarray) -> np.ndarray:
    """Scores on the first principal component of the column-standardised rows (sklearn's scale + PCA)."""
    from sklearn.decomposition import PCA
    from sklearn.preprocessing import scale

    return PCA(n_components=1).fit_transform(scale(rows))[:, 0]


def has_poisoned(scores: np.ndarray, p_value: float, whis: float, sigma: float) -> bool:
    """The tutorial's exit criterion: any significance test or outlier rule fires on the PCA scores."""
    from scipy.stats import kstest, levene, ttest_ind

    med = np.median(scores)
    above = np.abs(scores[scores >= med] - med)
    below = np.abs(scores[scores < med] - med)
    fired = False
    if len(above) >= 1 and len(below) >= 1:
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # scipy's note on small or constant samples
            ps = [ttest_ind(above, below).pvalue, kstest(above, below).pvalue, levene(above, below).pvalue]
        fired = any(np.isfinite(p) and p < p_value for p in ps)
    q1, q3 = np.percentile(scores, [25, 75])
    iqr = q3 - q1
    boxplot = bool(np.any((scores < q1 - whis * iqr) | (scores > q3 + whis * iqr)))
    std = np.std(scores)
    three_sigma = bool(std > 0 and np.max(np.abs(scores - np.mean(scores))) / std >= sigma)
    return fired or boxplot or three_sigma


def two_clusters(values: np.ndarray) -> np.ndarray:
    """Single-linkage agglomerative clustering of 1-D or row values into 2 clusters."""
    from sklearn.cluster import AgglomerativeClustering

    v = values.reshape(len(values), -1)
    return AgglomerativeClustering(n_clusters=2, linkage="single").fit(v).labels_


def prune(features: np.ndarray, own: int, p_value: float, whis: float, sigma: float) -> set[int]:
    """The models (row indices) one metric's iterative pruning marks as poisoned."""
    n = features.shape[0]
    limit = (n - 1) // 2
    pruned: set[int] = set()
    while True:
        rest = [i for i in range(n) if i != own and i not in pruned]
        if len(rest) <= 1:
            break
        rows = np.vstack([features[rest], np.median(features[rest], axis=0)])
        scores = first_component(rows)
        suspicious = has_poisoned(scores, p_value, whis, sigma)
        labels = two_clusters(scores)
        grown = pruned | {m for m, lab in zip(rest, labels[:-1]) if lab != labels[-1]}
        if len(grown) > limit or not (suspicious and len(grown) > len(pruned)):
            break
        pruned = grown
    return pruned


def validate(local_outputs: list[list[torch.Tensor]], global_outputs: list[torch.Tensor], labels: np.ndarray,
             own: int, p_value: float, whis: float, sigma: float) -> np.ndarray:
    """One validator's vote vector [n]: BENIGN / POISONED per model (its own model always BENIGN)."""
    poisoned: set[int] = set()
    for metric in ("cosine", "euclidean"):
        feats = relation_features(layer_distances(local_outputs, global_outputs, metric), labels, own)
        poisoned |= prune(feats, own, p_value, whis, sigma)
    votes = np.full(len(local_outputs), BENIGN, dtype=np.int64)
    votes[sorted(poisoned)] = POISONED
    votes[own] = BENIGN
    return votes


def biggest(labels: np.ndarray) -> int:
    """The label of the biggest cluster (the first of equals, in order of first appearance)."""
    order = list(dict.fromkeys(np.asarray(labels).tolist()))
    sizes = [int(np.sum(labels == lab)) for lab in order]
    return order[int(np.argmax(sizes))]


def server_decision(votes: np.ndarray, eps: float) -> np.ndarray:
    """The vote vector [n] the server follows: agglomerative (2 clusters) then DBSCAN on the biggest cluster."""
    from sklearn.cluster import DBSCAN

    votes = np.asarray(votes, dtype=np.float64)
    if votes.shape[0] < 2:
        return votes[0].astype(np.int64)
    ac = two_clusters(votes)
    members = np.flatnonzero(ac == biggest(ac))
    db = DBSCAN(eps=eps, min_samples=1).fit(votes[members]).labels_
    first = np.flatnonzero(db == biggest(db))[0]
    return votes[members[first]].astype(np.int64)


@DEFENSES.register("crowdguard", CrowdGuardParams)
class CrowdGuard(Defense):
    """CrowdGuard: clients vote on every model by its hidden-layer behaviour on their data; majority cluster decides (Rieger et al. 2024)."""

    def before(self, batch: UpdateBatch, ctx: RoundContext) -> tuple[UpdateBatch, dict]:
        n = batch.updates.shape[0]
        if n == 0:
            return batch, {}
        if ctx.tools is None:
            return batch, {"note": "no server tools (bare tensors): crowdguard has no models or client data; batch passed unchanged"}
        if n < 3:
            return batch, {"note": f"crowdguard prunes at most ⌊(n - 1)/2⌋ of n={n} models: nothing to decide"}
        p, tools = self.params, ctx.tools
        gw = ctx.global_weights.to(torch.float32).cpu()
        updates = batch.updates.to(torch.float32).cpu()
        ids = [int(c) for c in batch.client_ids]
        glob, models = tools.model_of(gw), [tools.model_of(gw + u) for u in updates]
        votes = []
        for own, pid in enumerate(ids):
            x, y = tools.rt.client_data(pid)
            if p.max_samples is not None and len(y) > p.max_samples:
                pick = torch.randperm(len(y), generator=ctx.generator, device=ctx.generator.device)[:p.max_samples].cpu()
                pick = np.sort(pick.numpy())
                x, y = x[pick], y[pick]
            xt = torch.as_tensor(np.asarray(x), dtype=torch.float32)
            local = [hidden_outputs(m, xt) for m in models]
            votes.append(validate(local, hidden_outputs(glob, xt), np.asarray(y), own, p.p_value, p.whis, p.sigma))
        votes_np = np.stack(votes)
        final = server_decision(votes_np, p.dbscan_eps)
        keep = final == BENIGN
        log = {
            "votes": {v: {c: int(b) for c, b in zip(ids, row)} for v, row in zip(ids, votes_np.tolist())},
            "removed": [c for c, k in zip(ids, keep.tolist()) if not k],
        }
        return batch.select(torch.from_numpy(keep).to(batch.updates.device)), log
