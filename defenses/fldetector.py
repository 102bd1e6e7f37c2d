"""FLDetector (Zhang, Cao, Jia, Gong, KDD 2022): malicious clients are the ones whose updates the
server cannot predict from their own history.

The server keeps the last N pairs (s_k, y_k) of global-model differences s = w_t − w_{t−1} and
global-gradient differences y = g_t − g_{t−1} (g_t: the aggregated update at w_t, negated into a
gradient) and approximates the Hessian-vector product H·v with L-BFGS (the compact
representation of Byrd, Nocedal and Schnabel 1994, B_0 = σI with σ = y_mᵀs_m / s_mᵀs_m). A
client's update is predicted as ĝ_i = g_i^τ + H(w_t − w_τ) from its update of round τ, its
prediction error ‖ĝ_i − g_i‖ is normalised by the round's sum over the predicted clients, and its
suspicion score is the mean of its normalised errors over the last N rounds. The gap statistic
(Tibshirani et al. 2001, on the scores scaled to [0, 1], k = 1..7, 10 uniform references, as in
the official code) decides whether the scores form more than one cluster; if so, 2-means flags
the cluster with the larger scores and those clients are removed, in this round
and (`ban`, as the paper removes detected clients) in every later one. The paper then restarts
training from a checkpoint; that is not done here.

Partial participation (not in the paper, whose clients all take part every round): τ is the last
round within the window in which the client took part, so only clients seen in the last N rounds
are predicted and scored; the server keeps the global models of the last N rounds and the last
update of clients seen in them, never one vector per registered client. With every client in every
round this is the paper's algorithm (τ = t − 1). Detection starts once the window holds N pairs.
The whole state (pairs, models, client updates, scores, banned clients) is checkpointed.
k-means on the 1-D scores is solved exactly by dynamic programming (`kmeans_1d`) where the official
code runs sklearn's Lloyd iterations: the same objective at its optimum, deterministic, and fast
enough for the 77 clusterings of each round's gap statistic.
"""

from __future__ import annotations

import numpy as np
import torch
from pydantic import Field

from fedsim.defenses.base import Defense
from fedsim.registry import DEFENSES, Params
from fedsim.updates import RoundContext, UpdateBatch


def lbfgs_hvp(s: torch.Tensor, y: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """B·v for the L-BFGS matrix B built from the pairs (columns of s, y: [d, m]), compact form;
    `v` is one vector [d] or several as columns [d, k]."""
    sty = s.T @ y
    sts = s.T @ s
    lower = torch.tril(sty, diagonal=-1)  # L: strictly lower part of SᵀY
    sigma = (y[:, -1] @ s[:, -1]) / (s[:, -1] @ s[:, -1])
    middle = torch.cat([torch.cat([sigma * sts, lower], dim=1),
                        torch.cat([lower.T, -torch.diag(torch.diagonal(sty))], dim=1)], dim=0)
    rhs = torch.cat([sigma * (s.T @ v), y.T @ v])
    return sigma * v - torch.cat([sigma * s, y], dim=1) @ torch.linalg.solve(middle, rhs)


def kmeans_1d(x: np.ndarray, k: int) -> tuple[float, np.ndarray]:
    """Optimal k-means of 1-D points by dynamic programming over the sorted values (Wang & Song,
    Ckmeans.1d.dp, 2011): (within-cluster sum of squares, label per point), labels ordered by value.
    The global optimum of the objective Lloyd's k-means (the official code's sklearn KMeans) only
    approaches, in O(k·n²) for the few dozen scores of a round."""
    order = np.argsort(x, kind="stable")
    v = x[order].astype(np.float64)
    n = len(v)
    k = min(k, n)
    c1, c2 = np.concatenate([[0.0], np.cumsum(v)]), np.concatenate([[0.0], np.cumsum(v * v)])

    def cost(i: np.ndarray, j: int) -> np.ndarray:  # SSE of v[i..j] for every start i (inclusive)
        m = j - i + 1
        s = c1[j + 1] - c1[i]
        return (c2[j + 1] - c2[i]) - s * s / m

    dp = np.full((k, n), np.inf)
    arg = np.zeros((k, n), dtype=np.int64)
    dp[0] = [cost(np.array([0]), j)[0] for j in range(n)]
    for q in range(1, k):
        for j in range(q, n):
            starts = np.arange(q, j + 1)  # the last cluster is v[start..j]
            total = dp[q - 1, starts - 1] + cost(starts, j)
            best = int(np.argmin(total))
            dp[q, j], arg[q, j] = total[best], starts[best]
    labels_sorted = np.zeros(n, dtype=np.int64)
    j = n - 1
    for q in range(k - 1, -1, -1):
        start = arg[q, j] if q > 0 else 0
        labels_sorted[start : j + 1] = q
        j = start - 1
    labels = np.empty(n, dtype=np.int64)
    labels[order] = labels_sorted
    return float(max(dp[k - 1, n - 1], 0.0)), labels


def gap_statistic_k(scores: np.ndarray, rng: np.random.Generator, k_max: int = 7, references: int = 10) -> int:
    """The number of clusters in 1-D `scores` by the gap statistic (Tibshirani et al. 2001), as the
    official code applies it: scores scaled to [0, 1], k = 1..7, uniform references on [0, 1], the
    smallest k with Gap(k) ≥ Gap(k+1) − s_{k+1} (the largest k tried when none qualifies)."""
    lo, hi = float(scores.min()), float(scores.max())
    if hi - lo <= 0:
        return 1
    x = (scores - lo) / (hi - lo)
    ks = range(1, min(k_max, len(np.unique(x))) + 1)
    refs = rng.uniform(0, 1, (references, len(x)))
    gaps, sds = [], []
    for k in ks:
        wk = max(kmeans_1d(x, k)[0], 1e-12)
        ref = np.log([max(kmeans_1d(r, k)[0], 1e-12) for r in refs])
        gaps.append(ref.mean() - np.log(wk))
        sds.append(np.sqrt(1 + 1 / references) * ref.std())
    for i in range(len(gaps) - 1):
        if gaps[i] >= gaps[i + 1] - sds[i + 1]:
            return i + 1
    return len(gaps)


def two_means_high(scores: np.ndarray) -> np.ndarray:
    """Boolean mask of the 2-means cluster with the larger scores."""
    return kmeans_1d(scores, 2)[1] == 1


class FLDetectorParams(Params):
    window: int = Field(10, ge=1, le=100, description="N: L-BFGS pairs kept and rounds a suspicion score averages (paper and code: 10)")
    ban: bool = Field(True, description="keep removing a detected client in every later round (the paper removes detected clients)")

    def round_problem(self, n: int):
        """One score is never clustered; of two, the gap statistic always picks k = 2 (Gap(2) = 0 >
        Gap(1)), so the higher-scored update is removed whatever it is."""
        if n >= 3:
            return None
        outcome = "it would never detect" if n < 2 else "once its window is full it would remove the higher-scored one every round"
        return "", f"fldetector needs at least 3 updates to cluster suspicion scores, got n={n}: {outcome}", n


@DEFENSES.register("fldetector", FLDetectorParams)
class FLDetector(Defense):
    """FLDetector: remove clients whose updates L-BFGS cannot predict from their history (Zhang et al. 2022)."""

    def __init__(self, params) -> None:
        super().__init__(params)
        self.s: list[torch.Tensor] = []  # w_t − w_{t−1}, oldest first
        self.y: list[torch.Tensor] = []  # g_t − g_{t−1}
        self.models: dict[int, torch.Tensor] = {}  # round -> global weights the round's updates were computed at
        self.last_grad: tuple[int, torch.Tensor] | None = None  # (round, aggregated gradient)
        self.seen: dict[int, tuple[int, torch.Tensor]] = {}  # client -> (round, its gradient then)
        self.errors: dict[int, list[tuple[int, float]]] = {}  # client -> [(round, normalised error)]
        self.banned: set[int] = set()

    def _reset_if_resized(self, d: int) -> None:
        """The model was factorized (low-rank switch): the history no longer fits; start it again."""
        if self.models and next(iter(self.models.values())).numel() != d:
            self.s, self.y, self.models, self.last_grad, self.seen, self.errors = [], [], {}, None, {}, {}

    def before(self, batch: UpdateBatch, ctx: RoundContext) -> tuple[UpdateBatch, dict]:
        t, w = ctx.round, ctx.global_weights.detach().to(torch.float64)
        self._reset_if_resized(w.numel())
        self.models[t] = w.clone()
        grads = -batch.updates.detach().to(torch.float64)
        ids = [int(c) for c in batch.client_ids]
        info: dict = {}
        flagged: set[int] = {c for c in ids if c in self.banned}
        if len(self.s) >= self.params.window:
            scores = self._score(ids, grads, w, t)
            info["scores"] = {c: round(v, 6) for c, v in scores.items()}
            if len(scores) >= 2:
                values = np.array(list(scores.values()))
                rng = np.random.default_rng(int(torch.randint(0, 2**31 - 1, (1,), generator=ctx.generator)))
                k = gap_statistic_k(values, rng)
                info["clusters"] = k
                if k > 1:
                    high = two_means_high(values)
                    detected = {c for c, h in zip(scores, high) if h}
                    info["detected"] = sorted(detected)
                    flagged |= detected
                    if self.params.ban:
                        self.banned |= detected
        for c, g in zip(ids, grads):
            self.seen[c] = (t, g.clone())
        self._forget_before(t - self.params.window)
        if not flagged:
            return batch, info
        info["removed"] = sorted(flagged)
        return batch.select(torch.tensor([c not in flagged for c in ids])), info

    def _score(self, ids: list[int], grads: torch.Tensor, w: torch.Tensor, t: int) -> dict[int, float]:
        """Each predictable client's suspicion score this round (mean normalised error in the window)."""
        s, y = torch.stack(self.s, dim=1), torch.stack(self.y, dim=1)
        rows = [(c, g) for c, g in zip(ids, grads) if c in self.seen and self.seen[c][0] in self.models]
        errors = {}
        if rows:  # one L-BFGS product for all predicted clients: the columns w_t − w_τ
            steps = torch.stack([w - self.models[self.seen[c][0]] for c, _ in rows], dim=1)
            old = torch.stack([self.seen[c][1] for c, _ in rows], dim=1)
            predicted = old + lbfgs_hvp(s, y, steps)
            now = torch.stack([g for _, g in rows], dim=1)
            errors = dict(zip([c for c, _ in rows], torch.linalg.vector_norm(predicted - now, dim=0).tolist()))
        total = sum(errors.values())
        if not errors or total <= 0:
            return {}
        for c, e in errors.items():
            self.errors.setdefault(c, []).append((t, e / total))
        return {c: float(np.mean([e for r, e in self.errors[c] if r > t - self.params.window])) for c in errors}

    def _forget_before(self, oldest: int) -> None:
        self.models = {r: m for r, m in self.models.items() if r >= oldest}
        self.seen = {c: v for c, v in self.seen.items() if v[0] >= oldest}
        self.errors = {c: [e for e in v if e[0] > oldest] for c, v in self.errors.items()}
        self.errors = {c: v for c, v in self.errors.items() if v}

    def after(self, aggregate: torch.Tensor, ctx: RoundContext) -> tuple[torch.Tensor, dict]:
        t, g = ctx.round, -aggregate.detach().to(torch.float64)
        if self.last_grad is not None and self.last_grad[0] in self.models and t in self.models:
            self.s.append(self.models[t] - self.models[self.last_grad[0]])
            self.y.append(g - self.last_grad[1])
            self.s, self.y = self.s[-self.params.window:], self.y[-self.params.window:]
        self.last_grad = (t, g.clone())
        return aggregate, {}

    # --- checkpoint -------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "s": list(self.s), "y": list(self.y),
            "models": {str(r): m for r, m in self.models.items()},
            "last_grad": [] if self.last_grad is None else [torch.tensor(self.last_grad[0]), self.last_grad[1]],
            "seen": {str(c): [torch.tensor(r), g] for c, (r, g) in self.seen.items()},
            "errors": {str(c): torch.tensor(v, dtype=torch.float64) for c, v in self.errors.items()},
            "banned": torch.tensor(sorted(self.banned), dtype=torch.int64),
        }

    def load_state_dict(self, state: dict) -> None:
        if not state:
            return
        self.s, self.y = list(state["s"]), list(state["y"])
        self.models = {int(r): m for r, m in state["models"].items()}
        lg = state["last_grad"]
        self.last_grad = None if not lg else (int(lg[0]), lg[1])
        self.seen = {int(c): (int(v[0]), v[1]) for c, v in state["seen"].items()}
        self.errors = {int(c): [(int(r), float(e)) for r, e in v.tolist()] for c, v in state["errors"].items()}
        self.banned = set(state["banned"].tolist())
