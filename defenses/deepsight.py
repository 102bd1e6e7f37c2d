"""DeepSight (Rieger, Nguyen, Miettinen, Sadeghi, NDSS 2022): label models by their output-layer
update, cluster them on three views, drop the clusters with too many suspicious models, clip.

For local models W_k = G + Δ_k of a round with global model G and P output neurons:

1. Deep model inspection.
   - DDifs (division differences): for noise inputs x_1..x_N (uniform in [0, 1) of the data's input
     shape), DDif_k,c = (1/N) Σ_m p_k(x_m)_c / p_G(x_m)_c with p the softmax output. Computed for
     `num_seeds` independent noise sets, each generated from a seed drawn from the round's
     generator (so every model sees the same inputs, regenerated chunk by chunk, and one local
     model is built at a time: memory does not grow with n or N).
   - NEUPs (normalized update energies of the output layer, the last Linear: the layout's last two
     tensors, weight [P, h] and bias [P]): ε_k,i = |Δb_k,i| + Σ_j |ΔW_k,i,j|,
     c_k,i = ε_k,i² / Σ_j ε_k,j².
   - Threshold exceedings: TE_k = #{i : c_k,i >= ξ_k}, ξ_k = max(0.01, 1/P) · max_i c_k,i.
2. Classification: a model is *suspicious* when TE_k <= median(TE) / 2 (a backdoor concentrates the
   update energy on few output neurons, so it has few threshold exceedings).
3. Ensemble clustering: HDBSCAN on (a) cosine distances of the output-layer bias updates Δb_k,
   (b) Euclidean distances of the DDif vectors, once per noise set, (c) Euclidean distances of the
   NEUP vectors. Each clustering becomes a 0/1 matrix (0 = same cluster); the DDif matrices are
   averaged into one, the three views are averaged, and HDBSCAN clusters that matrix.
4. A cluster is accepted when its share of suspicious models is below τ (paper: "< τ"; a share of
   exactly τ removes the cluster). Every other model is removed (`removed`).
5. Clipping: S = median ||Δ_k|| over *all* n updates (the mean of the two middle values for even n);
   each accepted Δ_k is scaled by min(1, S / ||Δ_k||) (`clipped`, as norm clipping reports it).
   The scenario's aggregator then aggregates: DeepSight takes the plain mean of the clipped
   accepted models, which `fedavg` matches when the example counts are equal.

The authors published no code. Where the paper leaves a detail open this follows the ports, noted
per item: FLPoison (`aggregators/deepsight.py`) and BackFed
(`backfed/servers/anomaly_detection/deepsight_server.py`), both derived from one earlier port.

- ξ uses max(0.01, 1/P) as the paper (and FLPoison); BackFed uses 1/P (the same for P <= 100).
  The comparison is >= as in BackFed (FLPoison: >); they differ only on exact ties, e.g. a row with
  no output-layer change, whose NEUPs are all 0 here (0/0 taken as 0) and so count P exceedings.
- Noise points of HDBSCAN (label -1) are singletons: in the 0/1 matrices a noise point shares a
  cluster with nobody, and in step 4 it is a cluster of its own, so it is kept unless it is
  suspicious itself (BackFed; FLPoison drops all noise points).
- HDBSCAN runs on precomputed distances in all four clusterings (BackFed feeds the final 0/1 matrix
  to HDBSCAN as feature rows), with min_cluster_size=2 and min_samples=1 by default, so that two
  colluding models can form a cluster of their own (the ports use hdbscan's defaults 5/5 or
  min_samples=3: a smaller group of attackers can then only be noise or part of an honest cluster),
  and allow_single_cluster=True (FLPoison's final clustering), so a round of alike models is one
  cluster rather than n noise points.
- DDif ratios are exp(log p_k - log p_G), computed in float64, instead of p_k / (p_G + 1e-30) or
  1e-6: the same value without a division by a softmax output that underflowed to 0.
- N: the paper and the ports use 20,000 noise inputs per set and 3 sets; the default here is
  2,000 per set (3 sets), which keeps a round at CPU scale (a VGG-9 round evaluates
  (n + 1) · 3 · N inputs). Set `num_samples: 20000` to run the paper's value.
- The cosine distances are 1 - cos (one of the ports computes the similarity instead).

Without the server's tools (`ctx.tools is None`, a defense called on bare tensors) there is no
model to probe for DDifs: the batch passes unchanged and the log says so (`note`).
"""

from __future__ import annotations

import numpy as np
import torch
from pydantic import Field

from fedsim.defenses.base import Defense
from fedsim.defenses.clipping import clip_log, clip_rows
from fedsim.defenses.flame import cosine_distances
from fedsim.registry import DEFENSES, Params
from fedsim.updates import RoundContext, UpdateBatch

PROBE_BATCH = 500  # noise inputs per forward pass


class DeepSightParams(Params):
    tau: float = Field(1 / 3, gt=0, le=1, description="a cluster is removed when its share of suspicious models is at least τ (paper: 1/3)")
    num_samples: int = Field(2000, ge=1, description="noise inputs per set for the DDifs (paper and ports: 20000; 2000 keeps rounds at CPU scale)")
    num_seeds: int = Field(3, ge=1, description="independent noise sets, each clustered on its own DDifs (ports: 3)")
    clip: bool = Field(True, description="scale the kept updates to at most the median L2 norm of all updates (paper)")
    min_cluster_size: int = Field(2, ge=2, description="HDBSCAN min_cluster_size of every clustering")
    min_samples: int = Field(1, ge=1, description="HDBSCAN min_samples of every clustering")

    def round_problem(self, n: int):
        """With n <= min_cluster_size every clustering is one cluster of all n (n = 1: noise, and
        never suspicious, TE_1 > TE_1 / 2): the round is kept or removed whole, nothing told apart."""
        if n <= self.min_cluster_size:
            return ("min_cluster_size", f"deepsight needs more than min_cluster_size={self.min_cluster_size} updates to "
                    f"tell clusters apart, got n={n}: they would be kept or removed together", self.min_cluster_size)
        return None


def output_layer(layout) -> tuple[str, str]:
    """Names of the output layer's weight [P, ...] and bias [P]: the layout's last two tensors."""
    if len(layout.names) < 2:
        raise ValueError(f"deepsight needs an output layer (weight, bias) at the end of the model; have {layout.names}")
    (w_name, b_name), (w_shape, b_shape) = layout.names[-2:], layout.shapes[-2:]
    if len(b_shape) != 1 or len(w_shape) < 2 or w_shape[0] != b_shape[0]:
        raise ValueError(f"deepsight: the last two tensors {w_name} {tuple(w_shape)} and {b_name} {tuple(b_shape)} "
                         "are not an output layer's weight [P, h] and bias [P]")
    return w_name, b_name


def neups_and_tes(weight_update: torch.Tensor, bias_update: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """NEUPs [n, P] (float64) and threshold exceedings [n] (int64) of output-layer updates
    `weight_update` [n, P, h] and `bias_update` [n, P]."""
    w = weight_update.to(torch.float64).flatten(2)
    energy = bias_update.to(torch.float64).abs() + w.abs().sum(dim=2)  # ε [n, P]
    sq = energy.square()
    total = sq.sum(dim=1, keepdim=True)
    neups = torch.where(total > 0, sq / torch.where(total > 0, total, torch.ones_like(total)), torch.zeros_like(sq))
    p = neups.shape[1]
    xi = max(0.01, 1.0 / p) * neups.max(dim=1, keepdim=True).values
    return neups, (neups >= xi).sum(dim=1)


def suspicious_by_te(tes: torch.Tensor) -> torch.Tensor:
    """Boolean [n]: TE_k <= median(TE) / 2 (the usual median: mean of the two middle values for even n)."""
    t = tes.to(torch.float64)
    return t <= torch.quantile(t, 0.5) / 2


def noise_seeds(generator: torch.Generator, num_seeds: int) -> list[int]:
    """One seed per noise set, drawn from the round's generator."""
    return torch.randint(0, 2**62, (num_seeds,), generator=generator, device=generator.device).tolist()


def noise_chunks(seed: int, input_shape: tuple[int, ...], num_samples: int, batch: int):
    """The noise set of `seed`: torch.rand chunks of at most `batch` inputs (uniform in [0, 1), CPU
    generator seeded with `seed`), so every model sees the same inputs without keeping them all."""
    g = torch.Generator().manual_seed(int(seed))
    for start in range(0, num_samples, batch):
        yield torch.rand((min(batch, num_samples - start), *input_shape), generator=g)


@torch.no_grad()
def log_probs(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """log softmax of the model's outputs on `x`, float64 [b, P]."""
    device = next(model.parameters()).device
    return torch.log_softmax(model(x.to(device)).to(torch.float64), dim=1).cpu()


def ddifs(model_of, global_weights: torch.Tensor, updates: torch.Tensor, input_shape: tuple[int, ...],
          num_samples: int, seeds: list[int], batch: int = PROBE_BATCH) -> torch.Tensor:
    """DDifs [len(seeds), n, P] (float64) of the local models G + Δ_k, k = rows of `updates`:
    DDif_s,k,c = mean over the noise set s of p_k(x)_c / p_G(x)_c, as exp(log p_k - log p_G).
    `model_of(flat weights) -> module`; one local model is built at a time, the global model's log
    probabilities are kept per chunk."""
    glob = model_of(global_weights).eval()
    log_g = [[log_probs(glob, x) for x in noise_chunks(s, input_shape, num_samples, batch)] for s in seeds]
    out = []
    for u in updates:
        model = model_of(global_weights + u).eval()
        out.append(torch.stack([
            sum(torch.exp(log_probs(model, x) - lg).sum(dim=0)
                for x, lg in zip(noise_chunks(s, input_shape, num_samples, batch), log_g[i])) / num_samples
            for i, s in enumerate(seeds)
        ]))
    return torch.stack(out, dim=1)


def euclidean_distances(x: torch.Tensor) -> np.ndarray:
    """[n, n] float64 Euclidean distances between the rows of `x`, exactly symmetric with a zero diagonal."""
    x = x.to(torch.float64)
    dist = torch.linalg.vector_norm(x[:, None, :] - x[None, :, :], dim=2)
    dist = 0.5 * (dist + dist.T)
    dist.fill_diagonal_(0.0)
    return dist.cpu().numpy()


def hdbscan_labels(dist: np.ndarray, min_cluster_size: int, min_samples: int) -> np.ndarray:
    """HDBSCAN cluster labels (-1 = noise) on a precomputed distance matrix; fewer than 2 points are noise."""
    n = dist.shape[0]
    if n < 2:
        return np.full(n, -1, dtype=np.int64)
    from sklearn.cluster import HDBSCAN  # imported here: scikit-learn costs ~1 s at start-up

    return HDBSCAN(
        min_cluster_size=min(min_cluster_size, n), min_samples=min(min_samples, n), metric="precomputed",
        allow_single_cluster=True, copy=True,
    ).fit(dist).labels_.astype(np.int64)


def co_cluster_distances(labels: np.ndarray) -> np.ndarray:
    """[n, n]: 0 where two models share a cluster (noise shares with nobody), else 1; zero diagonal."""
    labels = np.asarray(labels)
    same = (labels[:, None] == labels[None, :]) & (labels[:, None] >= 0)
    dist = 1.0 - same.astype(np.float64)
    np.fill_diagonal(dist, 0.0)
    return dist


def ensemble_clusters(cos_dist: np.ndarray, ddif_dists: list[np.ndarray], neup_dist: np.ndarray,
                      min_cluster_size: int, min_samples: int) -> np.ndarray:
    """The final labels: HDBSCAN on the mean of the three views' 0/1 matrices (DDif sets averaged first)."""
    def votes(dist):
        return co_cluster_distances(hdbscan_labels(dist, min_cluster_size, min_samples))

    ddif_votes = np.mean([votes(d) for d in ddif_dists], axis=0)
    merged = np.mean([votes(cos_dist), ddif_votes, votes(neup_dist)], axis=0)
    return hdbscan_labels(merged, min_cluster_size, min_samples)


def accepted_models(labels: np.ndarray, suspicious: np.ndarray, tau: float) -> np.ndarray:
    """Boolean [n]: the model's cluster has a share of suspicious models below τ; a noise point
    (-1) is its own cluster, so it is accepted exactly when it is not suspicious."""
    labels, suspicious = np.asarray(labels), np.asarray(suspicious, dtype=bool)
    keep = ~suspicious  # noise points; cluster members are overwritten below
    for c in np.unique(labels[labels >= 0]):
        members = labels == c
        keep[members] = suspicious[members].sum() / members.sum() < tau
    return keep


@DEFENSES.register("deepsight", DeepSightParams)
class DeepSight(Defense):
    """DeepSight: drop model clusters rich in few-neuron (suspicious) output updates, clip to the median norm (Rieger et al. 2022)."""

    def before(self, batch: UpdateBatch, ctx: RoundContext) -> tuple[UpdateBatch, dict]:
        n = batch.updates.shape[0]
        if n == 0:
            return batch, {}
        if ctx.tools is None:
            return batch, {"note": "no server tools (bare tensors): deepsight cannot probe models for DDifs; batch passed unchanged"}
        p = self.params
        w_name, b_name = output_layer(ctx.layout)
        w_shape = ctx.layout.shapes[ctx.layout.names.index(w_name)]
        updates = batch.updates
        weight_update = updates[:, ctx.layout.slice(w_name)].reshape(n, w_shape[0], -1)
        bias_update = updates[:, ctx.layout.slice(b_name)]

        neups, tes = neups_and_tes(weight_update, bias_update)
        suspicious = suspicious_by_te(tes).cpu().numpy()

        gw = ctx.global_weights.to(updates.device, torch.float32)
        seeds = noise_seeds(ctx.generator, p.num_seeds)
        dd = ddifs(ctx.tools.model_of, gw, updates.to(torch.float32), tuple(ctx.tools.input_shape), p.num_samples, seeds)
        if dd.shape[2] != w_shape[0]:
            raise ValueError(f"deepsight: the model has {dd.shape[2]} outputs but its last layer {w_name} has {w_shape[0]} neurons")

        labels = ensemble_clusters(cosine_distances(bias_update), [euclidean_distances(d) for d in dd],
                                   euclidean_distances(neups), p.min_cluster_size, p.min_samples)
        keep_np = accepted_models(labels, suspicious, p.tau)
        keep = torch.from_numpy(keep_np).to(updates.device)

        ids = [int(c) for c in batch.client_ids]
        norms = torch.linalg.vector_norm(updates, dim=1)
        kept = batch.select(keep)
        if p.clip:
            bound = float(torch.quantile(norms.to(torch.float64), 0.5))
            clipped, kept_norms, factor = clip_rows(kept.updates, bound)
            log = clip_log(kept.client_ids, kept_norms, factor)
            log["bound"] = bound
            kept = kept.with_updates(clipped)
        else:
            log = {"clipped": {}}
        log["norms"] = {c: float(v) for c, v in zip(ids, norms.tolist())}
        log["removed"] = [c for c, k in zip(ids, keep_np.tolist()) if not k]
        log["suspicious"] = [c for c, s in zip(ids, suspicious.tolist()) if s]
        log["te"] = {c: int(t) for c, t in zip(ids, tes.tolist())}
        log["clusters"] = {c: int(label) for c, label in zip(ids, labels.tolist())}
        return kept, log
