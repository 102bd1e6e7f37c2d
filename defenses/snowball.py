"""Snowball (Qin, Chen, Zhi, Yan, Deng, AAAI 2024): bottom-up election of a few trusted updates, then a
top-down election that grows them with a VAE trained on update differences.

"Resisting Backdoor Attacks in Federated Learning via Bidirectional Elections and Individual
Perspective" (official code github.com/zhenqincn/Snowball, `fl_core/anti_poison/snowball.py`,
`snowball`; arguments in `main.py`). For the round's n updates Δ_1..Δ_n:

1. Bottom-up election, layer by layer (every tensor of the scored layers: weight and bias vote
   apart). For each candidate i, the differences D_i = {Δ_i^l − Δ_j^l : j = 1..n} (its own is 0);
   the ct largest by L2 norm seed, with 0, a K-Means of ct + 1 clusters over D_i (one start, those
   initial centres). Candidate i's cluster is the set of j whose difference fell with its own 0:
   the peers it votes for. Its voting weight is the Calinski-Harabasz score s_i of that clustering.
   Voters with s_i > 0 vote (or, if fewer than ⌊0.1 n⌋ do, the ⌊0.1 n⌋ best); their scores are
   min-max normalised over the layer's n voters, and each voter adds its normalised score to every
   member of its cluster. The ⌈0.1 n⌉ updates with the most votes over all layers are the selectees.
2. Top-down election. A VAE (encoder in → h → h → (μ, softplus log σ²), decoder z → h → h → in with
   a sigmoid output; Kaiming-normal init; Adam, batch 8; loss Σ squared error + KL) is trained for
   E^VI epochs on sigmoid(Δ_a − Δ_b) over ordered pairs of selectees. While fewer than ⌊M n⌋ are
   selected: E^VT more epochs on the current selectees' differences, then each remaining candidate
   r is scored by the mean over selectees a of its reconstruction error on ±(Δ_a − Δ_r) (L = 10
   latent samples each), and the min(⌈M^E n⌉, ⌊M n⌋ − |selected|) lowest join.
3. The selectees are aggregated by the scenario's rule (the official code: the example-weighted
   mean, `fedavg`); the others are `removed`.

Defaults, the official `main.py`: ct = 10, M (`vt`) = 0.5, M^E (`v_step`) = 0.05, S^H = 256,
S^L = 64, E^VI = 270, E^VT = 30; the selectee share 0.1 is a constant there.

Where fedsim differs from the official code, and why:
- Scored layers: the official code picks tensors by name per model ('conv1' and 'fc2' for its
  CNNs: the first and the last layer). Here `layers: first_last` takes the layout's first and last
  layer (each a weight and its bias, as laid out), `all` every tensor; the VAE sees the same tensors.
- ct is capped at n − 2 (ct + 1 clusters of n points need ct + 1 < n for a Calinski-Harabasz
  score; the official default 10 assumes 50 updates a round). A clustering with one label left, or
  as many labels as points, scores 0.
- The initial selectees are at least 2 (`min_selected`), so the VAE has differences to learn from
  (⌈0.1 n⌉ is 1 below 11 updates, whose difference set is empty: the official VAE then stays untrained).
- The official code aggregates only the bottom-up selectees during dataset-specific warm-up rounds
  (25 for MNIST, 30 Fashion-MNIST, 100 CIFAR-10, 80 FEMNIST, 30 Sent140); `top_down_from_round`
  sets it (default 1: from the first round).
- Every random draw (VAE init, batch order, latent samples) comes from a torch seed drawn from the
  round's generator, so a round is reproducible; the VAE trains on CPU in float32.
- The Calinski-Harabasz score is invariant to translation, and every D_i is the same point set
  reflected and shifted: voters whose K-Means found the same partition score the same, up to
  rounding. Min-max normalisation of scores equal within a relative 1e-9 gives every voter weight 1
  (the official code divides rounding noise by rounding noise, or 0 by 0).
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np
import torch
from pydantic import Field
from torch import nn

from fedsim.defenses.base import Defense
from fedsim.registry import DEFENSES, Params
from fedsim.updates import RoundContext, UpdateBatch


class SnowballParams(Params):
    ct: int = Field(10, ge=1, description="cluster threshold: each voter's K-Means has ct + 1 clusters, seeded by its ct "
                                          "farthest peers (official 10; capped at n - 2)")
    select_share: float = Field(0.1, gt=0, le=1, description="share of updates the bottom-up election selects (official 0.1)")
    min_selected: int = Field(2, ge=1, description="at least this many bottom-up selectees (2: the VAE needs a difference)")
    vt: float = Field(0.5, gt=0, le=1, description="M: the top-down election stops at floor(M n) selectees (official 0.5)")
    v_step: float = Field(0.05, gt=0, le=1, description="M^E: each top-down step adds ceil(M^E n) updates (official 0.05)")
    vae_hidden: int = Field(256, ge=1, description="S^H: hidden width of the VAE's encoder and decoder (official 256)")
    vae_latent: int = Field(64, ge=1, description="S^L: latent dimension of the VAE (official 64)")
    vae_initial: int = Field(270, ge=0, description="E^VI: epochs of the VAE's initial training (official 270)")
    vae_tuning: int = Field(30, ge=0, description="E^VT: epochs of tuning before each top-down step (official 30)")
    recon_samples: int = Field(10, ge=1, description="latent samples L per reconstruction error (official 10)")
    layers: Literal["first_last", "all"] = Field("first_last", description="tensors that vote and feed the VAE: the first "
                                                                            "and last layer (official: conv1, fc2) or all")
    top_down_from_round: int = Field(1, ge=1, description="before this round only the bottom-up selectees are kept "
                                                          "(official warm-up: 25 MNIST, 30 FMNIST, 100 CIFAR-10)")

    def round_problem(self, n: int):
        if n >= 3:
            return None
        return "", f"snowball needs at least 3 updates (ct + 1 clusters of n points need n >= 3), got n={n}", n


# ----------------------------------------------------------------------------- bottom-up election


def calinski_harabasz(x: np.ndarray, labels: np.ndarray) -> float:
    """sklearn's Calinski-Harabasz score, 0 where it is undefined (one label, or one per point)."""
    k = len(np.unique(labels))
    if k < 2 or k >= len(labels):
        return 0.0
    from sklearn.metrics import calinski_harabasz_score

    return float(calinski_harabasz_score(x, labels))


def voter_clusters(layer: np.ndarray, ct: int) -> tuple[list[np.ndarray], np.ndarray]:
    """For each voter i of the [n, d] layer: the members of its cluster and its CH score."""
    from sklearn.cluster import KMeans

    n = layer.shape[0]
    ct = max(1, min(ct, n - 2))
    members, scores = [], np.zeros(n)
    for i in range(n):
        dif = layer[i][None, :] - layer  # [n, d], row i is 0
        far = np.argsort(np.linalg.norm(dif, axis=1), kind="stable")[-ct:]
        init = dif[np.concatenate([[i], far])]
        labels = KMeans(n_clusters=ct + 1, init=init, n_init=1, random_state=0).fit_predict(dif)
        members.append(np.flatnonzero(labels == labels[i]))
        scores[i] = calinski_harabasz(dif, labels)
    return members, scores


def layer_votes(members: list[np.ndarray], scores: np.ndarray) -> np.ndarray:
    """Votes [n] one layer casts: effective voters add their min-max normalised score to their cluster."""
    n = len(scores)
    effective = np.flatnonzero(scores > 0)
    if len(effective) < int(n * 0.1):
        effective = np.argsort(-scores, kind="stable")[: int(n * 0.1)]
    span = scores.max() - scores.min()
    if span <= 1e-9 * max(abs(scores.max()), abs(scores.min()), 1e-300):
        norm = np.ones(n)  # equal scores (up to rounding): every voter counts the same
    else:
        norm = (scores - scores.min()) / span
    votes = np.zeros(n)
    for i in effective:
        votes[members[i]] += norm[i]
    return votes


def bottom_up(layers: list[np.ndarray], ct: int, n_select: int) -> tuple[list[int], np.ndarray]:
    """(selectees, votes [n]) over the scored layers [n, d_l]."""
    votes = np.zeros(layers[0].shape[0])
    for layer in layers:
        votes += layer_votes(*voter_clusters(layer, ct))
    order = np.argsort(-votes, kind="stable")
    return order[:n_select].tolist(), votes


# ------------------------------------------------------------------------------ top-down election


DECODE_CHUNK = 512  # latent rows decoded at once (bounds the [rows, d] output in memory)


class VAE(nn.Module):
    def __init__(self, dim: int, latent: int, hidden: int) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU())
        self.mean, self.logvar = nn.Linear(hidden, latent), nn.Linear(hidden, latent)
        self.dec = nn.Sequential(nn.Linear(latent, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                 nn.Linear(hidden, dim), nn.Sigmoid())
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.kaiming_normal_(m.weight, nonlinearity="relu")

    def encode(self, x):
        h = self.enc(x)
        return self.mean(h), nn.functional.softplus(self.logvar(h))

    def forward(self, x):
        mu, logvar = self.encode(x)
        z = mu + torch.randn_like(mu) * torch.exp(0.5 * logvar)
        return self.dec(z), mu, logvar


def pair_differences(rows: torch.Tensor) -> torch.Tensor:
    """Δ_a − Δ_b over ordered pairs a != b of the rows [s, d]: [s (s − 1), d]."""
    s = rows.shape[0]
    dif = rows[:, None, :] - rows[None, :, :]
    off = ~torch.eye(s, dtype=torch.bool)
    return dif[off]


def train_vae(vae: VAE, data: torch.Tensor, epochs: int) -> None:
    """Adam (lr 1e-3), batches of 8 in a fresh random order each epoch, on sigmoid(data)."""
    x = torch.sigmoid(data)
    opt = torch.optim.Adam(vae.parameters(), fused=True)  # one kernel over all parameters: ~9x the default step on CPU
    vae.train()
    for _ in range(epochs):
        for idx in torch.randperm(len(x)).split(8):
            batch = x[idx]
            opt.zero_grad()
            out, mu, logvar = vae(batch)
            loss = (out - batch).square().sum() - 0.5 * torch.sum(1 + logvar - mu.square() - logvar.exp())
            loss.backward()
            opt.step()


@torch.no_grad()
def reconstruction_errors(vae: VAE, selected: torch.Tensor, candidates: torch.Tensor, samples: int) -> torch.Tensor:
    """[r]: for each candidate row, the mean over the selectees' ±(Δ_a − Δ_r) (zero differences
    skipped) of the squared reconstruction error of sigmoid(dif), averaged over `samples` latent draws.

    The latent draws are taken candidate by candidate, sample by sample (the official loop's order);
    the decoding of all of them is batched, so the decoder's large output layer is read once per
    chunk of rows instead of once per candidate and draw."""
    vae.eval()
    xs, owner = [], []
    for k, r in enumerate(candidates):
        dif = selected - r[None, :]
        dif = dif[dif.sum(dim=1) != 0]
        if len(dif):
            xs.append(torch.sigmoid(torch.cat([dif, -dif])))
            owner.append(k)
    err = torch.zeros(len(candidates))
    if not xs:
        return err
    mu, logvar = vae.encode(torch.cat(xs))
    std = torch.exp(0.5 * logvar)
    z, target, row_of = [], [], []
    start = 0
    for k, x in zip(owner, xs):
        rows = slice(start, start + len(x))
        for _ in range(samples):
            z.append(mu[rows] + torch.randn_like(mu[rows]) * std[rows])
            row_of.append(torch.arange(rows.start, rows.stop))
        start += len(x)
    z, row_of = torch.cat(z), torch.cat(row_of)
    x_all = torch.cat(xs)
    sq = torch.empty(len(z))
    for s in range(0, len(z), DECODE_CHUNK):
        part = slice(s, s + DECODE_CHUNK)
        sq[part] = (vae.dec(z[part]) - x_all[row_of[part]]).square().sum(dim=1)
    per_row = torch.zeros(len(x_all)).index_add_(0, row_of, sq) / samples
    start = 0
    for k, x in zip(owner, xs):
        err[k] = per_row[start:start + len(x)].mean()
        start += len(x)
    return err


def top_down(flat: torch.Tensor, selected: list[int], p: SnowballParams) -> tuple[list[int], list[list[int]]]:
    """Grow `selected` to floor(vt n) with the VAE; returns it and the ids added at each step."""
    n = flat.shape[0]
    target = int(n * p.vt)
    steps: list[list[int]] = []
    if len(selected) >= target:
        return selected, steps
    vae = VAE(flat.shape[1], p.vae_latent, p.vae_hidden)
    train_vae(vae, pair_differences(flat[selected]), p.vae_initial)
    while len(selected) < target:
        train_vae(vae, pair_differences(flat[selected]), p.vae_tuning)
        rest = [i for i in range(n) if i not in selected]
        err = reconstruction_errors(vae, flat[selected], flat[rest], p.recon_samples)
        take = min(math.ceil(n * p.v_step), target - len(selected))
        added = [rest[i] for i in torch.argsort(err, stable=True)[:take].tolist()]
        selected = selected + added
        steps.append(added)
    return selected, steps


def scored_names(layout, layers: str) -> list[str]:
    if layers == "all":
        return list(layout.names)
    layer_of = [name.rsplit(".", 1)[0] for name in layout.names]
    first, last = layer_of[0], layer_of[-1]
    return [name for name, lay in zip(layout.names, layer_of) if lay in (first, last)]


@DEFENSES.register("snowball", SnowballParams)
class Snowball(Defense):
    """Snowball: bottom-up K-Means votes of each update for its peers, then a VAE on update differences grows the trusted set (Qin et al. 2024)."""

    def before(self, batch: UpdateBatch, ctx: RoundContext) -> tuple[UpdateBatch, dict]:
        p = self.params
        n = batch.updates.shape[0]
        ids = [int(c) for c in batch.client_ids]
        if n < 3:
            return batch, {"removed": [], "note": f"snowball needs at least 3 updates, got {n}"}
        lay = ctx.layout
        names = scored_names(lay, p.layers)
        rows = batch.updates.detach().to("cpu", torch.float32)
        tensors = [rows[:, lay.slice(name)] for name in names]
        n_select = min(n, max(p.min_selected, math.ceil(n * p.select_share)))
        seed = int(torch.randint(0, 2**62, (1,), generator=ctx.generator, device=ctx.generator.device))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            elected, votes = bottom_up([t.double().numpy() for t in tensors], p.ct, n_select)
            steps: list[list[int]] = []
            selected = elected
            if ctx.round >= p.top_down_from_round:
                selected, steps = top_down(torch.cat(tensors, dim=1), elected, p)
        keep = torch.zeros(n, dtype=torch.bool)
        keep[selected] = True
        log = {
            "removed": [c for c, k in zip(ids, keep.tolist()) if not k],
            "votes": {c: float(v) for c, v in zip(ids, votes.tolist())},
            "elected": [ids[i] for i in elected],
            "top_down": [[ids[i] for i in step] for step in steps],
        }
        return batch.select(keep.to(batch.updates.device)), log
