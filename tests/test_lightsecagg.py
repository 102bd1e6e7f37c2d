"""LightSecAgg and its field arithmetic, against hand values, Python-integer brute force and exact
distributions (docs/secure_aggregation.md)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedsim.secagg.field import (
    DEFAULT_PRIME,
    check_prime,
    dequantise,
    element_bytes,
    inverse_mod,
    lagrange_matrix,
    matmul_mod,
    quantise,
)
from fedsim.secagg.lightsecagg import (
    LightSecAggParams,
    RoundRefused,
    aggregate_encoded_masks,
    client_elements,
    encode_mask,
    offline_phase,
    server_aggregate,
    simulate_round,
)

# ---- oracles in plain Python integers ------------------------------------------------------------


def _solve_mod(a: list[list[int]], b: list[list[int]], p: int) -> list[list[int]]:
    """Gauss-Jordan elimination mod p: X with a X = b (a square and invertible)."""
    n = len(a)
    rows = [list(a[i]) + list(b[i]) for i in range(n)]
    for col in range(n):
        pivot = next(r for r in range(col, n) if rows[r][col] % p)
        rows[col], rows[pivot] = rows[pivot], rows[col]
        inv = pow(rows[col][col], p - 2, p)
        rows[col] = [v * inv % p for v in rows[col]]
        for r in range(n):
            if r != col and rows[r][col]:
                f = rows[r][col]
                rows[r] = [(v - f * w) % p for v, w in zip(rows[r], rows[col])]
    return [row[n:] for row in rows]


def _det_mod(a: list[list[int]], p: int) -> int:
    n, m, det = len(a), [list(r) for r in a], 1
    for col in range(n):
        pivot = next((r for r in range(col, n) if m[r][col] % p), None)
        if pivot is None:
            return 0
        if pivot != col:
            m[col], m[pivot], det = m[pivot], m[col], -det
        det = det * m[col][col] % p
        inv = pow(m[col][col], p - 2, p)
        for r in range(col + 1, n):
            f = m[r][col] * inv % p
            m[r] = [(v - f * w) % p for v, w in zip(m[r], m[col])]
    return det % p


def _interpolate(points, values, targets, p):
    """Evaluate at `targets` the polynomial of degree < len(points) through (points, values):
    coefficients from the Vandermonde system, so independent of the Lagrange form under test."""
    k = len(points)
    vander = [[pow(int(x), e, p) for e in range(k)] for x in points]
    coeffs = _solve_mod(vander, [[int(v) for v in row] for row in values], p)
    return np.array(
        [[sum(coeffs[e][c] * pow(int(t), e, p) for e in range(k)) % p for c in range(len(values[0]))] for t in targets],
        dtype=np.int64,
    )


# ---- field ---------------------------------------------------------------------------------------


def test_field_by_hand():
    assert check_prime(13) == 13 and check_prime(DEFAULT_PRIME) == 2**32 - 5
    for bad in (1, 15, 2**31, 2**32 + 15):
        with pytest.raises(ValueError):
            check_prime(bad)
    assert inverse_mod([1, 2, 3, 12], 13).tolist() == [1, 7, 9, 12]
    assert element_bytes(13) == 1 and element_bytes(DEFAULT_PRIME) == 4 and element_bytes(65537) == 3
    # Lagrange basis over nodes 1, 2 at target 3 in F_13: L_1(3) = (3-2)/(1-2) = -1, L_2(3) = 2
    assert lagrange_matrix([1, 2], [3], 13).tolist() == [[12, 2]]


def test_matmul_mod_matches_python_integers():
    rng = np.random.default_rng(1)
    p = DEFAULT_PRIME
    a = rng.integers(p - 1000, p, (7, 40), dtype=np.int64)  # near-maximal values: overflow would show
    b = rng.integers(p - 1000, p, (40, 33), dtype=np.int64)
    exact = (a.astype(object) @ b.astype(object)) % p
    assert np.array_equal(matmul_mod(a, b, p), exact.astype(np.int64))


def test_quantise_by_hand():
    p, c = 101, 10.0
    q = quantise(np.array([0.3, -0.3, 1.26, -0.05, 0.0]), c, p, rounding="nearest")
    assert q.tolist() == [3, 98, 13, 100, 0]  # -3 -> 98, 12.6 -> 13, -0.5 -> -1 (half away from 0)
    assert dequantise(q, c, p).tolist() == [0.3, -0.3, 1.3, -0.1, 0.0]
    assert dequantise(np.array([50, 51]), 1.0, p).tolist() == [50.0, -50.0]  # (p-1)/2 is the last positive


def test_stochastic_rounding_is_unbiased_and_within_one_step():
    rng = np.random.default_rng(2)
    x = np.full(200_000, 0.237)
    q = quantise(x, 10.0, 101, rng=rng)
    assert set(np.unique(q).tolist()) == {2, 3}
    back = dequantise(q, 10.0, 101)
    assert abs(back.mean() - 0.237) < 0.003  # std of the mean ~ 0.1·0.42/sqrt(2e5) ~ 1e-4


def test_quantise_refuses_wrapping_sums_and_bad_input():
    with pytest.raises(ValueError, match="exceeds"):
        quantise(np.array([3.0]), 10.0, 101, rounding="nearest", summands=2)  # 2·30 > 50
    quantise(np.array([2.5]), 10.0, 101, rounding="nearest", summands=2)  # 2·25 <= 50
    with pytest.raises(ValueError, match="non-finite"):
        quantise(np.array([np.nan]), 1.0, 101, rounding="nearest")
    with pytest.raises(ValueError, match="rng"):
        quantise(np.array([1.0]), 1.0, 101)


# ---- parameters ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, reason",
    [
        (dict(num_users=10, privacy=5, dropout=5), "N - D >= U > T"),
        (dict(num_users=10, privacy=2, dropout=3, target=8), "N - D >= U > T"),
        (dict(num_users=10, privacy=4, dropout=2, target=4), "N - D >= U > T"),
        (dict(num_users=10, privacy=1, dropout=-1), "non-negative"),
        (dict(num_users=10, privacy=1, dropout=1, prime=13), "must exceed N \\+ U"),
        (dict(num_users=4, privacy=1, dropout=1, prime=15), "not prime"),
    ],
)
def test_impossible_parameters_are_refused_with_the_reason(kwargs, reason):
    with pytest.raises(ValueError, match=reason):
        LightSecAggParams(**kwargs)


def test_target_defaults_to_n_minus_d():
    assert LightSecAggParams(10, 2, 3).target == 7
    assert LightSecAggParams(10, 2, 3, target=5).sub_masks == 3


# ---- MDS code ------------------------------------------------------------------------------------


@pytest.mark.parametrize("n, t, d_drop, u", [(4, 1, 1, None), (6, 2, 2, 3), (7, 0, 2, None), (9, 3, 3, 5)])
def test_any_u_shares_recover_the_sub_masks(n, t, d_drop, u):
    p = 65537
    params = LightSecAggParams(n, t, d_drop, target=u, prime=p)
    rng = np.random.default_rng(n)
    d = 2 * params.sub_masks + 1  # not a multiple: exercises the zero padding
    mask = rng.integers(0, p, d)
    shares = encode_mask(mask, params, rng)
    m = params.chunk_length(d)
    expected = np.zeros(params.sub_masks * m, dtype=np.int64)
    expected[:d] = mask
    expected = expected.reshape(params.sub_masks, m)
    beta = params.data_points()[: params.sub_masks]
    for subset in itertools.combinations(range(n), params.target):
        got = _interpolate(params.user_points()[list(subset)], shares[list(subset)].tolist(), beta, p)
        assert np.array_equal(got, expected), subset


def test_all_n_shares_lie_on_one_polynomial_of_degree_below_u():
    params = LightSecAggParams(8, 2, 2, prime=65537)
    rng = np.random.default_rng(3)
    shares = encode_mask(rng.integers(0, 65537, 12), params, rng)
    alpha = params.user_points()
    u = params.target
    predicted = _interpolate(alpha[:u], shares[:u].tolist(), alpha[u:], 65537)
    assert np.array_equal(predicted, shares[u:])


# ---- the round -----------------------------------------------------------------------------------


@st.composite
def _rounds(draw):
    n = draw(st.integers(1, 20))
    d_drop = draw(st.integers(0, n - 1))
    t = draw(st.integers(0, n - d_drop - 1))
    u = draw(st.integers(t + 1, n - d_drop))
    d = draw(st.integers(1, 1000))
    before = draw(st.integers(0, n - u))  # at most N - U <= D users drop in all
    after = draw(st.integers(0, n - u - before))
    order = draw(st.permutations(range(n)))
    return n, t, d_drop, u, d, order[:before], order[before : before + after], draw(st.integers(0, 2**32))


@settings(max_examples=60, deadline=None)
@given(_rounds())
def test_aggregate_equals_plain_sum_of_quantised_updates(case):
    n, t, d_drop, u, d, before, after, seed = case
    params = LightSecAggParams(n, t, d_drop, target=u)
    rng = np.random.default_rng(seed)
    p = params.prime
    updates = rng.integers(0, p, (n, d), dtype=np.int64)  # any field elements, including near p
    got = simulate_round(params, updates, rng, drop_before_upload=before, drop_after_upload=after)
    uploaders = [i for i in range(n) if i not in before]
    exact = (updates[uploaders].astype(object).sum(axis=0) % p).astype(np.int64)
    assert np.array_equal(got, exact)


@pytest.mark.parametrize("before, after", [(4, 0), (0, 4), (2, 2), (3, 1)])
def test_more_than_d_dropouts_refuse_the_round(before, after):
    params = LightSecAggParams(10, 2, 3)
    rng = np.random.default_rng(4)
    updates = rng.integers(0, 100, (10, 50))
    with pytest.raises(RoundRefused, match=r"only 6 .*D=3.*needs U=7"):
        simulate_round(
            params, updates, rng, drop_before_upload=range(before), drop_after_upload=range(before, before + after)
        )


def test_server_refuses_shares_from_users_who_never_uploaded():
    params = LightSecAggParams(5, 1, 1, prime=65537)
    rng = np.random.default_rng(5)
    masks, shares = offline_phase(params, 6, rng)
    uploads = {i: masks[i] for i in range(4)}
    aggregated = {j: aggregate_encoded_masks(shares[:, j], range(4), params.prime) for j in range(5)}
    with pytest.raises(ValueError, match=r"users \[4\] sent aggregated shares"):
        server_aggregate(uploads, aggregated, params)


def test_dequantised_aggregate_within_quantisation_error():
    n, d, c = 12, 1000, 2.0**16
    params = LightSecAggParams(n, 3, 3)
    rng = np.random.default_rng(6)
    updates = rng.normal(0, 0.05, (n, d))
    for rounding, bound in (("nearest", 0.5 / c), ("stochastic", 1.0 / c)):
        q = np.stack([quantise(x, c, params.prime, rounding=rounding, rng=rng, summands=n) for x in updates])
        survivors = list(range(2, n))
        agg = simulate_round(params, q, rng, drop_before_upload=[0, 1], drop_after_upload=[5])
        err = np.abs(dequantise(agg, c, params.prime) - updates[survivors].sum(axis=0))
        assert err.max() <= len(survivors) * bound + 1e-12


# ---- privacy -------------------------------------------------------------------------------------


@pytest.mark.parametrize("n, t, d_drop", [(5, 2, 1), (7, 3, 2), (8, 1, 3), (9, 4, 0)])
def test_padding_block_of_any_t_users_is_invertible(n, t, d_drop):
    """Shares of T users = A·sub-masks + B·padding with B the T×T block; B invertible means uniform
    padding makes those shares uniform, independent of the mask."""
    params = LightSecAggParams(n, t, d_drop, prime=65537)
    e = params.encoding_matrix()
    for users in itertools.combinations(range(n), t):
        block = e[np.ix_(users, range(params.sub_masks, params.target))].tolist()
        assert _det_mod(block, params.prime) != 0, users


def test_t_shares_are_uniform_whatever_the_mask():
    """Exact: over all p^T paddings, every T-tuple of shares appears exactly once, for any mask."""
    p = 13
    params = LightSecAggParams(5, 2, 1, prime=p)
    e = params.encoding_matrix()
    k, t = params.sub_masks, params.privacy
    paddings = np.array(list(itertools.product(range(p), repeat=t)), dtype=np.int64).T  # T × p^T
    for mask in (np.zeros(k, dtype=np.int64), np.array([5, 11])):
        for users in itertools.combinations(range(5), t):
            rows = e[list(users)]
            shares = (rows[:, :k] @ mask[:, None] + rows[:, k:] @ paddings) % p
            assert len({tuple(col) for col in shares.T}) == p**t


def test_encode_mask_share_is_statistically_uniform():
    """Black-box chi-square: user 0's share of a fixed mask, T = 1, over 13 000 encodings in F_13."""
    p = 13
    params = LightSecAggParams(4, 1, 1, prime=p)
    rng = np.random.default_rng(7)
    mask = np.array([3, 7])
    counts = np.bincount([encode_mask(mask, params, rng)[0, 0] for _ in range(13_000)], minlength=p)
    chi2 = (((counts - 1000) ** 2) / 1000).sum()
    assert chi2 < 32.9  # 99.9th percentile of chi-square with 12 degrees of freedom


def test_client_elements():
    params = LightSecAggParams(10, 2, 3)  # U - T = 5
    assert client_elements(params, 1001) == {"offline_up": 9 * 201, "offline_down": 9 * 201, "online_up": 1001 + 201}
