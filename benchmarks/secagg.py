"""LightSecAgg's cost per round against a cost model of SecAgg+'s dropout recovery on the server.

Run: `OMP_NUM_THREADS=1 .venv/bin/python benchmarks/secagg.py [--d 100000] [--users 10 20 50]
[--rates 0 0.1 0.3]`. For each N and dropout rate, LightSecAgg is set up with T = N/2 and
D = ceil(0.3·N) fixed so that every rate is tolerated (U = N - D), and one round runs in memory
on random field elements (half of the dropped users leave before the upload, half after). Printed per row:
- LightSecAgg bytes per client: up = N-1 encoded shares (offline) + masked model + one aggregated
  share (online); down = N-1 shares; 4 bytes per element of F_p, p = 2^32 - 5.
- client seconds: one user's mask generation and encoding (offline) and its masking plus share
  summation (online); server seconds: summing the uploads and the one-shot decoding.
- SecAgg+ server seconds from a COST MODEL, not Flower's SecAgg+: each user has k = min(N-1,
  2·ceil(log2 N)) neighbours on a ring (Harary graph); the server Shamir-reconstructs (Lagrange at 0
  over the prime 2^127 - 1, threshold k/2 + 1) one key per user (the self-mask seed of a survivor,
  the key of a dropped user), expands one d-length self mask per survivor and one d-length pairwise
  mask per (dropped user, surviving neighbour) with numpy's PCG64, and subtracts them mod p. Key
  agreement, signatures and the encryption of shares are left out, so the model under-counts.
One thread; LightSecAgg timings are the best of 3 calls, the SecAgg+ model one run.
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np

from fedsim.secagg.field import element_bytes, random_elements
from fedsim.secagg.lightsecagg import (
    LightSecAggParams,
    aggregate_encoded_masks,
    client_elements,
    encode_mask,
    mask_update,
    server_aggregate,
)

SHAMIR_PRIME = 2**127 - 1


def _best_of(fn, repeats: int = 3) -> float:
    """Fewest seconds of `repeats` calls (the first call also pays for warm-up)."""
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def lightsecagg_round(n: int, rate: float, d: int, seed: int) -> dict:
    """Time one LightSecAgg round with round(rate·N) dropouts and check it against the plain sum."""
    params = LightSecAggParams(n, n // 2, math.ceil(0.3 * n))
    p = params.prime
    rng = np.random.default_rng(seed)
    updates = random_elements(rng, p, (n, d))
    dropped = rng.permutation(n)[: round(rate * n)]
    before, after = set(dropped[: len(dropped) // 2].tolist()), set(dropped[len(dropped) // 2 :].tolist())

    masks = random_elements(rng, p, (n, d))
    client_offline = _best_of(lambda: encode_mask(masks[0], params, rng))
    shares = np.stack([encode_mask(z, params, rng) for z in masks])

    uploaders = [i for i in range(n) if i not in before]
    first = uploaders[0]
    client_online = _best_of(
        lambda: (mask_update(updates[first], masks[first], p), aggregate_encoded_masks(shares[:, first], uploaders, p))
    )
    uploads = {i: mask_update(updates[i], masks[i], p) for i in uploaders}
    aggregated = {j: aggregate_encoded_masks(shares[:, j], uploaders, p) for j in uploaders if j not in after}
    server = _best_of(lambda: server_aggregate(uploads, aggregated, params))
    total = server_aggregate(uploads, aggregated, params)
    assert np.array_equal(total, updates[uploaders].sum(axis=0) % p), "LightSecAgg aggregate is wrong"

    elems = client_elements(params, d)
    b = element_bytes(p)
    return {
        "params": params,
        "dropped": len(dropped),
        "up": (elems["offline_up"] + elems["online_up"]) * b,
        "down": elems["offline_down"] * b,
        "client_offline": client_offline,
        "client_online": client_online,
        "server": server,
    }


def _shamir_reconstruct(shares: list[tuple[int, int]]) -> int:
    """Lagrange interpolation at 0 over SHAMIR_PRIME."""
    secret = 0
    for k, (xk, yk) in enumerate(shares):
        num, den = 1, 1
        for m, (xm, _) in enumerate(shares):
            if m != k:
                num, den = num * -xm % SHAMIR_PRIME, den * (xk - xm) % SHAMIR_PRIME
        secret = (secret + yk * num * pow(den, -1, SHAMIR_PRIME)) % SHAMIR_PRIME
    return secret


def secagg_plus_server_model(n: int, rate: float, d: int, p: int, seed: int) -> tuple[float, int]:
    """Seconds and PRG expansions of the modelled SecAgg+ server recovery (see the module docstring)."""
    rng = np.random.default_rng(seed)
    k = min(n - 1, 2 * math.ceil(math.log2(max(n, 2))))
    neighbours = [{(i + s) % n for s in range(-(k // 2), k - k // 2 + 1) if s != 0} for i in range(n)]
    dropped = set(rng.permutation(n)[: round(rate * n)].tolist())
    threshold = k // 2 + 1
    shares = [[(x, int(rng.integers(1, 2**62))) for x in range(1, threshold + 1)] for _ in range(n)]
    aggregate = random_elements(rng, p, d)
    expansions = 0
    t0 = time.perf_counter()
    for u in range(n):
        seed_u = _shamir_reconstruct(shares[u])
        if u in dropped:
            for v in neighbours[u] - dropped:
                pair = np.random.default_rng([seed_u % 2**63, min(u, v), max(u, v)])
                aggregate = (aggregate - pair.integers(0, p, d, dtype=np.int64)) % p
                expansions += 1
        else:
            self_mask = np.random.default_rng(seed_u % 2**63).integers(0, p, d, dtype=np.int64)
            aggregate = (aggregate - self_mask) % p
            expansions += 1
    return time.perf_counter() - t0, expansions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d", type=int, default=100_000)
    parser.add_argument("--users", type=int, nargs="+", default=[10, 20, 50])
    parser.add_argument("--rates", type=float, nargs="+", default=[0.0, 0.1, 0.3])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(f"d = {args.d}, p = 2^32 - 5 (4 bytes per element), T = N/2, D = ceil(0.3 N), U = N - D")
    header = (
        f"{'N':>3} {'drop':>5} {'U':>3} {'T':>3} {'LSA up MB':>9} {'LSA down MB':>11} {'client off s':>12} "
        f"{'client on s':>11} {'LSA server s':>12} {'SA+ model s':>11} {'SA+ PRGs':>8}"
    )
    print(header)
    print("-" * len(header))
    for n in args.users:
        for rate in args.rates:
            r = lightsecagg_round(n, rate, args.d, args.seed)
            sa_s, prgs = secagg_plus_server_model(n, rate, args.d, r["params"].prime, args.seed)
            print(
                f"{n:>3} {rate:>5.0%} {r['params'].target:>3} {r['params'].privacy:>3} {r['up'] / 1e6:>9.3f} "
                f"{r['down'] / 1e6:>11.3f} {r['client_offline']:>12.4f} {r['client_online']:>11.4f} "
                f"{r['server']:>12.4f} {sa_s:>11.4f} {prgs:>8}"
            )


if __name__ == "__main__":
    main()
