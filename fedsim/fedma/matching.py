"""FedMA's matching core: BBP-MAP neuron matching and the layer bookkeeping around it (§2).

Pure numpy/scipy functions; the layer-wise protocol (broadcast, freeze, retrain, next layer) is
driven by `fedsim.fedma.strategy`, several Flower message exchanges per round. FedMA is not an
[n, d] rule: its registry entry (`aggregator: {name: fedma}`) declares it a `protocol`, and the
server picks the FedMA strategy for it.

Conventions:
- A layer is a matrix [L, D] with one row per neuron (output unit / conv filter): its incoming
  weights flattened in PyTorch order, then its bias as the **last** coordinate (`neurons_of`).
- Gaussian model (§2.2): global neuron θ_i ~ N(μ0, σ0² I) with μ0 = `mu0` on the weight
  coordinates and `mu0_bias` (0.1) on the bias coordinate; a local neuron is θ_i + N(0, σ² I).
  σ and σ0 are standard deviations, so the precisions are 1/σ² and 1/σ0² (the official code
  writes 1/σ and 1/σ0; identical at the defaults σ = σ0 = 1).
- State per global neuron, in natural parameters: a_i = μ0/σ0² + Σ w/σ² ([D]), the count n_i and
  the precision b_i = 1/σ0² + n_i/σ². σ and σ0 are shared by all coordinates (the official code
  sets the bias's σ and σ0 equal to the weights'), so b_i is one number per neuron, recomputed
  from n_i rather than accumulated. The output is the MAP estimate θ = a / b.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Sequence

import numpy as np
from pydantic import Field

from fedsim.registry import PROTOCOLS, Params

Kind = Literal["fc", "conv", "conv_to_fc"]

POPULARITY_CAP = 10  # m_i = min(n_i, 10) in the popularity term


class FedMAParams(Params):
    """FedMA matched averaging (Wang et al. 2020), chosen by `aggregator: fedma`: layer-wise BBP-MAP matching.

    Its hyper-parameters follow the official code (`main.py` / `matching/pfnm.py`, README run)."""

    sigma: float = Field(1.0, gt=0, description="σ, std of a local neuron around its global one")
    sigma0: float = Field(1.0, gt=0, description="σ0, prior std of a global neuron")
    mu0: float = Field(0.0, description="μ0, prior mean of the weight coordinates")
    mu0_bias: float = Field(0.1, description="prior mean of the bias coordinate (last one)")
    gamma: float = Field(
        7.0, gt=0, description="γ, Indian-buffet mass: larger opens new neurons more easily"
    )
    iterations: int = Field(5, ge=0, description="refinement passes over the clients per layer")
    max_neurons: int = Field(
        700, ge=1, description="soft cap on global neurons per layer (the K_new rule)"
    )
    retrain_epochs: int = Field(20, ge=0, description="local epochs retraining the unfrozen layers")
    retrain_lr: float = Field(0.01, gt=0, description="SGD lr (momentum 0.9) of local retraining")
    local_init: bool = Field(
        True, description="round 1 starts from independently initialised client models (the official code), "
        "not from the global initial model"
    )

    def match_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of `bbp_map_match` that these parameters set."""
        keys = ("sigma", "sigma0", "mu0", "mu0_bias", "gamma", "iterations", "max_neurons")
        return {k: getattr(self, k) for k in keys}


@dataclass(frozen=True)
class GaussianPrior:
    """Prior mean per coordinate (bias = last) and the two precisions of the matching model."""

    mean: np.ndarray  # μ0, [D]
    prior_precision: float  # 1/σ0²
    noise_precision: float  # 1/σ²

    @classmethod
    def build(
        cls,
        dim: int,
        sigma: float = 1.0,
        sigma0: float = 1.0,
        mu0: float = 0.0,
        mu0_bias: float = 0.1,
    ) -> "GaussianPrior":
        if dim < 2:
            raise ValueError(f"a neuron needs at least one weight and a bias, got D={dim}")
        if sigma <= 0 or sigma0 <= 0:
            raise ValueError(f"sigma and sigma0 must be positive, got {sigma}, {sigma0}")
        mean = np.full(dim, float(mu0))
        mean[-1] = mu0_bias
        return cls(mean, float(sigma0) ** -2.0, float(sigma) ** -2.0)

    @property
    def natural_mean(self) -> np.ndarray:
        """μ0/σ0², the prior's contribution to a."""
        return self.mean * self.prior_precision

    def precision(self, counts: np.ndarray) -> np.ndarray:
        """b_i = 1/σ0² + n_i/σ², the same on every coordinate."""
        return self.prior_precision + np.asarray(counts, dtype=np.float64) * self.noise_precision


@dataclass(frozen=True)
class MatchResult:
    """One matched layer: MAP global neurons, each client's local→global map and the counts n_i."""

    theta: np.ndarray  # [L_global, D]
    assignments: list[np.ndarray]  # per client, [L_j] global indices (injective)
    counts: np.ndarray  # [L_global] clients owning each global neuron

    @property
    def global_size(self) -> int:
        return int(self.theta.shape[0])


@dataclass
class _GlobalState:
    a: np.ndarray  # [L, D] precision-weighted sums
    counts: np.ndarray  # [L] int; the precisions b follow from them


def num_new_slots(local_size: int, global_size: int, max_neurons: int = 700) -> int:
    """K_new = min(L_j, max(max_neurons - L, 1)), widened to L_j - L so every local neuron fits.

    The widening only matters when a client layer is wider than the global layer plus the cap
    allows (L_j > max_neurons); the official code then leaves some local neurons unassigned.
    """
    k = min(local_size, max(max_neurons - global_size, 1))
    return max(k, local_size - global_size)


def popularity_term(counts: np.ndarray, num_clients: int) -> np.ndarray:
    """log(m_i / (J - m_i)), m_i = min(n_i, 10): the Beta-Bernoulli prior of reusing neuron i."""
    m = np.minimum(np.asarray(counts, dtype=np.float64), POPULARITY_CAP)
    if np.any(m >= num_clients) or np.any(m <= 0):
        raise ValueError(f"popularity needs 0 < min(n_i, 10) < J={num_clients}, got {counts}")
    return np.log(m / (num_clients - m))


def existing_neuron_cost(
    x: np.ndarray, a: np.ndarray, b: np.ndarray, noise_precision: float
) -> np.ndarray:
    """[L_j, L] Σ_d (x + a_i)²/(1/σ² + b_i) - Σ_d a_i²/b_i, with x = w/σ² (no popularity term).

    b_i is one precision per neuron, so the sums reduce to norms and one product x·aᵀ: memory
    O((L_j + L)·D) instead of the O(L_j·L·D) of broadcasting.
    """
    inv = 1.0 / (noise_precision + b)  # [L]
    sq_a = (a**2).sum(axis=1)
    cross = (x**2).sum(axis=1)[:, None] + 2.0 * (x @ a.T)  # |x + a|² - |a|²
    # |a|²/(s + b) - |a|²/b written as one term, free of cancellation
    return cross * inv[None, :] - (sq_a * noise_precision * inv / b)[None, :]


def new_neuron_cost(
    x: np.ndarray, prior: GaussianPrior, num_slots: int, gamma: float, num_clients: int
) -> np.ndarray:
    """[L_j, K_new] Σ_d (x + μ0/σ0²)²/(1/σ² + 1/σ0²) - Σ_d (μ0/σ0²)²σ0² - 2 log k + 2 log(γ/J)."""
    pm = prior.natural_mean
    base = ((x + pm) ** 2 / (prior.noise_precision + prior.prior_precision)).sum(axis=1)
    base -= (pm**2 / prior.prior_precision).sum()
    k = np.arange(1, num_slots + 1, dtype=np.float64)
    return base[:, None] - 2.0 * np.log(k)[None, :] + 2.0 * np.log(gamma / num_clients)


def matching_cost(
    w_j: np.ndarray,
    a: np.ndarray,
    b: np.ndarray,
    counts: np.ndarray,
    num_clients: int,
    prior: GaussianPrior,
    gamma: float = 7.0,
    max_neurons: int = 700,
) -> np.ndarray:
    """[L_j, L + K_new] gain of putting each local neuron into each existing or new global neuron.

    `w_j` holds raw weights (divided by σ² here); `b` is the per-neuron precision [L]. Columns L..
    are the new slots k = 1..K_new.
    """
    x = w_j * prior.noise_precision
    size = a.shape[0]
    slots = num_new_slots(w_j.shape[0], size, max_neurons)
    new = new_neuron_cost(x, prior, slots, gamma, num_clients)
    if size == 0:
        return new
    existing = existing_neuron_cost(x, a, b, prior.noise_precision)
    return np.hstack([existing + popularity_term(counts, num_clients), new])


def assign(cost: np.ndarray) -> np.ndarray:
    """Column of each row under the maximum-gain injective assignment (Hungarian on -cost)."""
    from scipy.optimize import linear_sum_assignment

    rows, cols = linear_sum_assignment(-cost)
    out = np.empty(cost.shape[0], dtype=np.int64)
    out[rows] = cols
    return out


def _match_client(
    w_j: np.ndarray,
    state: _GlobalState,
    num_clients: int,
    prior: GaussianPrior,
    gamma: float,
    max_neurons: int,
) -> tuple[_GlobalState, np.ndarray]:
    """Match one client into the global state (updated in place, then grown); new neurons are
    appended in local-neuron order, as in the official code."""
    size = state.a.shape[0]
    b = prior.precision(state.counts)
    cost = matching_cost(w_j, state.a, b, state.counts, num_clients, prior, gamma, max_neurons)
    cols = assign(cost)
    x = w_j * prior.noise_precision
    old = cols < size
    a, counts = state.a, state.counts
    a[cols[old]] += x[old]
    counts[cols[old]] += 1
    fresh = np.flatnonzero(~old)
    assignment = cols.copy()
    assignment[fresh] = size + np.arange(fresh.size)
    a = np.vstack([a, prior.natural_mean + x[fresh]])
    counts = np.concatenate([counts, np.ones(fresh.size, dtype=np.int64)])
    return _GlobalState(a, counts), assignment


def _remove_client(
    w_j: np.ndarray, assignment_j: np.ndarray, state: _GlobalState, prior: GaussianPrior
) -> tuple[_GlobalState, np.ndarray]:
    """Take a client's neurons out (in place) and drop neurons left with no owner.

    Returns the new state and the old→new index map (-1 for dropped neurons)."""
    a, counts = state.a, state.counts
    a[assignment_j] -= w_j * prior.noise_precision
    counts[assignment_j] -= 1
    keep = counts > 0
    remap = np.cumsum(keep) - 1
    remap[~keep] = -1
    return _GlobalState(a[keep], counts[keep]), remap


def _as_matrices(layer_weights: Sequence[Any]) -> list[np.ndarray]:
    mats = [np.asarray(_to_numpy(w), dtype=np.float64) for w in layer_weights]
    if not mats:
        raise ValueError("bbp_map_match needs at least one client layer")
    dims = {m.shape[1] if m.ndim == 2 else None for m in mats}
    if len(dims) != 1 or None in dims or any(m.shape[0] == 0 for m in mats):
        shapes = [m.shape for m in mats]
        raise ValueError(f"client layers must be non-empty [L_j, D] with one D, got {shapes}")
    return mats


def bbp_map_match(
    layer_weights: Sequence[np.ndarray],
    sigma: float = 1.0,
    sigma0: float = 1.0,
    mu0: float = 0.0,
    mu0_bias: float = 0.1,
    gamma: float = 7.0,
    iterations: int = 5,
    max_neurons: int = 700,
    seed: int = 0,
) -> MatchResult:
    """BBP-MAP matching of one layer across J clients (§2.2), each client given as [L_j, D].

    The largest client seeds the global neurons, the others are matched in decreasing size (ties
    to the lower index); then `iterations` passes over the clients in a seeded random order remove
    and re-match each client. The bias coordinate (last) gets the prior mean `mu0_bias`.
    """
    mats = _as_matrices(layer_weights)
    num_clients = len(mats)
    prior = GaussianPrior.build(mats[0].shape[1], sigma, sigma0, mu0, mu0_bias)
    order = sorted(range(num_clients), key=lambda j: -mats[j].shape[0])
    first = mats[order[0]]
    a = prior.natural_mean + first * prior.noise_precision
    state = _GlobalState(a, np.ones(first.shape[0], dtype=np.int64))
    assignments: list[np.ndarray | None] = [None] * num_clients
    assignments[order[0]] = np.arange(first.shape[0])
    match = dict(num_clients=num_clients, prior=prior, gamma=gamma, max_neurons=max_neurons)
    for j in order[1:]:
        state, assignments[j] = _match_client(mats[j], state, **match)
    rng = np.random.default_rng(seed)
    for _ in range(iterations):
        for j in rng.permutation(num_clients):
            state, remap = _remove_client(mats[j], assignments[j], state, prior)
            assignments = [None if i == j else remap[s] for i, s in enumerate(assignments)]
            state, assignments[j] = _match_client(mats[j], state, **match)
    theta = state.a / prior.precision(state.counts)[:, None]
    return MatchResult(theta, [np.asarray(s, dtype=np.int64) for s in assignments], state.counts)


# --- layer bookkeeping -------------------------------------------------------------------------


def _to_numpy(x: Any) -> np.ndarray:
    """numpy view of an array or a (possibly grad-tracking, GPU) torch tensor."""
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    return np.asarray(x)


def neurons_of(weight: Any, bias: Any, kind: Kind = "fc") -> np.ndarray:
    """[L, D] neurons of a Linear ([out, in]) or Conv2d ([out, C_in, kh, kw]) layer: weights, bias.

    The first FC after a conv block is kind "fc": its rows are already flat (C·H·W order).
    """
    w = _to_numpy(weight).astype(np.float64)
    bias_arr = _to_numpy(bias).astype(np.float64).reshape(-1, 1)
    expected_ndim = 4 if kind == "conv" else 2
    if w.ndim != expected_ndim or bias_arr.shape[0] != w.shape[0]:
        raise ValueError(
            f"{kind} layer needs a {expected_ndim}-d weight and one bias per neuron, "
            f"got {w.shape} and {bias_arr.shape[0]} biases"
        )
    return np.hstack([w.reshape(w.shape[0], -1), bias_arr])


def split_neurons(
    theta: np.ndarray, in_shape: int | Sequence[int], kind: Kind = "fc"
) -> tuple[np.ndarray, np.ndarray]:
    """Back from [L, D] to (weight, bias): in_shape is in_features (fc) or (C_in, kh, kw) (conv)."""
    shape = (in_shape,) if isinstance(in_shape, (int, np.integer)) else tuple(in_shape)
    if len(shape) != (3 if kind == "conv" else 1) or int(np.prod(shape)) != theta.shape[1] - 1:
        raise ValueError(f"in_shape {shape} does not fit {kind} rows of {theta.shape[1]} values")
    return theta[:, :-1].reshape((theta.shape[0], *shape)), theta[:, -1].copy()


def _check_assignment(assignment: Any, global_size: int) -> np.ndarray:
    idx = np.asarray(assignment, dtype=np.int64)
    in_range = idx.size == 0 or (idx.min() >= 0 and idx.max() < global_size)
    if idx.ndim != 1 or np.unique(idx).size != idx.size or not in_range:
        raise ValueError(f"assignment must be distinct indices in [0, {global_size}), got {idx}")
    return idx


def _input_blocks(w: np.ndarray, num_in: int, kind: Kind, spatial: int) -> np.ndarray:
    """[out, num_in, block] view of the input axis: 1 (fc), kh·kw (conv), H·W (conv_to_fc)."""
    if kind == "conv":
        ok = w.ndim == 4 and w.shape[1] == num_in
    elif kind == "conv_to_fc":
        ok = w.ndim == 2 and w.shape[1] == num_in * spatial
    elif kind == "fc":
        ok = w.ndim == 2 and w.shape[1] == num_in
    else:
        raise ValueError(f"unknown layer kind {kind!r}")
    if not ok:
        raise ValueError(f"{kind} weight {w.shape} lacks {num_in} input units (spatial {spatial})")
    return w.reshape(w.shape[0], num_in, -1)


def _from_blocks(blocks: np.ndarray, like: np.ndarray, kind: Kind) -> np.ndarray:
    out, units = blocks.shape[:2]
    if kind == "conv":
        return blocks.reshape((out, units, *like.shape[2:]))
    return blocks.reshape(out, -1)


def permute_next_layer(
    next_w: Any, assignment: Any, global_size: int, kind: Kind = "fc", spatial: int = 1
) -> np.ndarray:
    """Put a client's next layer in the global order of the layer below: new[:, assignment] = W.

    Input units of global neurons the client does not own get zero weights, so the client's
    function is unchanged. conv: [out, L_j, kh, kw] → [out, L, kh, kw]; conv_to_fc: blocks of
    `spatial` = H·W inputs per channel, [out, L_j·H·W] → [out, L·H·W]. The bias is unaffected.
    """
    w = _to_numpy(next_w).astype(np.float64)
    idx = _check_assignment(assignment, global_size)
    blocks = _input_blocks(w, idx.size, kind, spatial)
    new = np.zeros((blocks.shape[0], global_size, blocks.shape[2]))
    new[:, idx] = blocks
    return _from_blocks(new, w, kind)


def slice_next_layer(
    global_next_w: Any, assignment: Any, kind: Kind = "fc", spatial: int = 1
) -> np.ndarray:
    """Inverse of `permute_next_layer`: the inputs from the client's own neurons, in its order."""
    w = _to_numpy(global_next_w).astype(np.float64)
    num_in = w.shape[1] if kind != "conv_to_fc" else w.shape[1] // spatial
    idx = _check_assignment(assignment, num_in)
    return _from_blocks(_input_blocks(w, num_in, kind, spatial)[:, idx], w, kind)


def slice_to_client(global_layer: Any, assignment: Any) -> np.ndarray:
    """The client's own neurons (rows of a weight, bias or [L, D] matrix) in its local order.

    With `slice_next_layer` on the layer above this is `reconstruct_local_net`: the global model
    cut back to each client's original width at the start of a communication round.
    """
    arr = _to_numpy(global_layer)
    return arr[_check_assignment(assignment, arr.shape[0])].copy()


def class_shares(class_counts: Any) -> np.ndarray:
    """[J, C] client j's share of class c's samples; a class no client has is averaged uniformly.

    The official code divides by zero there (NaN weights); uniform is the neutral choice.
    """
    counts = np.asarray(class_counts, dtype=np.float64)
    if counts.ndim != 2 or np.any(counts < 0):
        raise ValueError(f"class_counts must be a non-negative [J, C] array, got {counts.shape}")
    total = counts.sum(axis=0)
    uniform = np.full_like(counts, 1.0 / counts.shape[0])
    return np.where(total > 0, counts / np.where(total > 0, total, 1.0), uniform)


def average_last_layer(
    weights: Sequence[Any], biases: Sequence[Any], class_counts: Any
) -> tuple[np.ndarray, np.ndarray]:
    """Per-class average of the output layer (§2.3): row c and bias c weighted by shares of class c.

    `weights` are [C, H] (PyTorch Linear layout) already permuted to the global hidden order.
    """
    w = np.stack([_to_numpy(x).astype(np.float64) for x in weights])  # [J, C, H]
    b = np.stack([_to_numpy(x).astype(np.float64) for x in biases])  # [J, C]
    share = class_shares(class_counts)
    if share.shape != b.shape or w.shape[:2] != b.shape:
        raise ValueError(
            f"shapes disagree: weights {w.shape}, biases {b.shape}, class_counts {share.shape}"
        )
    return np.einsum("jc,jch->ch", share, w), (share * b).sum(axis=0)


# A round protocol, not an [n, d] rule: its own server exchange, client step and scenario checks;
# chosen by `aggregator: {name: fedma}` in a scenario.
PROTOCOLS.register("fedma", FedMAParams, exchange="fedsim.fedma.exchange:FedMAExchange",
                   client_step="fedsim.fedma.client:fedma_train", scenario_check="fedsim.fedma.checks:fedma_conflicts",
                   chosen_by="aggregator", update_pipeline=False)(FedMAParams)
