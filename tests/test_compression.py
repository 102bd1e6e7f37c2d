"""Upload codecs against oracles: top-k / random-k selections, QSGD unbiasedness, sign and 3LC bytes,
PowerSGD's formula and convergence, error-feedback bookkeeping, Accordion's switching rule,
untrusted payloads, byte budgets on a LeNet-sized layout, and whole rounds with a codec."""

from __future__ import annotations

from math import ceil, log, prod

import numpy as np
import pytest
import torch

from conftest import QUICKSTART, quick_scenario, run_local
from fedsim.compression import PayloadError
from fedsim.compression.common import RESIDUAL
from fedsim.compression.powersgd import orthonormalize
from fedsim.compression.ternary import pack_trits, unpack_trits, zero_run_decode, zero_run_encode
from fedsim.models.layout import ModelLayout
from fedsim.registry import COMPRESSORS

LENET = ModelLayout(
    names=("conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"),
    shapes=((32, 1, 3, 3), (32,), (64, 32, 3, 3), (64,), (128, 9216), (128,), (10, 128), (10,)),
)
SMALL = ModelLayout(names=("w", "b", "v", "c"), shapes=((50, 40), (7,), (3000,), (12, 8, 3, 3)))


def codec(name: str, **params):
    entry = COMPRESSORS.get(name)
    return entry.obj(entry.params(**params))


def rand(layout: ModelLayout, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(layout.dim, generator=torch.Generator().manual_seed(seed)) * scale


def parts(layout: ModelLayout, vec: torch.Tensor) -> list[np.ndarray]:
    return [t.numpy().reshape(-1) for t in layout.unflatten(vec).values()]


# --- sparsification ---------------------------------------------------------------------------


def test_topk_keeps_exactly_the_k_largest_per_tensor():
    c = codec("topk", fraction=0.05, min_size=100, error_feedback=False)
    x = rand(SMALL, 1)
    payload, _ = c.encode(x, SMALL, {})
    out = parts(SMALL, c.decode(payload, SMALL))
    for shape, xs, ys in zip(SMALL.shapes, parts(SMALL, x), out):
        if prod(shape) < 100:  # the bias travels as it is
            np.testing.assert_array_equal(ys, xs)
            continue
        k = max(1, ceil(0.05 * xs.size))
        ref = np.sort(np.argsort(-np.abs(xs), kind="stable")[:k])
        np.testing.assert_array_equal(np.flatnonzero(ys), ref)
        np.testing.assert_array_equal(ys[ref], xs[ref])
    assert payload["t0.i"].dtype == np.uint16 and payload["t0.v"].shape == (100,)


def test_topk_large_tensor_uses_int32_indices_and_fp16_values_option():
    layout = ModelLayout(("w",), ((300, 300),))
    c = codec("topk", fraction=0.001, value_dtype="float16")
    payload, _ = c.encode(rand(layout), layout, {})
    assert payload["t0.i"].dtype == np.int32 and payload["t0.v"].dtype == np.float16 and payload["t0.i"].shape == (90,)


def test_randomk_keeps_exactly_k_entries_unchanged_and_sends_only_a_seed():
    c = codec("randomk", fraction=0.1, min_size=100, error_feedback=False)
    x = rand(SMALL, 2)
    payload, state = c.encode(x, SMALL, {})
    assert set(payload) == {"seed", "raw", "t0.v", "t2.v", "t3.v"}  # values, no indices
    out = parts(SMALL, c.decode(payload, SMALL))
    for shape, xs, ys in zip(SMALL.shapes, parts(SMALL, x), out):
        if prod(shape) >= 100:
            nz = np.flatnonzero(ys)
            assert nz.size == max(1, ceil(0.1 * xs.size))
            np.testing.assert_array_equal(ys[nz], xs[nz])
    again, _ = c.encode(x, SMALL, state)  # the state's counter moves the seed on
    assert int(again["seed"][0]) != int(payload["seed"][0])


# --- quantization -----------------------------------------------------------------------------


@pytest.mark.parametrize("levels", [3, 127])
def test_qsgd_is_unbiased_and_on_the_level_grid(levels):
    layout = ModelLayout(("w",), ((600,),))
    bucket, draws = 128, 1000
    c = codec("qsgd", levels=levels, bucket_size=bucket, min_size=1)
    x = rand(layout, 3)
    total, state = torch.zeros(layout.dim, dtype=torch.float64), {}
    for _ in range(draws):
        payload, state = c.encode(x, layout, state)
        y = c.decode(payload, layout)
        norms = np.repeat(payload["t0.norm"], bucket)[: layout.dim]
        grid = y.numpy() / (norms / levels)
        assert np.abs(grid - np.round(grid)).max() < 1e-3 and np.abs(grid).max() <= levels + 1e-3
        total += y.double()
    # each draw lies between two neighbouring levels (an interval of width ||bucket||/s), so by
    # Hoeffding |mean - x| < t with probability >= 1 - 1e-9 over all coordinates together
    width = norms / levels
    tol = width * np.sqrt(log(2 * layout.dim / 1e-9) / (2 * draws))
    bias = total.numpy() / draws - x.double().numpy()
    assert (np.abs(bias) < tol).all()
    # all N*d roundings are independent, each in a unit interval once divided by the width and
    # signed by x: Hoeffding again bounds their overall mean, which catches small systematic skews
    pooled = np.mean(np.sign(x.numpy()) * bias / width)
    assert abs(pooled) < np.sqrt(log(2 / 1e-9) / (2 * draws * layout.dim))
    assert payload["t0.q"].dtype == (np.uint8 if levels <= 7 else np.int8)
    assert payload["t0.q"].nbytes == (300 if levels <= 7 else 600)


def test_sign_decodes_to_mean_abs_times_sign_with_packed_bits():
    c = codec("sign", min_size=100, error_feedback=False)
    x = rand(SMALL, 4)
    payload, _ = c.encode(x, SMALL, {})
    out = parts(SMALL, c.decode(payload, SMALL))
    for i, (shape, xs, ys) in enumerate(zip(SMALL.shapes, parts(SMALL, x), out)):
        if prod(shape) < 100:
            continue
        np.testing.assert_allclose(ys, np.abs(xs).mean() * np.sign(xs), rtol=1e-5)
        bits = payload[f"t{i}.bits"]
        assert bits.dtype == np.uint8 and bits.size == ceil(xs.size / 8)
        np.testing.assert_array_equal(np.unpackbits(bits, count=xs.size), (xs >= 0).astype(np.uint8))


def test_fp16_round_trip_and_clamp():
    layout = ModelLayout(("w",), ((2000,),))
    x = rand(layout, 5)
    x[0] = 1e6
    y = codec("fp16").decode(codec("fp16").encode(x, layout, {})[0], layout)
    assert torch.isfinite(y).all() and y[0] == 65504.0
    torch.testing.assert_close(y[1:], x[1:], rtol=1e-3, atol=1e-4)


# --- 3LC --------------------------------------------------------------------------------------


def random_trits(rng: np.random.Generator, n: int) -> np.ndarray:
    """Trits in {-1, 0, 1} with long zero stretches (up to 600 values) between random ones."""
    q = np.zeros(n, dtype=np.int8)
    pos = 0
    while pos < n:
        span = int(rng.integers(0, 80))
        q[pos : pos + span] = rng.integers(-1, 2, size=min(span, n - pos))
        pos += span + int(rng.integers(0, 600))
    return q


def test_trit_packing_and_zero_runs_round_trip():
    rng = np.random.default_rng(0)
    for n in (1, 4, 5, 6, 69, 70, 71, 1000, 5003, 40000):
        q = random_trits(rng, n)
        packed = pack_trits(q)
        assert packed.dtype == np.uint8 and packed.size == ceil(n / 5) and packed.max() <= 242
        np.testing.assert_array_equal(unpack_trits(packed, n), q)
        enc = zero_run_encode(packed)
        assert enc.size <= packed.size
        np.testing.assert_array_equal(zero_run_decode(enc, packed.size), packed)
    zeros = pack_trits(np.zeros(5 * 31, np.int8))  # 31 zero groups = 14 + 14 + 3
    np.testing.assert_array_equal(zero_run_encode(zeros), [255, 255, 244])


def test_zero_run_encoding_matches_the_spec_byte_for_byte():
    b = np.array([121] * 15 + [5] + [121] + [7] + [121] * 2 + [242, 121, 121, 121], dtype=np.uint8)
    np.testing.assert_array_equal(zero_run_encode(b), [255, 121, 5, 121, 7, 243, 242, 244])


def test_ternary_decode_is_the_three_value_quantization():
    layout = ModelLayout(("w", "b"), ((40, 101), (5,)))
    s = 1.5
    c = codec("ternary", sparsity_multiplier=s, error_feedback=False)
    x = rand(layout, 6)
    payload, _ = c.encode(x, layout, {})
    w = x[:4040].numpy()
    scale = np.float32(np.abs(w).max() * s)
    q = np.clip(np.round(w / scale), -1, 1)
    y = c.decode(payload, layout)
    np.testing.assert_allclose(y[:4040].numpy(), q * scale, rtol=1e-6)
    np.testing.assert_array_equal(y[4040:].numpy(), x[4040:].numpy())
    sent = payload["t0.b"]
    assert sent.dtype == np.uint8 and sent.nbytes == sent.size <= ceil(4040 / 5)
    assert sum(a.nbytes for a in payload.values()) <= ceil(4040 / 5) + 4 + 5 * 4


# --- PowerSGD ---------------------------------------------------------------------------------


def test_powersgd_step_is_the_explicit_formula():
    layout = ModelLayout(("w",), ((60, 80),))
    c = codec("powersgd", rank=3, error_feedback=False)
    m = rand(layout, 7).view(60, 80)
    payload, state = c.encode(m.reshape(-1), layout, {})
    p, q = torch.from_numpy(payload["t0.p"]), torch.from_numpy(payload["t0.q"])
    torch.testing.assert_close(p.T @ p, torch.eye(3), atol=1e-5, rtol=0)
    torch.testing.assert_close(q, m.T @ p, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(c.decode(payload, layout).view(60, 80), p @ p.T @ m, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(state["q0"], payload["t0.q"])  # warm start keeps Q'


def test_powersgd_reproduces_an_exact_rank_r_matrix_and_converges_with_warm_start():
    layout = ModelLayout(("w",), ((60, 80),))
    g = torch.Generator().manual_seed(8)
    low = torch.randn(60, 3, generator=g) @ torch.randn(3, 80, generator=g)
    c = codec("powersgd", rank=3, error_feedback=False)
    state = {}
    for _ in range(2):
        payload, state = c.encode(low.reshape(-1), layout, state)
        err = torch.linalg.vector_norm(c.decode(payload, layout) - low.reshape(-1)) / torch.linalg.vector_norm(low)
        assert err < 1e-5
    # a full-rank matrix with a decaying spectrum: warm-started rounds approach the best rank-3 fit
    u, _ = torch.linalg.qr(torch.randn(60, 60, generator=g))
    v, _ = torch.linalg.qr(torch.randn(80, 60, generator=g))
    full = u @ torch.diag(0.7 ** torch.arange(60.0)) @ v.T
    best = torch.linalg.vector_norm(0.7 ** torch.arange(3.0, 60.0))
    state = {}
    for _ in range(30):
        payload, state = c.encode(full.reshape(-1), layout, state)
    err = torch.linalg.vector_norm(c.decode(payload, layout) - full.reshape(-1))
    assert err < best * 1.01


def test_powersgd_conv_kernels_are_matrices_and_vectors_stay_raw():
    layout = ModelLayout(("conv", "bias", "fc"), ((64, 32, 3, 3), (64,), (10, 128)))
    c = codec("powersgd", rank=2)
    payload, _ = c.encode(rand(layout), layout, {})
    assert payload["t0.p"].shape == (64, 2) and payload["t0.q"].shape == (288, 2)
    assert payload["raw"].shape == (64,) and payload["t2.p"].shape == (10, 2)  # only the 1-D bias is raw
    y = c.decode(payload, layout)
    assert y.shape == (layout.dim,) and y.dtype == torch.float32


def test_orthonormalize_keeps_zero_columns_finite():
    p = orthonormalize(torch.zeros(5, 2))
    assert torch.isfinite(p).all() and not p.any()


# --- error feedback ---------------------------------------------------------------------------

EF_CODECS = [
    ("topk", {"fraction": 0.02}),
    ("randomk", {"fraction": 0.02}),
    ("sign", {}),
    ("ternary", {}),
    ("powersgd", {"rank": 1}),
    ("accordion", {}),
    ("accordion", {"codec": "topk"}),
    ("qsgd", {"error_feedback": True, "levels": 3}),
    ("fp16", {"error_feedback": True}),
]


@pytest.mark.parametrize("name, params", EF_CODECS)
def test_error_feedback_keeps_the_lost_mass(name, params):
    c = codec(name, min_size=100, **params)
    assert c.params.error_feedback
    state, sent, inputs = {}, torch.zeros(SMALL.dim), torch.zeros(SMALL.dim)
    for t in range(5):
        delta = rand(SMALL, 10 + t, scale=0.1 * (t + 1))
        old = torch.tensor(state[RESIDUAL]) if RESIDUAL in state else torch.zeros(SMALL.dim)
        payload, state = c.encode(delta, SMALL, state)
        decoded = c.decode(payload, SMALL)
        assert torch.equal(torch.tensor(state[RESIDUAL]), (delta + old) - decoded)
        sent += decoded
        inputs += delta
    torch.testing.assert_close(sent + torch.tensor(state[RESIDUAL]), inputs, atol=1e-5, rtol=1e-5)


def test_unbiased_qsgd_and_fp16_default_to_no_error_feedback():
    assert not codec("qsgd").params.error_feedback and not codec("fp16").params.error_feedback
    assert all(codec(n).params.error_feedback for n in ("topk", "randomk", "sign", "ternary", "powersgd", "accordion"))
    _, state = codec("qsgd").encode(rand(SMALL), SMALL, {})
    assert RESIDUAL not in state


# --- Accordion --------------------------------------------------------------------------------


def scaled(layout: ModelLayout, norms: list[float], seed: int = 0) -> torch.Tensor:
    """A random vector whose tensors have the given L2 norms."""
    x = rand(layout, seed)
    chunks = [t / torch.linalg.vector_norm(t) * n for t, n in zip(x.split(list(layout.sizes)), norms)]
    return torch.cat(chunks)


def test_accordion_uses_high_fidelity_when_the_norm_changes_by_the_threshold():
    layout = ModelLayout(("a", "b"), ((100, 100), (60, 50)))
    c = codec("accordion", codec="topk")  # low 1%, high 10%
    seq = [([1.0, 1.0], [1, 1]),   # first upload: critical
           ([1.2, 0.4], [0, 1]),   # +20% -> low; -60% -> high
           ([0.5, 0.41], [1, 0]),  # -58% -> high; +2.5% -> low
           ([0.74, 1.0], [0, 1]),  # +48% -> low; +144% -> high
           ([0.0, 1.0], [1, 0]),   # -100% -> high
           ([0.3, 1.0], [1, 0])]   # old norm 0 -> ratio 9 -> high
    state = {}
    for t, (norms, want) in enumerate(seq):
        payload, state = c.encode(scaled(layout, norms, t), layout, state)
        assert payload["levels"].tolist() == want, t
        assert payload["t0.v"].shape == ((1000,) if want[0] else (100,))
        assert payload["t1.v"].shape == ((300,) if want[1] else (30,))
        assert c.decode(payload, layout).shape == (layout.dim,)


def test_accordion_checks_every_interval_and_switches_powersgd_ranks():
    layout = ModelLayout(("a",), ((100, 100),))
    c = codec("accordion", interval=2, low_level=1, high_level=4)
    state, levels, ranks = {}, [], []
    for t, n in enumerate([1.0, 5.0, 1.1, 1.1, 3.0, 3.0]):
        payload, state = c.encode(scaled(layout, [n], t), layout, state)
        levels.append(int(payload["levels"][0]))
        ranks.append(payload["t0.p"].shape[1])
    # checks at uploads 0, 2, 4 compare with the previous check (1.0 -> 1.1 -> 3.0)
    assert levels == [1, 1, 0, 0, 1, 1] and ranks == [4, 4, 1, 1, 4, 4]
    assert {"q0.r1", "q0.r4"} <= set(state)


def test_accordion_rejects_bad_levels_in_params():
    with pytest.raises(ValueError):
        codec("accordion", low_level=1.5)
    with pytest.raises(ValueError):
        codec("accordion", codec="topk", high_level=2.0)


# --- untrusted payloads -----------------------------------------------------------------------

ALL_LOSSY = [("fp16", {}), ("topk", {}), ("randomk", {}), ("qsgd", {}), ("qsgd", {"levels": 5}), ("sign", {}),
             ("ternary", {}), ("powersgd", {}), ("accordion", {}), ("accordion", {"codec": "topk"})]


def expect_rejected(c, payload, layout, match=None):
    with pytest.raises(PayloadError, match=match):
        c.decode(payload, layout)


@pytest.mark.parametrize("name, params", ALL_LOSSY)
def test_wrong_dtype_shape_missing_or_extra_arrays_are_rejected(name, params):
    c = codec(name, min_size=100, **params)
    payload, _ = c.encode(rand(SMALL, 11), SMALL, {})
    for k, arr in payload.items():
        wrong_dtype = arr.astype(np.float64) if arr.dtype != np.float64 else arr.astype(np.float32)
        expect_rejected(c, {**payload, k: wrong_dtype}, SMALL)
        if arr.size > 1:
            expect_rejected(c, {**payload, k: arr[:-1]}, SMALL)
        expect_rejected(c, {kk: v for kk, v in payload.items() if kk != k}, SMALL, "lacks")
    expect_rejected(c, {**payload, "junk": np.zeros(3, np.uint8)}, SMALL, "unexpected")


@pytest.mark.parametrize("name, params", ALL_LOSSY)
def test_random_bytes_give_payload_errors_or_a_vector_never_a_crash(name, params):
    c = codec(name, min_size=100, **params)
    payload, _ = c.encode(rand(SMALL, 12), SMALL, {})
    rng = np.random.default_rng(1)
    for trial in range(20):
        fuzzed = {k: rng.integers(0, 256, size=a.nbytes, dtype=np.uint8).view(a.dtype).reshape(a.shape)
                  for k, a in payload.items()}
        try:
            y = c.decode(fuzzed, SMALL)
        except PayloadError:
            continue
        assert y.shape == (SMALL.dim,) and y.dtype == torch.float32


def test_out_of_range_indices_and_levels_are_rejected():
    layout = ModelLayout(("w",), ((300, 300),))
    c = codec("topk", fraction=0.01)
    payload, _ = c.encode(rand(layout), layout, {})
    for bad in (90000, -1):
        idx = payload["t0.i"].copy()
        idx[3] = bad
        expect_rejected(c, {**payload, "t0.i": idx}, layout, "out of range")
    small = codec("topk", fraction=0.01, min_size=100)
    p2, _ = small.encode(rand(SMALL), SMALL, {})
    idx = p2["t0.i"].copy()
    idx[0] = 2000  # uint16 but past the 50x40 tensor
    expect_rejected(small, {**p2, "t0.i": idx}, SMALL, "out of range")

    q = codec("qsgd", levels=3, min_size=100)
    p3, _ = q.encode(rand(SMALL), SMALL, {})
    nib = p3["t0.q"].copy()
    nib[0] = 0xFF  # level 15 - 3 = 12 > s
    expect_rejected(q, {**p3, "t0.q": nib}, SMALL, "level")
    norms = p3["t0.norm"].copy()
    norms[0] = np.nan
    expect_rejected(q, {**p3, "t0.norm": norms}, SMALL, "finite")

    acc = codec("accordion", min_size=100)
    p4, _ = acc.encode(rand(SMALL), SMALL, {})
    expect_rejected(acc, {**p4, "levels": np.full_like(p4["levels"], 2)}, SMALL, "levels")


def test_bad_ternary_streams_are_rejected_before_allocating():
    layout = ModelLayout(("w",), ((2000,),))
    c = codec("ternary")
    payload, _ = c.encode(rand(layout), layout, {})
    m = ceil(2000 / 5)
    cases = {
        "run past the end": np.concatenate([np.full(m - 1, 7, np.uint8), [255]]).astype(np.uint8),
        "too short": np.full(10, 7, np.uint8),
        "too long": np.full(m + 1, 7, np.uint8),
        "all runs": np.full(m, 255, np.uint8),
        "empty": np.zeros(0, np.uint8),
        "two-dimensional": np.full((m, 1), 7, np.uint8),
    }
    for what, stream in cases.items():
        with pytest.raises(PayloadError):
            c.decode({**payload, "t0.b": stream}, layout)
    expect_rejected(c, {**payload, "t0.scale": np.array([np.inf], np.float32)}, layout, "finite")


# --- every codec on a LeNet-sized layout ------------------------------------------------------


@pytest.mark.parametrize("name", COMPRESSORS.names())
def test_every_codec_round_trips_and_lossy_ones_are_smaller_than_float32(name):
    c = codec(name)
    state = {}
    for t in range(2):  # the second upload uses the carried state (residuals, warm-started Q)
        payload, state = c.encode(rand(LENET, 20 + t, scale=0.01), LENET, state)
        y = c.decode(payload, LENET)
        assert y.shape == (LENET.dim,) and y.dtype == torch.float32 and torch.isfinite(y).all()
        assert all(isinstance(v, np.ndarray) for v in state.values())
        size = sum(a.nbytes for a in payload.values())
        if name != "none":
            assert size < 4 * LENET.dim, (name, size)


# --- whole runs -------------------------------------------------------------------------------

QUICK = ["federation.rounds=3", "federation.num_clients=8", "federation.clients_per_round=5"]


def run(tmp_path, overrides):
    result = run_local(quick_scenario(*QUICK, *overrides, base=QUICKSTART), tmp_path)
    return result.rounds, result.summary


def test_run_with_topk_uploads_far_fewer_bytes(tmp_path):
    plain, _ = run(tmp_path / "none", ["compression=none", "federation.rounds=1"])  # 5 float32 uploads a round
    sparse, summary = run(tmp_path / "topk", ["compression={name: topk, fraction: 0.05}"])
    assert summary["rounds_completed"] == 3
    assert all(not r["rejected"] and len(r["aggregated"]) == 5 for r in sparse)
    assert max(r["bytes_up"] for r in sparse) < 0.35 * plain[0]["bytes_up"]  # measured: about 0.24


def test_run_with_powersgd_an_attack_and_clipping(tmp_path):
    rounds, summary = run(tmp_path, [
        "compression={name: powersgd, rank: 2}",
        "defenses=[{name: norm_clipping, delta: 1.0}]",
        "attack.schedule.first=1", "attack.schedule.every=1",
    ])
    assert summary["rounds_completed"] == 3
    assert all(not r["rejected"] and r["attackers"] for r in rounds)
    assert all("norm_clipping" in r["defenses"] for r in rounds)
    assert rounds[-1]["main_accuracy"] is not None
