"""Lockdown (Huang, Hu, Chen, Lin, Liu, Guo, Chen, Li, NeurIPS 2023): isolated subspace training
with quorum-based consensus fusion.

Each honest client i keeps a binary mask m_i over the model's parameters (its subspace) across
rounds; all clients start from one shared random mask of density `dense_ratio` (ERK by default:
layer l gets density ε·(Σ shape_l)/(Π shape_l), layers whose density would exceed 1 kept dense).
In round t of T, the client (`lockdown_train`, the defense's client part; official
`src/agent_sparse.py: Agent.local_train`):

1. starts from the global model restricted to its subspace, w ← w_g ⊙ m_i, and trains only
   there (gradients multiplied by m_i), on CE + λ·Σ||w||_1 while t ≤ T/2 (λ = `se_threshold`);
   its update is Δ_i = w − w_g ⊙ m_i, zero outside m_i;
2. prunes: with drop ratio α_t = (a/2)(1 + cos(tπ/(T/2))) for t ≤ T/2, else 0 (a = `anneal_factor`),
   removes from each layer's mask the ⌈α_t·|m_i,l|⌉ coordinates of smallest |w| (`fire_mask`);
3. recovers as many: the coordinates outside the pruned mask with the largest |Σ_batches ∇L| at
   the pruned model on its data (`screen_gradients`, `update_mask`), or chosen at random
   (`regrow: random`, the code's `dis_check_gradient`). Each layer's mask keeps its size.

The server (`Lockdown.before`/`after`; official `src/aggregation.py: agg_mask_avg`) averages each
coordinate over the clients whose subspace holds it,

    Δ = Σ_i m_i ⊙ Δ_i / (Σ_i m_i + 10⁻⁸),

and, before inference, consensus fusion (official `federated.py`, the `test_model`) zeroes every
parameter that fewer than θ clients' masks hold: w_deployed = w_g ⊙ [Σ_{i=1..N} m_i ≥ θ], the sum
over all N clients' current masks (a client not yet sampled still holds the shared initial one).
The global model itself stays dense; only the evaluated (deployed) copy is fused. θ is given as
`quorum` = θ/N (official θ = 25 of N = 40 clients).

Where fedsim differs from the official code, and why:
- The server learns each client's mask from its upload: the support of Δ_i (coordinates ≠ 0). The
  official simulation hands the server the masks directly; fedsim's wire carries one update
  vector, and Lockdown's update is zero outside the mask by construction, as a sparse upload of
  the subspace's coordinates would be. A mask coordinate whose update came out exactly 0 is sent
  as the smallest normal float32 (1.2e-38), so the support is the mask exactly. Hence a dense
  codec is required and local DP's noise is refused (both would change the support).
- Attackers do not run Lockdown (in the official code every agent, poisoned ones too, trains its
  subspace): they train as their attack says, so their dense updates count, to the server, as
  masks holding every coordinate, in the average and in the quorum. That is what a client that
  does not follow the protocol can claim.
- The masked averaging replaces the round's rule: the scenario's aggregator must be fedavg
  (official `--aggr mask_avg`), whose output Lockdown's `after` replaces. The average is over the
  updates that reach it (after any defense listed earlier); it is unweighted by example counts,
  as in the code.
- Local training is the scenario's (federation lr, epochs, batch size, momentum, weight decay;
  official: SGD lr 0.1, 2 epochs, batch 64, weight decay 1e-4, no momentum), with the official
  L1 term and masking. `screen_gradients` sums the gradients over all the client's batches (the
  code's loader drops the last incomplete one).
- The layout of the model must stay fixed (low-rank switching is refused): masks are per coordinate.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field

from fedsim.defenses.base import Defense
from fedsim.defenses.flip import client_side_problems
from fedsim.devices import resolve_device
from fedsim.models.layout import ModelLayout
from fedsim.registry import COMPRESSORS, DEFENSES, Params
from fedsim.seeding import derive_seed
from fedsim.training import sgd_epochs
from fedsim.updates import RoundContext, UpdateBatch

LOCKDOWN_STREAM = 0x10C  # seed stream of the shared initial mask and random regrowth
TOTAL_MASK_EPS = 1e-8  # the code's total_mask = 1e-8 + Σ masks
SUPPORT_MARK = torch.finfo(torch.float32).tiny  # a mask coordinate whose update is exactly 0 is sent as this


class LockdownParams(Params):
    dense_ratio: float = Field(0.5, gt=0, le=1, description="density of each client's mask, the share of parameters in its subspace (official 0.5)")
    mask_init: Literal["ERK", "uniform"] = Field("ERK", description="layer densities of the shared initial mask: Erdős–Rényi-kernel or uniform (official ERK)")
    anneal_factor: float = Field(1.0, ge=0, le=1, description="a in the pruning ratio α_t = a/2·(1 + cos(tπ/(T/2))) for t ≤ T/2 (official 1)")
    se_threshold: float = Field(1e-4, ge=0, description="λ of the L1 term λ·Σ||w||_1 in the first half of the rounds (official 1e-4)")
    regrow: Literal["gradient", "random"] = Field("gradient", description="how pruned coordinates are recovered: largest |gradient| (official) or at random (the code's dis_check_gradient)")
    quorum: float = Field(0.625, gt=0, le=1, description="θ/N: consensus fusion keeps a parameter held by at least ⌈quorum·num_clients⌉ clients' masks (official θ = 25 of 40)")


# --- masks ---------------------------------------------------------------------------------------
def layer_densities(shapes: list[tuple[int, ...]], density: float, distribution: str) -> list[float]:
    """Each layer's mask density (official `utils.calculate_sparsities`): uniform, or ERK, whose
    ε makes the total the share `density` of all parameters, layers that would exceed 1 dense."""
    if distribution == "uniform":
        return [float(density)] * len(shapes)
    sizes = [math.prod(s) for s in shapes]
    raw = [sum(s) / n for s, n in zip(shapes, sizes)]
    dense: set[int] = set()
    while True:
        rhs = sum(-n * (1 - density) if i in dense else n * density for i, n in enumerate(sizes))
        divisor = sum(raw[i] * n for i, n in enumerate(sizes) if i not in dense)
        if divisor == 0:
            return [1.0] * len(shapes)
        eps = rhs / divisor
        top = max(raw[i] for i in range(len(sizes)) if i not in dense)
        if top * eps <= 1:
            return [1.0 if i in dense else eps * raw[i] for i in range(len(sizes))]
        dense |= {i for i in range(len(sizes)) if i not in dense and raw[i] == top}


def initial_mask(layout: ModelLayout, spec: LockdownParams, seed: int) -> torch.Tensor:
    """bool [d]: the mask every client starts from, over `layout` (trainable parameters): in each
    layer int(density·numel) coordinates at random (official `utils.init_masks`), seeded."""
    gen = torch.Generator().manual_seed(derive_seed(seed, LOCKDOWN_STREAM))
    parts = []
    for shape, dens in zip(layout.shapes, layer_densities(list(layout.shapes), spec.dense_ratio, spec.mask_init)):
        n = math.prod(shape)
        part = torch.zeros(n, dtype=torch.bool)
        part[torch.randperm(n, generator=gen)[: int(dens * n)]] = True
        parts.append(part)
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.bool)


def shared_initial_mask(rt, spec: LockdownParams, layout: ModelLayout) -> torch.Tensor:
    """The initial mask of this runtime's scenario over the trainable `layout` (cached)."""
    key = ("lockdown", "initial-mask", spec.dense_ratio, spec.mask_init, layout.names, layout.shapes)
    return rt.cached(key, lambda: initial_mask(layout, spec, rt.scenario.seed))


def drop_ratio(rnd: int, rounds: int, anneal: float) -> float:
    """α_t = a/2·(1 + cos(tπ/(T/2))) while t ≤ T/2, else 0 (official `fire_mask`)."""
    if rnd > rounds / 2:
        return 0.0
    return anneal / 2 * (1 + math.cos(rnd * math.pi / (rounds / 2)))


def prune(mask: torch.Tensor, weights: torch.Tensor, layout: ModelLayout, ratio: float) -> tuple[torch.Tensor, list[int]]:
    """(the mask with, in each layer, its ⌈ratio·|m_l|⌉ held coordinates of smallest |w| dropped;
    how many each layer dropped) (official `fire_mask`; stable order on ties)."""
    out, dropped = mask.clone(), []
    for name in layout.names:
        sl = layout.slice(name)
        m, w = out[sl], weights[sl]
        k = math.ceil(ratio * int(m.sum()))
        if k:
            m[torch.argsort(torch.where(m, w.abs(), torch.full_like(w, math.inf)), stable=True)[:k]] = False
        dropped.append(k)
    return out, dropped


def regrow(mask: torch.Tensor, counts: list[int], gradient: torch.Tensor | None, layout: ModelLayout,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """The mask with, in each layer, `counts[l]` of the coordinates it does not hold added: those of
    largest |gradient| (official `update_mask`), or at random when `gradient` is None."""
    out = mask.clone()
    for name, k in zip(layout.names, counts):
        if not k:
            continue
        sl = layout.slice(name)
        m = out[sl]
        free = torch.nonzero(~m).flatten()
        order = torch.argsort(-gradient[sl][free].abs(), stable=True) if gradient is not None else \
            torch.randperm(len(free), generator=generator)
        m[free[order[:k]]] = True
    return out


def mask_average(updates: torch.Tensor) -> torch.Tensor:
    """Σ_i m_i ⊙ Δ_i / (Σ_i m_i + 10⁻⁸) with m_i the support of row i (official `agg_mask_avg`)."""
    held = (updates != 0).sum(0).to(updates.dtype)
    return updates.sum(0) / (held + TOTAL_MASK_EPS)


def consensus(mask_sum: torch.Tensor, theta: int) -> torch.Tensor:
    """bool [d]: the coordinates at least θ clients' masks hold."""
    return mask_sum >= theta


def quorum_count(spec: LockdownParams, num_clients: int) -> int:
    return max(1, math.ceil(spec.quorum * num_clients - 1e-9))


def pack(mask: torch.Tensor) -> np.ndarray:
    return np.packbits(mask.numpy().astype(np.uint8))


def unpack(packed: np.ndarray, dim: int) -> torch.Tensor:
    return torch.from_numpy(np.unpackbits(np.asarray(packed, dtype=np.uint8))[:dim].astype(bool))


# --- the client part -----------------------------------------------------------------------------
def screen_gradients(model: torch.nn.Module, x: np.ndarray, y: np.ndarray, batch_size: int) -> dict[str, torch.Tensor]:
    """Σ over the client's batches of ∇ CE at the model (eval mode), by parameter name (official `screen_gradients`)."""
    model.eval()
    named = dict(model.named_parameters())
    total = {name: torch.zeros_like(p) for name, p in named.items()}
    xt, yt = torch.from_numpy(np.asarray(x)), torch.from_numpy(np.asarray(y))
    for start in range(0, len(xt), batch_size):
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(xt[start:start + batch_size]), yt[start:start + batch_size]).backward()
        for name, p in named.items():
            if p.grad is not None:
                total[name] += p.grad
    model.zero_grad()
    model.train()
    return total


def lockdown_train(spec: LockdownParams, job) -> tuple[torch.Tensor, dict]:
    """An honest client's round under Lockdown (fedsim/client/steps.py HonestTraining `job`): train
    its subspace, upload the update (support = its mask), then prune and recover the mask."""
    rt, layout, model = job.rt, job.layout, job.model
    trainable = layout.trainable_mask
    tl = layout.trainable_only()
    mem = job.memory
    if "lockdown.mask" in mem and int(np.asarray(mem["lockdown.dim"])[0]) == tl.dim:
        mask = unpack(mem["lockdown.mask"], tl.dim)
    else:
        mask = shared_initial_mask(rt, spec, tl).clone()
    full = torch.ones(layout.dim, dtype=torch.bool)
    full[trainable] = mask
    start = job.global_vec * full
    layout.load_into(model, start)
    params = dict(model.named_parameters())
    held = {name: mask[tl.slice(name)].view(shape).to(torch.float32) for name, shape in zip(tl.names, tl.shapes)}
    rounds = rt.scenario.federation.rounds
    l1 = spec.se_threshold if job.rnd <= rounds / 2 else 0.0
    device = resolve_device(job.cfg.device, "TrainConfig.device")
    hooks = [params[n].register_hook(lambda g, m=held[n]: g * m.to(g.device)) for n in tl.names]

    def loss_fn(xb: torch.Tensor, yb: torch.Tensor):
        loss = torch.nn.functional.cross_entropy(model(xb), yb)
        if not l1:
            return loss
        return loss + l1 * sum(p.abs().sum() for p in model.parameters()), loss

    cfg = job.cfg
    try:
        stats = sgd_epochs(model, list(model.parameters()), np.asarray(job.x), np.asarray(job.y), cfg.batch_size,
                           [cfg.lr] * cfg.epochs, cfg.momentum, cfg.weight_decay, job.seed, loss_fn, None, cfg.max_steps,
                           device=device, precision=cfg.precision, deterministic=cfg.deterministic)
    finally:
        for h in hooks:
            h.remove()
    trained = layout.flatten_model(model)
    delta = trained - start
    inside = delta[trainable]
    inside = torch.where(mask, torch.where(inside == 0, torch.full_like(inside, SUPPORT_MARK), inside), torch.zeros_like(inside))
    delta[trainable] = inside
    # the next round's mask: prune by magnitude, recover by the gradient at the pruned model
    ratio = drop_ratio(job.rnd, rounds, spec.anneal_factor)
    if ratio > 0:
        weights = trained[trainable]
        kept, counts = prune(mask, weights, tl, ratio)
        gradient = None
        if spec.regrow == "gradient":
            pruned = trained.clone()
            pruned[trainable] = weights * kept
            layout.load_into(model, pruned)
            grads = screen_gradients(model, job.x, job.y, cfg.batch_size)
            gradient = torch.cat([grads[name].reshape(-1) for name in tl.names])
        mask = regrow(kept, counts, gradient, tl, torch.Generator().manual_seed(derive_seed(job.seed, LOCKDOWN_STREAM)))
    mem["lockdown.mask"] = pack(mask)
    mem["lockdown.dim"] = np.array([tl.dim], dtype=np.int64)
    return delta, dict(stats, mask_density=float(mask.float().mean()) if len(mask) else 0.0)


# --- the server ------------------------------------------------------------------------------------
def lockdown_inference(spec: LockdownParams, model: torch.nn.Module, runtime: Any, rnd: int | None,
                       state: tuple[torch.Tensor, int] | None = None):
    """Consensus fusion: a copy of `model` with every parameter fewer than θ clients' masks hold set
    to 0, the masks as the server knew them after round `rnd`: `state` is the defense's
    `deployed_state()` then (Σ of the masks seen, clients seen; None before any: all initial)."""
    layout = ModelLayout.of(model).trainable_only()
    num_clients = runtime.scenario.federation.num_clients
    seen_sum, seen = state if state is not None else (torch.zeros(layout.dim, dtype=torch.int32), 0)
    if seen_sum.numel() != layout.dim:
        raise ValueError(f"lockdown: the masks cover {seen_sum.numel()} parameters, the model has {layout.dim}")
    initial = shared_initial_mask(runtime, spec, layout)
    total = seen_sum + (num_clients - seen) * initial.to(torch.int32)
    keep = consensus(total, quorum_count(spec, num_clients))
    fused = copy.deepcopy(model)
    params = dict(fused.named_parameters())
    with torch.no_grad():
        for name, shape in zip(layout.names, layout.shapes):
            params[name].mul_(keep[layout.slice(name)].view(shape).to(params[name].dtype))
    return fused, None


def lockdown_problems(sc, index: int) -> list[tuple[str, str, Any]]:
    """What Lockdown cannot run with, refused at validation (besides `client_side_problems`)."""
    out = client_side_problems(sc, index)
    if sc.aggregator.name != "fedavg":
        out.append(("aggregator", f"defense lockdown averages each coordinate over the clients whose subspace holds it, "
                    f"which is the round's aggregation (official aggr mask_avg): use aggregator fedavg, not "
                    f"{sc.aggregator.name}", sc.aggregator.name))
    if not COMPRESSORS.get(sc.compression.name).traits.dense:
        out.append(("compression", f"defense lockdown reads each client's mask from its update's support, which codec "
                    f"{sc.compression.name} changes: use a dense codec (none)", sc.compression.name))
    if sc.federation.local_dp is not None:
        out.append(("federation.local_dp", "defense lockdown reads each client's mask from its update's support, which "
                    "local DP's noise fills: drop one of the two", "local_dp"))
    return out


@DEFENSES.register("lockdown", LockdownParams, with_federation=True, client_training="fedsim.defenses.lockdown:lockdown_train",
                   inference="fedsim.defenses.lockdown:lockdown_inference", scenario_check=lockdown_problems,
                   fixed_layers=lambda spec: True)
class Lockdown(Defense):
    """Lockdown: clients train isolated sparse subspaces; the server averages over them and fuses by a mask quorum (Huang et al. 2023)."""

    def __init__(self, params, federation=None) -> None:
        super().__init__(params)
        self.num_clients = None if federation is None else int(federation.num_clients)
        self.masks: dict[int, np.ndarray] = {}  # client id -> its latest mask, packed (the support of its upload)
        self.mask_sum: torch.Tensor | None = None  # [d] int32: Σ of the masks in `masks`
        self._average: tuple[int, torch.Tensor] | None = None  # (round, the masked average) from before() to after()

    def _see(self, pid: int, mask: torch.Tensor) -> None:
        d = mask.numel()
        if self.mask_sum is None or self.mask_sum.numel() != d:
            self.masks, self.mask_sum = {}, torch.zeros(d, dtype=torch.int32)
        old = self.masks.get(pid)
        if old is not None:
            self.mask_sum -= unpack(old, d).to(torch.int32)
        self.mask_sum += mask.to(torch.int32)
        self.masks[pid] = pack(mask)

    def before(self, batch: UpdateBatch, ctx: RoundContext) -> tuple[UpdateBatch, dict]:
        support = (batch.updates != 0).cpu()
        for i, pid in enumerate(batch.client_ids):
            self._see(int(pid), support[i])
        self._average = (ctx.round, mask_average(batch.updates))
        density = support.float().mean(1).tolist()
        return batch, {"mask_density": dict(zip(batch.client_ids, density))}

    def deployed_state(self) -> tuple[torch.Tensor, int] | None:
        """(Σ of the masks seen, clients seen) for consensus fusion at the evaluation (lockdown_inference)."""
        return None if self.mask_sum is None else (self.mask_sum.clone(), len(self.masks))

    def after(self, aggregate: torch.Tensor, ctx: RoundContext) -> tuple[torch.Tensor, dict]:
        if self._average is None or self._average[0] != ctx.round:
            raise RuntimeError(f"lockdown.after called for round {ctx.round} without before() in that round")
        average = self._average[1].to(device=aggregate.device, dtype=aggregate.dtype)
        self._average = None
        if average.shape != aggregate.shape:
            raise ValueError(f"lockdown: aggregate of shape {tuple(aggregate.shape)}, masked average {tuple(average.shape)}")
        info = {}
        if self.num_clients is not None:
            theta = quorum_count(self.params, self.num_clients)
            info["quorum"] = theta
        return average, info

    def state_dict(self) -> dict[str, torch.Tensor]:
        if not self.masks:
            return {}
        ids = sorted(self.masks)
        return {"ids": torch.tensor(ids, dtype=torch.int64), "dim": torch.tensor([self.mask_sum.numel()]),
                "masks": torch.from_numpy(np.stack([self.masks[i] for i in ids]))}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.masks, self.mask_sum = {}, None
        if not state:
            return
        d = int(state["dim"][0])
        for pid, packed in zip(state["ids"].tolist(), state["masks"].numpy()):
            self._see(int(pid), unpack(packed, d))
