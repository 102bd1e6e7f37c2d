"""BackdoorIndicator (Li & Dai, USENIX Security 2024): the server plants an *indicator* task of
out-of-distribution (OOD) samples with assigned labels into the global model before broadcasting
it; a model trained on a backdoor keeps the indicator, benign training erases it.

Why it works (the paper's observation): planting a later backdoor whose target label is y
preserves earlier backdoor-like tasks with label y. The indicator samples carry every label of
the task (balanced), so whichever target an attacker picks, the indicator samples of that label
survive its training, while benign updates on in-distribution data forget them.

Each round t:

1. Detection, on the round's updates Δ_i relative to the broadcast (indicator-carrying) model G:
   for each local model θ_i = G + Δ_i and each label c of the indicator set I = {(x_j, c_j)},
       acc_i,c = |{j : c_j = c, argmax θ_i(x_j) = c}| / |{j : c_j = c}|,    IA_i = max_c acc_i,c
   (official `_global_watermarking_test_sub`: the per-label accuracies and their maximum). A model
   with IA_i >= `threshold` (official VWM_detection_threshold: 85 %) is flagged and removed
   (`removed`); the rest go on to the scenario's rule (official: the mean of the kept updates).
2. Planting, on the aggregate A (`after`): starting from θ = G + A, SGD on the indicator set
   alone with the loss
       CE(θ(x), c) + (μ/2) ‖θ - (G + A)‖_2                      (μ = watermarking_mu = 0.1)
   (official `_global_watermark_injection`, regulation "l2_norm+neurotoxin" with its gradient mask
   all ones, partial_watermarking_ratio 1, and the cosine term off, watermarking_cs 0), for
   `epochs` passes (official global_retrain_no_times: 50) in batches of 64, lr 0.0008, momentum 0.9,
   weight decay 5e-4, the lr multiplied by 0.8 at the epochs in `milestones`. The aggregate
   becomes A' = θ_planted - G, so the next global model G + A' carries the indicator.
   Buffers (BatchNorm statistics) are not planted: the defenses see trainable coordinates only
   and the buffers stay the clients' average (official replace_original_bn: True restores the
   global model's pre-planting statistics too).

The indicator set: `ood_size` inputs (official ood_data_sample_lens: 800), drawn once per scenario
and seed: with `ood_source: noise` uniform in [0, 1) of the data's input shape (the official `NOISE`
source, `utils.NoiseDataset`: torch.rand); with a dataset name, that many distinct training images
of another registered dataset of the same input shape, in its own normalisation (the official
natural OOD sets: CIFAR-100 for CIFAR-10, CIFAR-10 for EMNIST; here e.g. Fashion-MNIST for MNIST,
read from the data folder). Labels 0..K-1 repeated in turn and shuffled (official
`_get_ood_dataloader`), so every label has ⌊N/K⌋ or ⌈N/K⌉ samples.

Where fedsim differs and why:
- Where the indicator is planted. The official server plants it into its global model in
  `pre_process` before broadcasting, after evaluating the un-planted model. fedsim's server has one
  global model, which is what it broadcasts and what the central evaluation measures, and a
  defense reaches it only through the aggregate: planting happens in `after`, so the next round's
  broadcast carries the indicator, and the evaluated model is the planted one (main accuracy and
  backdoor success therefore include what the planting changed; the log gives the planting's norm
  and the planted model's own indicator accuracy). No shared server module was changed for this.
- Detection runs only on rounds whose broadcast model carries the indicator: if the global model
  itself has IA < threshold (round 1, before anything was planted, or a planting that did not
  take) the batch passes unchanged with a `note`, where the official code would accept every model.
- The server optimizer must be FedAvg's x ← x + A (sgd, lr 1, no momentum) so that the planted
  model is the next global model; other server optimizers are refused at validation.
- The official OOD set is cut to whole batches of 64 (drop_last: 768 of 800); here every sample is used.
- The official threshold can decrease across rounds (VWM_detection_threshold_minus_on, 0 in every
  published config): a constant threshold here.
- The official detection check model takes the running BatchNorm statistics of the planted global
  model; here the local model is built with the global model's buffers (the clients' average).

Cost per round: n + 1 forward passes over the indicator set (detection) and `epochs`·⌈N/64⌉ SGD
steps on the global model (planting); no in-distribution server data is used.
"""

from __future__ import annotations


import numpy as np
import torch
from pydantic import Field, field_validator

from fedsim.defenses.base import Defense
from fedsim.registry import DEFENSES, Params
from fedsim.seeding import SERVER, derive_seed
from fedsim.updates import RoundContext, UpdateBatch

INDICATOR_DATA = 0xB1D  # seed stream of the indicator set
INDICATOR_TRAIN = 0xB1E  # seed stream of the planting's batch order
EVAL_BATCH = 500


class BackdoorIndicatorParams(Params):
    ood_source: str = Field("noise", description="OOD inputs of the indicator: noise (uniform in [0, 1), the official NOISE "
                                                 "source) or a registered dataset whose training images have the task's "
                                                 "input shape (official: another natural dataset; e.g. fashion_mnist for MNIST)")
    ood_size: int = Field(800, ge=1, le=100_000, description="indicator samples (official ood_data_sample_lens: 800)")
    batch_size: int = Field(64, ge=1, le=100_000, description="planting batch size (official ood_data_batch_size: 64)")
    epochs: int = Field(50, ge=1, le=10_000, description="planting passes over the indicator set (official global_retrain_no_times: 50)")
    lr: float = Field(0.0008, gt=0, le=10, description="planting SGD learning rate (official global_lr_init = global_lr_max: 0.0008)")
    momentum: float = Field(0.9, ge=0, lt=1, description="planting SGD momentum (official: 0.9)")
    weight_decay: float = Field(0.0005, ge=0, le=1, description="planting SGD weight decay (official: 0.0005)")
    milestones: list[int] = Field(default_factory=lambda: [10, 20, 30, 160, 200, 240, 280, 320, 360],
                                  description="planting epochs at which the lr is multiplied by gamma (official global_milestones)")
    gamma: float = Field(0.8, gt=0, le=1, description="planting lr decay at each milestone (official global_lr_gamma: 0.8)")
    mu: float = Field(0.1, ge=0, le=1e6, description="weight μ of (μ/2)·‖θ - θ_global‖_2 in the planting loss (official watermarking_mu: 0.1)")
    threshold: float = Field(0.85, gt=0, le=1, description="a model whose best per-label indicator accuracy is at least this is flagged (official: 85%)")

    @field_validator("ood_source")
    @classmethod
    def _known_source(cls, v: str) -> str:
        from fedsim.registry import DATASETS

        if v != "noise" and v not in DATASETS.names():
            raise ValueError(f"ood_source must be noise or a registered dataset ({', '.join(DATASETS.names())}), got {v!r}")
        return v

    @field_validator("milestones")
    @classmethod
    def _increasing(cls, v: list[int]) -> list[int]:
        if any(m < 1 for m in v) or any(b <= a for a, b in zip(v, v[1:])):
            raise ValueError(f"milestones must be increasing positive epochs, got {v}")
        return v


def scenario_problems(sc, index: int) -> list[tuple[str, str, object]]:
    """The planted aggregate must become the next global model as it is: FedAvg's server step."""
    s = sc.server
    if not (s.optimizer == "sgd" and s.lr == 1.0 and s.momentum == 0.0):
        return [("server", "backdoor_indicator plants its indicator into the aggregate, which the next global model "
                 "must be exactly (x ← x + A); use server optimizer sgd with lr 1 and momentum 0",
                 {"optimizer": s.optimizer, "lr": s.lr, "momentum": s.momentum})]
    return []


def indicator_set(seed: int, size: int, input_shape: tuple[int, ...], num_classes: int,
                  pool: np.ndarray | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs [size, *input_shape], labels [size]: 0..K-1 repeated and shuffled). The inputs are
    uniform in [0, 1), or, given a `pool` of OOD images [N, *input_shape], `size` distinct ones of
    them drawn at random (official `_get_ood_dataloader`: a random sample of the OOD dataset)."""
    g = torch.Generator().manual_seed(int(seed))
    if pool is None:
        x = torch.rand((size, *input_shape), generator=g)
    else:
        if tuple(pool.shape[1:]) != tuple(input_shape) or len(pool) < size:
            raise ValueError(f"backdoor_indicator.ood_source: its training images are {len(pool)} x {tuple(pool.shape[1:])}; "
                             f"the indicator needs ood_size={size} images of the task's input shape {tuple(input_shape)}")
        x = torch.as_tensor(pool[torch.randperm(len(pool), generator=g)[:size].numpy()], dtype=torch.float32)
    labels = torch.arange(size) % num_classes
    return x, labels[torch.randperm(size, generator=g)]


@torch.no_grad()
def per_label_accuracy(model: torch.nn.Module, x: torch.Tensor, labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    """acc_c = share of the samples labelled c that `model` predicts as c, float64 [K] (NaN for an absent label)."""
    model.eval()
    pred = torch.cat([model(x[s:s + EVAL_BATCH]).argmax(dim=1).cpu() for s in range(0, x.shape[0], EVAL_BATCH)])
    hit = (pred == labels).to(torch.float64)
    count = torch.bincount(labels, minlength=num_classes).to(torch.float64)
    correct = torch.bincount(labels, weights=hit, minlength=num_classes)
    return torch.where(count > 0, correct / count.clamp(min=1), torch.full_like(count, float("nan")))


def indicator_accuracy(model: torch.nn.Module, x: torch.Tensor, labels: torch.Tensor, num_classes: int) -> tuple[float, int]:
    """(IA = max_c acc_c, the label c attaining it)."""
    acc = torch.nan_to_num(per_label_accuracy(model, x, labels, num_classes), nan=-1.0)
    c = int(torch.argmax(acc))
    return float(acc[c]), c


def plant(model: torch.nn.Module, x: torch.Tensor, labels: torch.Tensor, params: BackdoorIndicatorParams, seed: int) -> None:
    """Train `model` in place on the indicator set with the official loss and schedule."""
    anchor = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=params.lr, momentum=params.momentum, weight_decay=params.weight_decay)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=list(params.milestones), gamma=params.gamma)
    g = torch.Generator().manual_seed(int(seed))
    model.train()
    n = x.shape[0]
    for _ in range(params.epochs):
        order = torch.randperm(n, generator=g)
        for s in range(0, n, params.batch_size):
            i = order[s:s + params.batch_size]
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x[i]), labels[i])
            if params.mu:
                # torch's norm has gradient 0 at 0 (a sqrt of the squared sum would give NaN on the first step)
                dist = torch.linalg.vector_norm(torch.cat([(p - a).flatten() for p, a in zip(model.parameters(), anchor)]))
                loss = loss + params.mu / 2 * dist
            loss.backward()
            opt.step()
        sched.step()


@DEFENSES.register("backdoor_indicator", BackdoorIndicatorParams, scenario_check=scenario_problems)
class BackdoorIndicator(Defense):
    """BackdoorIndicator: plant OOD samples with labels into the broadcast model, flag models that keep them (Li & Dai 2024)."""

    def _indicator(self, tools) -> tuple[torch.Tensor, torch.Tensor]:
        p = self.params
        seed = derive_seed(tools.rt.scenario.seed, SERVER, INDICATOR_DATA)
        pool = None if p.ood_source == "noise" else tools.rt.load_dataset(p.ood_source).x_train
        return indicator_set(seed, p.ood_size, tuple(tools.input_shape), tools.num_classes, pool)

    def before(self, batch: UpdateBatch, ctx: RoundContext) -> tuple[UpdateBatch, dict]:
        n = batch.updates.shape[0]
        if n == 0:
            return batch, {}
        if ctx.tools is None:
            return batch, {"note": "no server tools (bare tensors): backdoor_indicator cannot probe models; batch passed unchanged"}
        tools, k = ctx.tools, ctx.tools.num_classes
        x, labels = self._indicator(tools)
        gw = ctx.global_weights.to(torch.float32).cpu()
        global_ia, global_label = indicator_accuracy(tools.model_of(gw), x, labels, k)
        if global_ia < self.params.threshold:
            return batch, {"note": f"the broadcast model carries no indicator (its indicator accuracy {global_ia:.3f} < "
                           f"threshold {self.params.threshold}); nothing to detect this round, batch passed unchanged",
                           "global_indicator_accuracy": global_ia}
        ias, best = [], []
        for u in batch.updates.to(torch.float32).cpu():
            ia, c = indicator_accuracy(tools.model_of(gw + u), x, labels, k)
            ias.append(ia)
            best.append(c)
        flagged = torch.tensor([ia >= self.params.threshold for ia in ias])
        ids = [int(c) for c in batch.client_ids]
        log = {
            "global_indicator_accuracy": global_ia,
            "indicator_accuracy": dict(zip(ids, ias)),
            "indicator_label": dict(zip(ids, best)),
            "removed": [c for c, f in zip(ids, flagged.tolist()) if f],
        }
        return batch.select((~flagged).to(batch.updates.device)), log

    def after(self, aggregate: torch.Tensor, ctx: RoundContext) -> tuple[torch.Tensor, dict]:
        if ctx.tools is None:
            return aggregate, {}
        tools = ctx.tools
        x, labels = self._indicator(tools)
        gw = ctx.global_weights.to(torch.float32).cpu()
        start = gw + aggregate.to(torch.float32).cpu()
        model = tools.model_of(start)
        plant(model, x, labels, self.params, derive_seed(tools.rt.scenario.seed, SERVER, INDICATOR_TRAIN, ctx.round))
        planted = ctx.layout.flatten_model(model) if _same_layout(ctx.layout, model) else None
        if planted is None:
            raise ValueError("backdoor_indicator: the planted model does not fit the round's layout")
        ia, c = indicator_accuracy(model, x, labels, tools.num_classes)
        out = (planted - gw).to(aggregate.device, aggregate.dtype)
        return out, {"planted_norm": float(torch.linalg.vector_norm(planted - start)),
                     "planted_indicator_accuracy": ia, "planted_indicator_label": c}


def _same_layout(layout, model: torch.nn.Module) -> bool:
    state = model.state_dict()
    return all(name in state for name in layout.names)
