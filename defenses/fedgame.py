"""FedGame (Jia, Yuan, Sahabandu, Niu, Rajabi, Ramasubramanian, Li, Poovendran, NeurIPS 2023): the
defender's side of a minimax game against a strategic backdoor attacker. Each round the server
reverse-engineers the backdoor the round's updates would plant, scores every client by how far its
own model resists that backdoor (its *genuine score*), and aggregates with those scores as weights.

For a round with global model G, local updates Δ_1..Δ_n and the server's clean dataset D_s:

1. Auxiliary global model θ_a = G + (1/n) Σ_i Δ_i: the model the round would produce undefended
   (official: `ref_global_model` in `training.py: run_fl_round_ours_parallel`, the plain mean).
2. Reverse engineering (Neural Cleanse, Wang et al. S&P 2019) on θ_a and D_s, for every class c:
       min_{m', p'}  CE(θ_a((1 - m) ⊙ x + m ⊙ p), c) + λ ‖m‖_1,
       m = tanh(m') / 2 + 1/2  (mask [H, W], shared by the channels),  p = data-range(tanh(p'))  ([C, H, W]),
   with Adam (lr 0.005), λ = 0.01, `nc_epochs` passes over D_s in batches of 64, stopping a class
   early once ‖m‖_1 has not decreased for more than `nc_patience` epochs; m' starts at 0, p' at
   N(0, 1) (official `reverse_engineer_per_class`). The target class is t = argmin_c ‖m_c‖_1
   (`reverse_engineer_trigger`): a planted backdoor needs the smallest trigger.
3. Genuine scores: for each local model θ_i = G + Δ_i,
       p_i = 1 - (1/|D_s|) Σ_{x ∈ D_s} 1[θ_i((1 - m_t) ⊙ x + m_t ⊙ p_t) = t]
   (official `compute_genuine_score_global`), one minus the local model's success rate on the
   reverse-engineered backdoor. In the paper's game this is the defender's best response: a
   client's weight falls as the share of backdoor it trained on (its poisoning ratio r_i) rises.
4. Aggregation: Σ_i p_i Δ_i / Σ_j p_j (`accumulate_weights_weighted`). Here the defense hands the
   rule the batch with weights p_i (example counts replaced, as in the official code, which does
   not weigh by data size) and leaves out the rows with p_i = 0 (weight 0: they would add
   nothing); the scenario's rule must be the weighted mean (`fedavg`), checked at validation.
   `removed` lists the clients with genuine score 0; `genuine_scores` all of them.

The attacker's half of the game (each compromised client choosing the poisoning ratio r that
maximises p_i + λ·r, official `ClientThreadMalicious`) is an attack, not part of this defense.

The server's clean dataset: `root_size` examples drawn once per scenario and seed from the
training split (`root_source: train`) or the test split (`test`, then left out of the central
evaluation), as FLTrust's root dataset (fedsim/server/tools.py). Official: a random 10 % of the
training set (`clean_ratio: 0.1`) or as many FashionMNIST images for MNIST; `root_size: null`
takes 10 % of the training split, the official size.

Where fedsim differs and why:
- All classes are reverse-engineered together: one Adam over the stacked masks and patterns of
  every class, each class's loss summed. The classes share no parameter and Adam is elementwise,
  so this is the per-class loop of the official code run side by side (one forward pass of K·B
  inputs instead of K of B); a class that stops early has its parameters frozen from then on.
  Every class sees the same batch order (official: a fresh shuffle per class).
- The pattern's range: official p = (tanh(p') - 0.1307) / 0.3081, MNIST's normalisation applied to
  [-1, 1]; here tanh(p') is mapped onto [min, max] of the server's data, whatever the dataset.
- The early-stop norm is the mask's L1 norm after the epoch's last batch, as official.
- Without server tools (a defense called on bare tensors) there is no model to probe: the batch
  passes unchanged with a `note`.

Cost per round: K·(nc_epochs)·⌈|D_s|/64⌉ Adam steps on a K·64 batch through θ_a (at most; early
stopping shortens it), then n forward passes of |D_s| stamped inputs, one per local model.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
from pydantic import Field

from fedsim.aggregators.base import AggregationError
from fedsim.defenses.base import Defense
from fedsim.registry import AGGREGATORS, DEFENSES, Params
from fedsim.updates import RoundContext, UpdateBatch

OFFICIAL_CLEAN_RATIO = 0.1  # official configs: clean_ratio 0.1 of the training set
EVAL_BATCH = 500


class FedGameParams(Params):
    root_size: int | None = Field(
        None, ge=1, le=100_000,
        description="examples in the server's clean dataset; null: 10% of the training split (official clean_ratio 0.1)")
    root_source: Literal["train", "test"] = Field(
        "train", description="draw the clean dataset from the training split (official) or the test split (held out from evaluation)")
    nc_epochs: int = Field(100, ge=1, le=10_000, description="Neural Cleanse passes over the clean dataset per class (official nc_steps: 100)")
    nc_lr: float = Field(0.005, gt=0, le=10, description="Adam learning rate of the mask and pattern (official: 0.005)")
    nc_lambda: float = Field(0.01, ge=0, le=100, description="weight λ of the mask's L1 norm in the reverse-engineering loss (official: 0.01)")
    nc_patience: int = Field(30, ge=0, le=10_000, description="stop a class after more than this many epochs without a smaller mask norm (official: 30)")
    nc_batch_size: int = Field(64, ge=1, le=100_000, description="batch size of the reverse engineering (official batch_size: 64)")

    def round_problem(self, n: int):
        if n >= 2:
            return None
        return "", (f"fedgame needs at least 2 updates, got n={n}: the genuine-score-weighted mean of a lone update is "
                    "that update whatever its score (the trigger is reverse-engineered on that very model), so it can "
                    "only pass it unchanged or skip the round"), n


def scenario_problems(sc, index: int) -> list[tuple[str, str, object]]:
    """FedGame's aggregate is the genuine-score-weighted mean: the rule after it must be the weighted mean."""
    name = sc.aggregator.name
    if name not in AGGREGATORS or not AGGREGATORS.get(name).traits.weighted_mean:
        means = [e.name for e in AGGREGATORS.entries() if e.traits.weighted_mean]
        return [("aggregator", f"fedgame aggregates Σ p_i Δ_i / Σ p_i with its genuine scores p_i as the weights; "
                 f"aggregator {name} does not take a weighted mean: use aggregator: {' or '.join(means)}", name)]
    return []


def stamp(x: torch.Tensor, mask: torch.Tensor, pattern: torch.Tensor) -> torch.Tensor:
    """(1 - m) ⊙ x + m ⊙ p for inputs x [B, C, H, W] (or [B, ...] with matching trailing dims),
    masks [K, H, W] and patterns [K, C, H, W] -> [K, B, C, H, W]."""
    m = mask[:, None, None]  # [K, 1, 1, H, W]
    return (1 - m) * x[None] + m * pattern[:, None]


def squash_mask(raw: torch.Tensor) -> torch.Tensor:
    return torch.tanh(raw) / 2 + 0.5


def squash_pattern(raw: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    return lo + (torch.tanh(raw) + 1) / 2 * (hi - lo)


def reverse_engineer(model: torch.nn.Module, x: torch.Tensor, num_classes: int, generator: torch.Generator,
                     epochs: int, lr: float, lam: float, patience: int, batch_size: int,
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Neural Cleanse for every class at once on `model` (eval mode, parameters untouched) and the
    clean inputs `x` [N, C, H, W]: (masks [K, H, W] in [0, 1], patterns [K, C, H, W], mask L1 norms [K])."""
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    k, (c, h, w) = num_classes, tuple(x.shape[1:])
    lo, hi = float(x.min()), float(x.max())
    if hi <= lo:
        hi = lo + 1.0
    raw_pattern = torch.randn((k, c, h, w), generator=generator).requires_grad_(True)
    raw_mask = torch.zeros((k, h, w)).requires_grad_(True)
    opt = torch.optim.Adam([raw_pattern, raw_mask], lr=lr)
    targets = torch.arange(k)
    active = torch.ones(k, dtype=torch.bool)
    best = torch.full((k,), float("inf"))
    stale = torch.zeros(k, dtype=torch.long)
    n = x.shape[0]
    for _ in range(epochs):
        order = torch.randperm(n, generator=generator)
        norm = torch.zeros(k)
        for start in range(0, n, batch_size):
            xb = x[order[start:start + batch_size]]
            frozen = (raw_pattern.detach().clone(), raw_mask.detach().clone())
            opt.zero_grad()
            mask = squash_mask(raw_mask)
            pattern = squash_pattern(raw_pattern, lo, hi)
            stamped = stamp(xb, mask, pattern)  # [K, B, C, H, W]
            logits = model(stamped.reshape(-1, c, h, w)).reshape(k, xb.shape[0], -1)
            ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets[:, None].expand(k, xb.shape[0]),
                                                   reduction="none").mean(dim=1)  # [K]: each class's mean CE
            loss = (ce + lam * mask.flatten(1).sum(dim=1))[active].sum()
            loss.backward()
            opt.step()
            with torch.no_grad():  # classes that stopped keep their trigger
                raw_pattern[~active] = frozen[0][~active]
                raw_mask[~active] = frozen[1][~active]
                norm = squash_mask(raw_mask).flatten(1).sum(dim=1)
        improved = norm < best
        best = torch.where(improved & active, norm, best)
        stale = torch.where(improved, torch.zeros_like(stale), stale + 1)
        active &= stale <= patience
        if not active.any():
            break
    with torch.no_grad():
        masks = squash_mask(raw_mask)
        return masks, squash_pattern(raw_pattern, lo, hi), masks.flatten(1).sum(dim=1)


@torch.no_grad()
def backdoor_success(model: torch.nn.Module, x: torch.Tensor, mask: torch.Tensor, pattern: torch.Tensor,
                     target: int) -> float:
    """Share of the inputs `x` stamped with (mask [H, W], pattern [C, H, W]) that `model` sends to `target`."""
    model.eval()
    hits = 0
    for start in range(0, x.shape[0], EVAL_BATCH):
        xb = stamp(x[start:start + EVAL_BATCH], mask[None], pattern[None])[0]
        hits += int((model(xb).argmax(dim=1) == target).sum())
    return hits / x.shape[0]


def genuine_scores(model_of, global_weights: torch.Tensor, updates: torch.Tensor, x: torch.Tensor,
                   mask: torch.Tensor, pattern: torch.Tensor, target: int) -> torch.Tensor:
    """p_i = 1 - backdoor success of G + Δ_i, float64 [n]."""
    return torch.tensor([1.0 - backdoor_success(model_of(global_weights + u), x, mask, pattern, target)
                         for u in updates], dtype=torch.float64)


@DEFENSES.register("fedgame", FedGameParams, scenario_check=scenario_problems)
class FedGame(Defense):
    """FedGame: weigh clients by 1 - success of the Neural-Cleanse-reversed backdoor on their models (Jia et al. 2023)."""

    def before(self, batch: UpdateBatch, ctx: RoundContext) -> tuple[UpdateBatch, dict]:
        n = batch.updates.shape[0]
        if n == 0:
            return batch, {}
        if ctx.tools is None:
            return batch, {"note": "no server tools (bare tensors): fedgame has no model or clean data to probe; batch passed unchanged"}
        p, tools = self.params, ctx.tools
        size = p.root_size
        if size is None:
            pool = len(tools.rt.data.y_train) if p.root_source == "train" else len(tools.rt.data.y_test)
            size = max(1, round(OFFICIAL_CLEAN_RATIO * pool))
        x_np, _ = tools.server_data(size, p.root_source)
        x = torch.as_tensor(np.asarray(x_np), dtype=torch.float32)
        if x.dim() != 4:
            raise ValueError(f"fedgame reverse-engineers an image trigger (inputs [C, H, W]); this dataset's inputs are {tuple(x.shape[1:])}")
        updates = batch.updates.to(torch.float32).cpu()
        gw = ctx.global_weights.to(torch.float32).cpu()
        auxiliary = tools.model_of(gw + updates.mean(dim=0))
        gen = torch.Generator().manual_seed(int(torch.randint(0, 2**62, (1,), generator=ctx.generator, device=ctx.generator.device)))
        masks, patterns, norms = reverse_engineer(auxiliary, x, tools.num_classes, gen, p.nc_epochs, p.nc_lr,
                                                  p.nc_lambda, p.nc_patience, p.nc_batch_size)
        target = int(torch.argmin(norms))
        scores = genuine_scores(tools.model_of, gw, updates, x, masks[target], patterns[target], target)
        ids = [int(c) for c in batch.client_ids]
        log = {
            "target": target,
            "mask_norms": [float(v) for v in norms.tolist()],
            "genuine_scores": dict(zip(ids, scores.tolist())),
            "removed": [c for c, s in zip(ids, scores.tolist()) if s <= 0],
        }
        keep = scores > 0
        if not bool(keep.any()):
            raise AggregationError("fedgame: every client's genuine score is 0 (its model follows the reverse-engineered "
                                   "backdoor on every clean example); nothing to aggregate")
        kept = batch.with_weights(scores.to(batch.weights.device, batch.weights.dtype)).select(keep.to(batch.updates.device))
        return kept, log
