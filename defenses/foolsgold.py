"""FoolsGold (Fung, Yoon, Beschastnikh 2020), following DBA's `helper.FoolsGold`.

Sybils pushing the same poisoned objective submit updates that stay alike across rounds, while
honest clients with different data drift apart. FoolsGold keeps, per client, the running sum H_i
of its output-layer update (the second-to-last tensor of the layout, i.e. the last Linear's
weight), scores each client by its largest cosine similarity to any other history, and turns
that into a weight in [0, 1]: clients with a near-duplicate get weight ~0.

Weights (as in DBA, computed in float64):
  cs = cos(H_i, H_j) - I;  v_i = max_j cs_ij;  pardoning: cs_ij *= v_i / v_j where v_i < v_j;
  wv = 1 - max_j cs_ij clipped to [0, 1];  wv /= max wv;  wv == 1 -> 0.99;
  wv = κ (ln(wv / (1 - wv)) + 0.5), +inf and values > 1 -> 1, negatives -> 0, NaN -> 0.
κ multiplies the logit as in the paper's algorithm (κ = 1, DBA's and the reference code's value,
reproduces DBA). DBA leaves NaN as NaN (it appears when every client has an exact twin, so
max wv = 0); here it becomes 0. The similarity matrix is made exactly symmetric with an exact
diagonal; DBA's (sklearn) diagonal carries rounding noise that, when all other similarities of a
client are negative, decides its v_i and the pardoning ratios.

Aggregation: DBA uses Σ wv_i g_i / n with n the number of clients and ignores example counts.
This defense instead returns the batch with weights = wv (example counts dropped), so a downstream
`fedavg` computes Σ wv_i Δ_i / Σ wv_i: the same direction, but normalised by Σ wv rather than n,
so down-weighting sybils does not also shrink the step. If every wv is 0, the original weights
are kept and the log says so.

The history uses the model delta Δ_i (≈ -lr · Σ gradients) where DBA sums gradients; cosine
similarity is unchanged by that common sign and scale.
"""

from __future__ import annotations

import torch
from pydantic import Field

from fedsim.defenses.base import Defense
from fedsim.registry import DEFENSES, Params
from fedsim.updates import RoundContext, UpdateBatch


class FoolsGoldParams(Params):
    kappa: float = Field(1.0, gt=0, description="confidence κ of the logit step (1 in DBA and the FoolsGold code)")
    layer: str | None = Field(None, description="layout tensor whose updates are compared; None = second-to-last (output-layer weight)")
    use_memory: bool = Field(True, description="compare the summed history of each client (True) or only this round's update (False)")

    def round_problem(self, n: int):
        """Two histories are each other's nearest: their equal scores normalise to weight 1 (or both 0)."""
        if n < 3:
            return "", f"foolsgold needs at least 3 updates to weigh clients apart, got n={n}: every update would get the same weight", n
        return None


def foolsgold_weights(x: torch.Tensor, kappa: float = 1.0) -> torch.Tensor:
    """FoolsGold weights [n] (float64) for the rows of `x` [n, k], as in DBA's `FoolsGold.foolsgold`."""
    x = x.to(torch.float64)
    n = x.shape[0]
    norms = torch.linalg.vector_norm(x, dim=1, keepdim=True)
    nonzero = norms[:, 0] > 0
    xn = x / torch.where(norms > 0, norms, torch.ones_like(norms))  # zero rows stay zero, as in sklearn
    cos = xn @ xn.T
    cos = 0.5 * (cos + cos.T)
    # exact self-similarity (1, or 0 for a zero row as in sklearn): rounding noise on the diagonal
    # would otherwise decide max_j cs_ij when every other similarity is negative
    cos.diagonal().copy_(nonzero.to(x.dtype))
    cs = cos - torch.eye(n, dtype=x.dtype, device=x.device)
    maxcs = cs.max(dim=1).values
    pardon = maxcs[:, None] < maxcs[None, :]
    cs = torch.where(pardon, cs * maxcs[:, None] / maxcs[None, :], cs)
    wv = (1.0 - cs.max(dim=1).values).clamp(0.0, 1.0)
    wv = wv / wv.max()
    wv = torch.where(wv == 1.0, torch.full_like(wv, 0.99), wv)
    wv = kappa * (torch.log(wv / (1.0 - wv)) + 0.5)
    wv = torch.where(wv > 1.0, torch.ones_like(wv), wv)  # includes +inf
    wv = torch.where(wv < 0.0, torch.zeros_like(wv), wv)  # includes -inf
    return torch.nan_to_num(wv, nan=0.0)


@DEFENSES.register("foolsgold", FoolsGoldParams, fixed_layers=lambda spec: True)
class FoolsGold(Defense):
    """FoolsGold: down-weight clients whose output-layer update histories are too alike (Fung et al. 2020)."""

    def __init__(self, params) -> None:
        super().__init__(params)
        self.history: dict[int, torch.Tensor] = {}

    def layer_name(self, ctx: RoundContext) -> str:
        names = ctx.layout.names
        name = self.params.layer if self.params.layer is not None else names[-2 if len(names) >= 2 else -1]
        if name not in names:
            raise ValueError(f"foolsgold.layer {name!r} is not a model tensor; have {', '.join(names)}")
        return name

    def before(self, batch: UpdateBatch, ctx: RoundContext) -> tuple[UpdateBatch, dict]:
        if batch.updates.shape[0] == 0:
            return batch, {}
        part = batch.updates[:, ctx.layout.slice(self.layer_name(ctx))].to(torch.float64).cpu()
        for cid, row in zip(batch.client_ids, part):
            prev = self.history.get(int(cid))
            self.history[int(cid)] = row.clone() if prev is None else prev + row
        compared = torch.stack([self.history[int(c)] for c in batch.client_ids]) if self.params.use_memory else part
        wv = foolsgold_weights(compared, self.params.kappa)
        log: dict = {"weights": {int(c): float(w) for c, w in zip(batch.client_ids, wv.tolist())}}
        if not bool((wv > 0).any()):
            log["note"] = "all foolsgold weights are 0; original weights kept"
            return batch, log
        return batch.with_weights(wv.to(device=batch.weights.device, dtype=batch.weights.dtype)), log

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {str(c): h.clone() for c, h in self.history.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.history = {int(c): torch.as_tensor(h, dtype=torch.float64).clone() for c, h in state.items()}
