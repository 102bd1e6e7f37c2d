"""DP-FedAvg: client-level differential privacy on the server (McMahan, Ramage, Talwar, Zhang,
ICLR 2018), with fixed clipping or with adaptive clipping (Andrew, Thakkar, McMahan, Ramaswamy,
NeurIPS 2021).

Each round: clip every update Δ_i to L2 norm S, average with equal weights over m, the expected
number of clients per round (federation.clients_per_round), and add N(0, σ²) to every coordinate
with σ = z·S/m. One client changes the sum of clipped updates by at most S, so the mean by at most
S/m, and σ/(S/m) = z is the noise multiplier the accountant composes over rounds at sampling
rate q = m / num_clients (fedsim/privacy/accountant.py).

Weights: every update counts once (w_i = 1), not by its example count. The paper's estimator
allows capped example weights, but the sensitivity then depends on the weights, and example counts
are what a client says about itself (untrusted). The denominator is m, not the number n of updates
that arrived: the paper's fixed-denominator estimator, whose sensitivity is S/m whoever replied.
When all m clients reply it is the unweighted mean of the clipped updates.

Adaptive clipping (Andrew et al., Algorithm 1): S tracks the γ-quantile of the update norms. With
b_i = 1 when ||Δ_i|| <= S (the update is *not* clipped), the server releases the noisy fraction
b̃ = (Σ b_i + N(0, σ_b²)) / m and sets S ← S·exp(−η_C (b̃ − γ)) for the next round. The count is a
second Gaussian release; for the pair to spend the budget of one mechanism with multiplier z, the
update noise uses z_Δ = (z⁻² − (2σ_b)⁻²)^(−1/2) (the centred bits b_i − ½ have sensitivity ½).
Defaults as in the paper and Flower: γ = 0.5, η_C = 0.2, σ_b = m/20, S₀ = 0.1 recommended.

Where Flower 1.41 differs (`DifferentialPrivacyServerSide{Fixed,Adaptive}Clipping`): its mean is
weighted by example counts over the replies that arrived (the noise still assumes m); its
server-side adaptive strategy counts the *clipped* updates (norm_bit = scaling factor < 1) in the
paper's rule, which moves S the wrong way (S shrinks while most updates are clipped), and it
updates S before it adds the round's noise, so the noise is scaled by the next round's S instead
of the one the updates were clipped to. fedsim follows the paper on all three; the formulas
(`noise_std`, `adaptive_noise_params`, `next_clip_norm`) are Flower's.

The noise comes from the round's seeded generator (a seed reproduces the run; whoever knows the
seed can regenerate the noise: see docs/privacy.md).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from pydantic import Field, model_validator

from fedsim.aggregators.base import AggregationError
from fedsim.defenses.base import Defense
from fedsim.defenses.clipping import clip_log, clip_rows, gaussian_like
from fedsim.privacy.accountant import PrivacyAccountant, default_delta
from fedsim.registry import AGGREGATORS, DEFENSES, Params
from fedsim.updates import RoundContext, UpdateBatch

BARE_DELTA = 1e-5  # δ when the defense runs without a scenario (bare tensors) and none is given


def noise_std(noise_multiplier: float, clip_norm: float, expected_clients: int) -> float:
    """σ = z·S/m: the std of the noise on the mean of m updates clipped to S (Flower's `compute_stdv`)."""
    return float((noise_multiplier * clip_norm) / expected_clients)


def adaptive_noise_params(noise_multiplier: float, expected_clients: int,
                          clipped_count_stddev: float | None) -> tuple[float, float]:
    """(σ_b, z_Δ): the count noise (default m/20) and the update noise multiplier that together spend
    the budget of multiplier z (Andrew et al. §3.1; Flower's `compute_adaptive_noise_params`)."""
    if noise_multiplier <= 0:
        return (0.0 if clipped_count_stddev is None else clipped_count_stddev), 0.0
    stddev = expected_clients / 20 if clipped_count_stddev is None else clipped_count_stddev
    if noise_multiplier >= 2 * stddev:
        raise ValueError(f"noise_multiplier={noise_multiplier} needs clipped_count_stddev > {noise_multiplier / 2} "
                         f"(got {stddev}{', the default m/20' if clipped_count_stddev is None else ''}): the count "
                         "noise alone would spend more than the whole budget")
    return stddev, (noise_multiplier ** (-2) - (2 * stddev) ** (-2)) ** -0.5


def next_clip_norm(clip_norm: float, unclipped_fraction: float, target_quantile: float, lr: float) -> float:
    """S·exp(−η_C (b̃ − γ)): S shrinks while more than γ of the updates fit under it, grows otherwise."""
    return clip_norm * math.exp(-lr * (unclipped_fraction - target_quantile))


ADAPTIVE_ONLY = ("target_quantile", "clip_norm_lr", "clipped_count_stddev")


class DPFedAvgParams(Params):
    clipping: Literal["fixed", "adaptive"] = Field(
        "fixed", description="fixed: S = clip_norm every round (McMahan et al.); adaptive: S follows the target quantile "
        "of the update norms (Andrew et al.)")
    noise_multiplier: float = Field(
        1.0, ge=0, le=1e4, description="z: noise std over sensitivity (σ = z·S/m on the mean); 0 adds no noise and gives ε = inf")
    clip_norm: float = Field(
        1.0, gt=0, description="S: the L2 bound of every update (fixed); S in round 1 (adaptive; the paper and Flower start at 0.1)")
    target_quantile: float = Field(
        0.5, ge=0, le=1, description="adaptive: γ, the share of updates S should leave unclipped (paper and Flower: 0.5)")
    clip_norm_lr: float = Field(0.2, gt=0, le=10, description="adaptive: η_C, the geometric step of S (paper and Flower: 0.2)")
    clipped_count_stddev: float | None = Field(
        None, ge=0, description="adaptive: σ_b, the noise on the count of unclipped updates (default m/20, the paper's advice)")
    accountant: Literal["rdp", "prv"] = Field(
        "rdp", description="how ε is composed over rounds: rdp (Rényi DP) or prv (PRV accountant, usually tighter); both opacus")
    delta: float | None = Field(
        None, gt=0, lt=1, description="δ of the reported ε; default: the largest power of ten below 1/num_clients "
        f"({BARE_DELTA:g} without a scenario)")
    sample_rate: float | None = Field(
        None, gt=0, le=1, description="q for the accountant; default: clients_per_round / num_clients (1, no amplification, "
        "without a scenario)")

    @model_validator(mode="after")
    def _adaptive_settings_need_adaptive(self):
        if self.clipping == "fixed":
            changed = [k for k in ADAPTIVE_ONLY if getattr(self, k) != type(self).model_fields[k].default]
            if changed:
                raise ValueError(f"{', '.join(changed)} only apply with clipping: adaptive")
        return self


def scenario_problems(sc, index: int) -> list[tuple[str, str, object]]:
    """What makes the reported ε wrong, refused at validation: a rule other than the mean, a defense
    after this one (it would change the clipped updates before they are averaged), a count noise
    too small for the budget."""
    spec, path, out = sc.defenses[index], f"defenses.{index}", []
    if sc.aggregator.name not in AGGREGATORS or not AGGREGATORS.get(sc.aggregator.name).traits.weighted_mean:
        means = [e.name for e in AGGREGATORS.entries() if e.traits.weighted_mean]
        out.append(("aggregator", f"dp_fedavg calibrates its noise to the mean of the clipped updates; aggregator "
                    f"{sc.aggregator.name} computes something else, so its ε would not hold: use aggregator: "
                    f"{' or '.join(means)}", sc.aggregator.name))
    later = [d.name for d in sc.defenses[index + 1:]]
    if later:
        out.append((path, f"dp_fedavg must be the last defense: {later} would change the clipped updates or their "
                    "weights before the mean, and the ε would no longer hold", [d.name for d in sc.defenses]))
    if spec.clipping == "adaptive":
        try:
            adaptive_noise_params(spec.noise_multiplier, sc.federation.clients_per_round, spec.clipped_count_stddev)
        except ValueError as err:
            out.append((f"{path}.noise_multiplier", f"{err} (m = federation.clients_per_round = "
                        f"{sc.federation.clients_per_round})", spec.noise_multiplier))
    return out


@DEFENSES.register("dp_fedavg", DPFedAvgParams, with_federation=True, scenario_check=scenario_problems)
class DPFedAvg(Defense):
    """DP-FedAvg: clip each update to S, average, add N(0, (z·S/m)²); reports ε (McMahan et al. 2018, Andrew et al. 2021)."""

    def __init__(self, params, federation=None) -> None:
        super().__init__(params)
        self.expected = None if federation is None else int(federation.clients_per_round)  # m; None: the round's n
        if params.sample_rate is not None:
            self.sample_rate = float(params.sample_rate)
        else:
            self.sample_rate = 1.0 if federation is None else federation.clients_per_round / federation.num_clients
        if params.delta is not None:
            self.delta = float(params.delta)
        else:
            self.delta = BARE_DELTA if federation is None else default_delta(federation.num_clients)
        self.clip_norm = float(params.clip_norm)
        self.accountant = PrivacyAccountant(params.accountant)
        self._pending: dict | None = None  # this round's facts, from `before` to `after`

    @property
    def adaptive(self) -> bool:
        return self.params.clipping == "adaptive"

    def before(self, batch: UpdateBatch, ctx: RoundContext) -> tuple[UpdateBatch, dict]:
        n = batch.updates.shape[0]
        m = self.expected if self.expected is not None else n
        if n > m:
            raise AggregationError(f"dp_fedavg: {n} updates but only m={m} clients are sampled per round")
        S = self.clip_norm
        clipped, norms, factor = clip_rows(batch.updates, S)
        log = {**clip_log(batch.client_ids, norms, factor), "clip_norm": S}
        pending = {"n": n, "m": m, "clip_norm": S, "next_clip_norm": S}
        if self.adaptive and n:
            stddev, _ = adaptive_noise_params(self.params.noise_multiplier, m, self.params.clipped_count_stddev)
            unclipped = int((factor == 1).sum())
            noise = float(torch.randn((), generator=ctx.generator, device=ctx.generator.device, dtype=torch.float64))
            fraction = (unclipped + stddev * noise) / m
            pending["next_clip_norm"] = next_clip_norm(S, fraction, self.params.target_quantile, self.params.clip_norm_lr)
            log.update(unclipped=unclipped, unclipped_fraction_noisy=fraction)
        self._pending = pending
        ones = torch.ones_like(batch.weights)
        return batch.with_updates(clipped).with_weights(ones), log

    def after(self, aggregate: torch.Tensor, ctx: RoundContext) -> tuple[torch.Tensor, dict]:
        if self._pending is None:
            raise RuntimeError("dp_fedavg.after called without before in the same round")
        p, self._pending = self._pending, None
        z = float(self.params.noise_multiplier)
        info: dict = {}
        z_update = z
        if self.adaptive:
            stddev, z_update = adaptive_noise_params(z, p["m"], self.params.clipped_count_stddev)
            info.update(update_noise_multiplier=z_update, clipped_count_stddev=stddev, next_clip_norm=p["next_clip_norm"])
        if p["n"] != p["m"]:  # fixed denominator: the sum over m, whoever replied
            aggregate = aggregate * (p["n"] / p["m"])
        std = noise_std(z_update, p["clip_norm"], p["m"])
        if std > 0:
            aggregate = aggregate + gaussian_like(aggregate, std, ctx.generator)
        self.clip_norm = p["next_clip_norm"]
        self.accountant.step(z, self.sample_rate)
        info.update(epsilon=self.accountant.epsilon(self.delta), delta=self.delta, accountant=self.params.accountant,
                    rounds=self.accountant.steps, noise_multiplier=z, clip_norm=p["clip_norm"], noise_std=std,
                    sample_rate=self.sample_rate, expected_clients=p["m"])
        return aggregate, info

    # --- checkpoint: the clip norm S of the next round and the accountant's steps ------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"clip_norm": torch.tensor(self.clip_norm, dtype=torch.float64), **self.accountant.state_dict()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if not state:
            return
        self.clip_norm = float(state["clip_norm"])
        self.accountant.load_state_dict(state)
