"""LightSecAgg (So et al., MLSys 2022): secure aggregation by one-shot decoding of the aggregate mask.

SecAgg and SecAgg+ secret-share the *seeds* of pairwise masks, so the server's work grows with the
number of dropped users (it regenerates every mask a dropped user shared with a neighbour).
LightSecAgg instead secret-shares the *mask itself* with an MDS code, and the survivors send the
server sums of their shares, from which it decodes Σ_{i∈U1} z_i in one decoding, whoever dropped.

Parameters: N users, privacy T (any T colluding users learn nothing about one user's mask), dropout
resiliency D, target U with N - D >= U > T (default U = N - D). A mask z_i ∈ F_p^d is cut into
U - T sub-masks of length m = ceil(d / (U - T)) (zero-padded), T uniform padding sub-masks
n_{i,1..T} are appended, and the U rows are the values of a polynomial f_i of degree < U at the
data points β_1..β_U. User j's share is [z̃_i]_j = f_i(α_j) (Lagrange coded computing; any U of
the N evaluations determine f_i, an MDS code).

Round, as implemented:
1. Offline: each user i draws z_i, encodes it, and sends [z̃_i]_j to user j (`offline_phase`).
2. Upload: each surviving user uploads x̃_i = x_i + z_i mod p; U1 = the users who uploaded, and
   the round is refused if |U1| < U.
3. Each user j in U1 still online sends Σ_{i∈U1} [z̃_i]_j = (Σ_{i∈U1} f_i)(α_j)
   (`aggregate_encoded_masks`); the round is refused if fewer than U of them arrive.
4. The server interpolates Σ f_i from any U of those values at β_1..β_{U-T}, which is
   Σ_{i∈U1} z_i (one (U-T)×U decoding of length-m vectors), and returns Σ x̃_i - Σ z_i
   (`server_aggregate`).

Why T shares reveal nothing: for fixed sub-masks, the map from the T padding rows to the shares of
any T users is the T×T block of the encoding matrix at those users' points and β_{U-T+1..U};
since a polynomial of degree < U is fixed by its values at any U distinct points, that block is
invertible, so uniform padding gives uniform shares whatever the mask.

Differences: FedML's `mask_encoding` (python/fedml/core/mpc/lightsecagg.py) pads with zeros (the
random padding is commented out), which voids the T-privacy; here the padding is uniform. Masks and
padding come from the caller's numpy Generator, fine for simulation but not a cryptographic PRG.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

import numpy as np

from fedsim.secagg.field import DEFAULT_PRIME, check_prime, lagrange_matrix, matmul_mod, random_elements


class RoundRefused(ValueError):
    """The server cannot finish the round: fewer survivors than LightSecAgg needs."""


@dataclass(frozen=True)
class LightSecAggParams:
    """N users, privacy T, dropout resiliency D, target U (default N - D), field size p."""

    num_users: int
    privacy: int
    dropout: int
    target: int | None = None
    prime: int = DEFAULT_PRIME

    def __post_init__(self) -> None:
        n, t, d = self.num_users, self.privacy, self.dropout
        if n < 1:
            raise ValueError(f"LightSecAgg needs at least one user, got N={n}")
        if t < 0 or d < 0:
            raise ValueError(f"privacy T={t} and dropout D={d} must be non-negative")
        u = n - d if self.target is None else self.target
        if not n - d >= u > t:
            raise ValueError(
                f"LightSecAgg needs N - D >= U > T, got N={n}, D={d}, U={u}, T={t}"
                + (" (D leaves no more than T survivors)" if n - d <= t else "")
            )
        check_prime(self.prime)
        if self.prime <= n + u:
            raise ValueError(f"field size p={self.prime} must exceed N + U = {n + u} (distinct evaluation points)")
        object.__setattr__(self, "target", u)

    @property
    def sub_masks(self) -> int:
        """U - T: how many pieces a mask is cut into."""
        return self.target - self.privacy

    def chunk_length(self, d: int) -> int:
        """m = ceil(d / (U - T)), the length of one sub-mask and of one encoded share."""
        return math.ceil(d / self.sub_masks)

    def data_points(self) -> np.ndarray:
        """β_1..β_U: sub-masks then padding."""
        return np.arange(1, self.target + 1, dtype=np.int64)

    def user_points(self) -> np.ndarray:
        """α_1..α_N, distinct from the β."""
        return np.arange(self.target + 1, self.target + self.num_users + 1, dtype=np.int64)

    def encoding_matrix(self) -> np.ndarray:
        """N×U: row j maps the U data rows to user j's share."""
        return lagrange_matrix(self.data_points(), self.user_points(), self.prime)


def encode_mask(mask: np.ndarray, params: LightSecAggParams, rng: np.random.Generator) -> np.ndarray:
    """Shares [z̃]_1..[z̃]_N (an N×m array) of one mask z ∈ F_p^d, with T uniform padding rows."""
    d = mask.shape[0]
    m = params.chunk_length(d)
    rows = np.zeros(params.sub_masks * m, dtype=np.int64)
    rows[:d] = mask
    data = np.concatenate(
        [rows.reshape(params.sub_masks, m), random_elements(rng, params.prime, (params.privacy, m))]
    )
    return matmul_mod(params.encoding_matrix(), data, params.prime)


def offline_phase(params: LightSecAggParams, d: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Every user's mask (N×d) and shares (N×N×m; [i, j] is what user i sends user j)."""
    masks = random_elements(rng, params.prime, (params.num_users, d))
    shares = np.stack([encode_mask(z, params, rng) for z in masks])
    return masks, shares


def mask_update(update_q: np.ndarray, mask: np.ndarray, p: int) -> np.ndarray:
    """x̃_i = x_i + z_i mod p, what user i uploads."""
    return (np.asarray(update_q, dtype=np.int64) + mask) % p


def aggregate_encoded_masks(received: np.ndarray, uploaders, p: int) -> np.ndarray:
    """Σ_{i∈U1} [z̃_i]_j for user j, from the N×m shares it received ([i] from user i)."""
    return np.asarray(received, dtype=np.int64)[sorted(uploaders)].sum(axis=0) % p


def _refuse_if_short(count: int, params: LightSecAggParams, what: str) -> None:
    if count < params.target:
        raise RoundRefused(
            f"only {count} {what}, LightSecAgg with N={params.num_users}, D={params.dropout}, "
            f"T={params.privacy} needs U={params.target}"
        )


def decode_aggregate_mask(aggregated: Mapping[int, np.ndarray], params: LightSecAggParams, d: int) -> np.ndarray:
    """Σ_{i∈U1} z_i from the aggregated shares of any U users ({user j: its length-m sum})."""
    _refuse_if_short(len(aggregated), params, "users sent aggregated encoded masks")
    senders = sorted(aggregated)[: params.target]
    values = np.stack([np.asarray(aggregated[j], dtype=np.int64) for j in senders])
    if values.shape[1] != params.chunk_length(d):
        raise ValueError(f"aggregated shares have length {values.shape[1]}, expected {params.chunk_length(d)}")
    decoder = lagrange_matrix(params.user_points()[senders], params.data_points()[: params.sub_masks], params.prime)
    return matmul_mod(decoder, values, params.prime).ravel()[:d]


def server_aggregate(
    masked_uploads: Mapping[int, np.ndarray],
    aggregated: Mapping[int, np.ndarray],
    params: LightSecAggParams,
) -> np.ndarray:
    """Σ_{i∈U1} x_i mod p from the uploads ({i: x̃_i}) and the survivors' aggregated shares."""
    _refuse_if_short(len(masked_uploads), params, "survivors")
    if not set(aggregated) <= set(masked_uploads):
        extra = sorted(set(aggregated) - set(masked_uploads))
        raise ValueError(f"users {extra} sent aggregated shares but never uploaded a masked model")
    uploads = np.stack([np.asarray(v, dtype=np.int64) for v in masked_uploads.values()])
    d = uploads.shape[1]
    total = uploads.sum(axis=0) % params.prime
    return (total - decode_aggregate_mask(aggregated, params, d)) % params.prime


def simulate_round(
    params: LightSecAggParams,
    updates_q: np.ndarray,
    rng: np.random.Generator,
    *,
    drop_before_upload=(),
    drop_after_upload=(),
) -> np.ndarray:
    """One whole round in memory: quantised updates (N×d) in, Σ over uploaders (mod p) out.

    Users in `drop_before_upload` never upload; users in `drop_after_upload` upload but send no
    aggregated share. Raises RoundRefused when too few remain at either point."""
    n, d = updates_q.shape
    if n != params.num_users:
        raise ValueError(f"{n} updates for N={params.num_users} users")
    before, after = set(drop_before_upload), set(drop_after_upload)
    if not before | after <= set(range(n)):
        raise ValueError(f"dropped users {sorted((before | after) - set(range(n)))} are not among 0..{n - 1}")
    masks, shares = offline_phase(params, d, rng)
    uploaders = [i for i in range(n) if i not in before]
    uploads = {i: mask_update(updates_q[i], masks[i], params.prime) for i in uploaders}
    _refuse_if_short(len(uploads), params, "survivors")
    senders = [j for j in uploaders if j not in after]
    aggregated = {j: aggregate_encoded_masks(shares[:, j], uploaders, params.prime) for j in senders}
    return server_aggregate(uploads, aggregated, params)


def client_elements(params: LightSecAggParams, d: int) -> dict[str, int]:
    """Field elements one user sends and receives in a round (masked model, shares, aggregate share).

    Offline it sends N-1 shares of length m and receives N-1; online it uploads d + m elements.
    The global model the server broadcasts is not counted (it is the same without secure aggregation)."""
    m = params.chunk_length(d)
    return {
        "offline_up": (params.num_users - 1) * m,
        "offline_down": (params.num_users - 1) * m,
        "online_up": d + m,
    }
