"""BatchNorm running statistics in a round's updates: set aside before the defenses and the rule,
averaged on their own, and put back into the aggregate.

Why: a client's running_mean / running_var delta is not a gradient step. Distance-based rules
(Krum, median, FLAME, ...) would otherwise rank clients by their batch statistics, norm clipping
would shrink a running variance towards the global one, and sign-flipping or noise could make it
negative. So defenses, rules and server-side attacks see the trainable coordinates only (with a
layout and global weights to match, and server tools that fill the buffers back in), while the
buffers of the clients that reached the rule are averaged with their weights at the rule's input:
FedAvg on the state dict, what BackFed and FLPoison do. A defense that drops a client drops its
buffers; a rule that picks clients (its report's `selected`: Krum, Multi-Krum) averages the picked
clients' buffers only. A coordinate-wise rule (median, trimmed mean) does not filter buffers: they
are a plain weighted mean, so a client can still send arbitrary running statistics. A model without buffers never gets here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from fedsim.aggregators.base import AggregationError
from fedsim.models.layout import ModelLayout
from fedsim.updates import RoundContext, UpdateBatch


class TrainableTools:
    """The server's tools (fedsim/server/tools.py) for a pipeline that sees trainable coordinates
    only: flat trainable vectors are completed with the global model's buffers before a model is
    built, and the server's own update is cut back to its trainable coordinates."""

    def __init__(self, inner, full_global: torch.Tensor, layout: ModelLayout) -> None:
        self.inner, self.full_global, self.layout = inner, full_global, layout
        self.mask = layout.trainable_mask.to(full_global.device)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def complete(self, trainable: torch.Tensor) -> torch.Tensor:
        full = self.full_global.clone()
        full[self.mask.to(full.device)] = trainable.to(full.device, full.dtype)
        return full

    def model_of(self, trainable: torch.Tensor) -> torch.nn.Module:
        return self.inner.model_of(self.complete(trainable))

    def train_update(self, global_weights, layout, x, y, rnd: int) -> torch.Tensor:
        update = self.inner.train_update(self.complete(global_weights), self.layout, x, y, rnd)
        return update[self.mask.to(update.device)]


@dataclass(frozen=True)
class BufferRows:
    """The buffer coordinates of a round's updates, by client id, set aside by `split`."""

    mask: torch.Tensor  # [d] bool, True at trainable coordinates
    rows: dict[int, torch.Tensor]  # client id -> its buffer delta [d - d_trainable]

    @classmethod
    def split(cls, batch: UpdateBatch, ctx: RoundContext) -> tuple[UpdateBatch, RoundContext, "BufferRows"]:
        """The batch and context restricted to trainable coordinates, and the buffers aside."""
        layout = ctx.layout
        mask = layout.trainable_mask.to(batch.updates.device)
        rows = dict(zip(batch.client_ids, batch.updates[:, ~mask]))
        tools = None if ctx.tools is None else TrainableTools(ctx.tools, ctx.global_weights, layout)
        ctx = replace(ctx, layout=layout.trainable_only(), global_weights=ctx.global_weights[mask.to(ctx.global_weights.device)],
                      tools=tools)
        return batch.with_updates(batch.updates[:, mask]), ctx, cls(mask, rows)

    def join(self, aggregate: torch.Tensor, batch: UpdateBatch, chosen: list[int] | None = None) -> torch.Tensor:
        """The full aggregate: `aggregate` at trainable coordinates, elsewhere the weighted mean of
        the buffers of `batch`'s clients (those that reached the rule, with their weights there), or
        of the `chosen` ones among them where the rule picked clients (Krum, Multi-Krum)."""
        keep = [i for i, pid in enumerate(batch.client_ids) if chosen is None or pid in set(chosen)]
        if not keep:
            raise AggregationError("cannot average BatchNorm buffers: the rule chose none of the clients")
        stacked = torch.stack([self.rows[batch.client_ids[i]] for i in keep]).to(torch.float64)
        w = batch.weights[keep].to(stacked.device, torch.float64)
        if float(w.sum()) <= 0:
            raise AggregationError("cannot average BatchNorm buffers: the weights at the rule's input sum to 0")
        mean = (w[:, None] * stacked).sum(0) / w.sum()
        full = torch.empty(self.mask.shape[0], dtype=aggregate.dtype, device=aggregate.device)
        full[self.mask.to(full.device)] = aggregate
        full[~self.mask.to(full.device)] = mean.to(full.device, full.dtype)
        return full
