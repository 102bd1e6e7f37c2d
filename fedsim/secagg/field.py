"""Arithmetic in the prime field F_p and the quantisation of real updates into it.

Secure aggregation adds masks modulo p, so updates must first become field elements. Elements are
int64 arrays with values in [0, p). The prime must lie below 2^32 so that one element fits in four
bytes and a product of two fits in 64 bits; `matmul_mod` splits its right operand into 16-bit limbs
so that a sum of up to 2^15 such products never overflows int64.

Quantisation (the map LightSecAgg, So et al. 2022, describes for real-valued models):
x -> r(c·x), with scale c (the paper's c_l) and rounding r, then negatives wrap to p + v, the
two's-complement-style embedding φ. Dequantisation reads values above (p-1)/2 as negative and
divides by c. `rounding="stochastic"` rounds up with probability equal to the fractional part
(unbiased, error < 1/c per coordinate, the paper's choice); `"nearest"` rounds half away from zero
(biased, error <= 1/(2c)). A sum of n quantised values is exact in F_p as long as
n · max|r(c·x)| <= (p-1)/2; `quantise` refuses inputs that break this for the stated `summands`.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

DEFAULT_PRIME = 2**32 - 5
"""The largest prime below 2^32: four bytes per element, the most a uint32 can carry."""

Rounding = Literal["stochastic", "nearest"]


def check_prime(p: int) -> int:
    """Return p if it is a usable field size (a prime with 2 < p < 2^32), else raise why not."""
    p = int(p)
    if not 2 < p < 2**32:
        raise ValueError(f"field size p={p} must satisfy 2 < p < 2^32 (int64 products must not overflow)")
    if not _is_prime(p):
        raise ValueError(f"field size p={p} is not prime")
    return p


def _is_prime(n: int) -> bool:
    """Miller-Rabin with the bases 2..41, deterministic for every n < 3.3e24."""
    if n in (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41):
        return True
    if n < 2 or n % 2 == 0:
        return False
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    for a in (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41):
        if a % n == 0:
            continue
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def element_bytes(p: int) -> int:
    """Bytes needed to send one element of F_p."""
    return (int(p - 1).bit_length() + 7) // 8


def random_elements(rng: np.random.Generator, p: int, shape) -> np.ndarray:
    """Uniform elements of F_p (from a seeded simulation stream, not a cryptographic generator)."""
    return rng.integers(0, p, size=shape, dtype=np.int64)


def matmul_mod(a: np.ndarray, b: np.ndarray, p: int) -> np.ndarray:
    """(a @ b) mod p for elements of F_p, exactly, with p < 2^32 and a.shape[-1] < 2^15.

    b = hi·2^16 + lo with hi, lo < 2^16, so every partial product is below 2^48 and a row of up to
    2^15 of them below 2^63."""
    a = np.asarray(a, dtype=np.int64)
    b = np.asarray(b, dtype=np.int64)
    if a.shape[-1] >= 2**15:
        raise ValueError(f"inner dimension {a.shape[-1]} too large for exact int64 accumulation")
    lo = b & 0xFFFF
    hi = b >> 16
    high = (a @ hi) % p
    return ((high << 16) + a @ lo) % p


def inverse_mod(values, p: int) -> np.ndarray:
    """Multiplicative inverses in F_p (Fermat: v^(p-2)); raises on zero."""
    v = np.asarray(values, dtype=np.int64) % p
    if np.any(v == 0):
        raise ZeroDivisionError("0 has no inverse in F_p")
    return np.array([pow(int(x), p - 2, p) for x in v.ravel()], dtype=np.int64).reshape(v.shape)


def lagrange_matrix(nodes, targets, p: int) -> np.ndarray:
    """M with M[t, k] = L_k(targets[t]), the Lagrange basis over `nodes` evaluated at `targets`.

    For values f(nodes) of a polynomial of degree < len(nodes), M @ f(nodes) = f(targets) (mod p).
    Nodes must be distinct in F_p. Python integers: the matrix is small (targets × nodes)."""
    nodes = [int(x) % p for x in nodes]
    targets = [int(x) % p for x in targets]
    if len(set(nodes)) != len(nodes):
        raise ValueError("interpolation nodes must be distinct in F_p")
    denominators = []
    for k, xk in enumerate(nodes):
        den = 1
        for m, xm in enumerate(nodes):
            if m != k:
                den = den * (xk - xm) % p
        denominators.append(pow(den, p - 2, p))
    out = np.empty((len(targets), len(nodes)), dtype=np.int64)
    for t, x in enumerate(targets):
        for k, xk in enumerate(nodes):
            num = 1
            for m, xm in enumerate(nodes):
                if m != k:
                    num = num * (x - xm) % p
            out[t, k] = num * denominators[k] % p
    return out


def quantise(
    x: np.ndarray,
    scale: float,
    p: int = DEFAULT_PRIME,
    *,
    rounding: Rounding = "stochastic",
    rng: np.random.Generator | None = None,
    summands: int = 1,
) -> np.ndarray:
    """Real vector -> F_p: φ(r(scale·x)). Refuses values whose sum over `summands` users could wrap."""
    x = np.asarray(x, dtype=np.float64)
    if not np.all(np.isfinite(x)):
        raise ValueError("cannot quantise non-finite values")
    if scale <= 0:
        raise ValueError(f"scale c={scale} must be positive")
    y = x * scale
    if rounding == "stochastic":
        if rng is None:
            raise ValueError("stochastic rounding needs an rng")
        low = np.floor(y)
        v = low + (rng.random(y.shape) < (y - low))
    elif rounding == "nearest":
        v = np.sign(y) * np.floor(np.abs(y) + 0.5)
    else:
        raise ValueError(f"rounding must be 'stochastic' or 'nearest', not {rounding!r}")
    limit = (p - 1) // 2
    peak = float(np.max(np.abs(v))) if v.size else 0.0
    if peak * summands > limit:
        raise ValueError(
            f"quantised magnitude {peak:.0f} × {summands} summands exceeds (p-1)/2 = {limit}: "
            f"the field sum would wrap; lower the scale c={scale} or clip the updates"
        )
    q = v.astype(np.int64)
    return np.where(q < 0, q + p, q)


def dequantise(q: np.ndarray, scale: float, p: int = DEFAULT_PRIME) -> np.ndarray:
    """F_p -> real vector: elements above (p-1)/2 are negative (φ^{-1}), then divide by the scale."""
    q = np.asarray(q, dtype=np.int64) % p
    signed = np.where(q > (p - 1) // 2, q - p, q)
    return signed.astype(np.float64) / scale
