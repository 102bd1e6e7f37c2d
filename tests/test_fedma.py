"""FedMA matching core: BBP-MAP, the Hungarian step, and the layer bookkeeping (§2 of the spec).

Oracles: layers whose neurons are known permutations of one base layer, the spec's cost formulas
written out element by element, brute force over every injective assignment, the posterior mean
recomputed from scratch, networks whose function must be unchanged, and index loops over blocks.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from torch import nn

from fedsim.fedma.matching import (
    FedMAParams,
    GaussianPrior,
    assign,
    average_last_layer,
    bbp_map_match,
    matching_cost,
    neurons_of,
    num_new_slots,
    permute_next_layer,
    slice_next_layer,
    slice_to_client,
    split_neurons,
)
from fedsim.models.nets import MlpParams, mlp


def prior_mean(dim: int, mu0: float = 0.0, mu0_bias: float = 0.1) -> np.ndarray:
    return np.array([mu0] * (dim - 1) + [mu0_bias])


def permuted_clients(base: np.ndarray, num_clients: int, noise: float, seed: int):
    """Each client holds the base layer with its rows shuffled (client row i = base row perm[i])."""
    rng = np.random.default_rng(seed)
    perms = [rng.permutation(base.shape[0]) for _ in range(num_clients)]
    layers = [base[p] + noise * rng.standard_normal(base.shape) for p in perms]
    return perms, layers


def posterior_from_scratch(layers, assignments, size, sigma, sigma0, mu0_vec):
    """θ = (μ0/σ0² + Σ w/σ²) / (1/σ0² + n/σ²) summed over each global neuron's owners."""
    dim = layers[0].shape[1]
    total = np.zeros((size, dim))
    counts = np.zeros(size)
    for w, s in zip(layers, assignments):
        total[s] += w
        counts[s] += 1
    theta = (mu0_vec / sigma0**2 + total / sigma**2) / (1 / sigma0**2 + counts[:, None] / sigma**2)
    return theta, counts


# --- BBP-MAP -----------------------------------------------------------------------------------


@pytest.mark.parametrize("noise", [0.0, 1e-3])
def test_recovers_known_permutation(noise):
    num_clients, size, dim = 4, 6, 11
    base = 2.0 * np.random.default_rng(1).standard_normal((size, dim))
    perms, layers = permuted_clients(base, num_clients, noise, seed=2)
    res = bbp_map_match(layers)
    assert res.global_size == size
    pi = np.empty(size, dtype=int)  # base neuron -> global index, read off client 0
    pi[perms[0]] = res.assignments[0]
    assert sorted(pi) == list(range(size))
    for p, s in zip(perms, res.assignments):
        np.testing.assert_array_equal(s, pi[p])
    np.testing.assert_array_equal(res.counts, np.full(size, num_clients))
    # σ = σ0 = 1, μ0 = 0: θ = (Σ w + μ0) / (n + 1), the bias pulled toward 0.1 / (n + 1).
    for k in range(size):
        rows = [w[np.flatnonzero(p == k)[0]] for p, w in zip(perms, layers)]
        expected = (np.sum(rows, axis=0) + prior_mean(dim)) / (num_clients + 1)
        np.testing.assert_allclose(res.theta[pi[k]], expected, rtol=1e-12, atol=1e-12)
    if noise == 0.0:
        n = num_clients
        np.testing.assert_allclose(res.theta[pi, :-1], base[:, :-1] * n / (n + 1))
        np.testing.assert_allclose(res.theta[pi, -1], (n * base[:, -1] + 0.1) / (n + 1))


def test_posterior_and_counts_consistent_after_refinement():
    """Clients of different widths, partly shared neurons: the incremental bookkeeping (removal,
    dropping, re-indexing) must leave exactly the posterior of the final assignments."""
    rng = np.random.default_rng(3)
    pool = 1.5 * rng.standard_normal((12, 8))
    layers = [pool[rng.choice(12, size=n, replace=False)] + 0.3 * rng.standard_normal((n, 8))
              for n in (7, 5, 9, 6, 4)]
    sigma, sigma0 = 0.8, 1.4
    res = bbp_map_match(layers, sigma=sigma, sigma0=sigma0, mu0=0.05, iterations=4, seed=7)
    for w, s in zip(layers, res.assignments):
        assert s.shape == (w.shape[0],) and np.unique(s).size == s.size
    theta, counts = posterior_from_scratch(layers, res.assignments, res.global_size, sigma, sigma0,
                                           prior_mean(8, mu0=0.05))
    np.testing.assert_array_equal(res.counts, counts)
    assert counts.min() >= 1
    np.testing.assert_allclose(res.theta, theta, rtol=1e-9, atol=1e-9)
    again = bbp_map_match(layers, sigma=sigma, sigma0=sigma0, mu0=0.05, iterations=4, seed=7)
    np.testing.assert_array_equal(again.theta, res.theta)


def test_single_client_is_its_own_shrunk_layer():
    w = np.random.default_rng(4).standard_normal((5, 4))
    res = bbp_map_match([w])
    np.testing.assert_array_equal(res.assignments[0], np.arange(5))
    np.testing.assert_allclose(res.theta, (w + prior_mean(4)) / 2)


# --- cost matrix and the Hungarian step --------------------------------------------------------


def oracle_cost(w, a, b, counts, num_clients, sigma, sigma0, mu0_vec, gamma, max_neurons):
    """The spec's §2.2 formulas, one entry at a time."""
    s2, s02 = sigma**2, sigma0**2
    size = a.shape[0]
    k_new = min(w.shape[0], max(max_neurons - size, 1))
    cost = np.zeros((w.shape[0], size + k_new))
    for l in range(w.shape[0]):
        for i in range(size):
            m = min(counts[i], 10)
            cost[l, i] = (
                np.sum((w[l] / s2 + a[i]) ** 2 / (1 / s2 + b[i]))
                - np.sum(a[i] ** 2 / b[i])
                + math.log(m / (num_clients - m))
            )
        for k in range(1, k_new + 1):
            cost[l, size + k - 1] = (np.sum((w[l] / s2 + mu0_vec / s02) ** 2 / (1 / s2 + 1 / s02))
                                     - np.sum((mu0_vec / s02) ** 2 * s02)
                                     - 2 * math.log(k) + 2 * math.log(gamma / num_clients))
    return cost


def brute_force(cost):
    """Best total over every injective map of rows into columns, and all maps reaching it."""
    rows, cols = cost.shape
    maps = itertools.permutations(range(cols), rows)
    totals = {p: sum(cost[r, c] for r, c in enumerate(p)) for p in maps}
    best = max(totals.values())
    return best, [p for p, t in totals.items() if t > best - 1e-9]


def partition(cols, size):
    """Rows per existing neuron, and rows opening new ones (the new slots are interchangeable)."""
    return tuple(int(c) if c < size else -1 for c in cols)


def test_cost_matrix_matches_formula():
    rng = np.random.default_rng(5)
    dim, sigma, sigma0, gamma = 6, 0.7, 1.3, 3.0
    prior = GaussianPrior.build(dim, sigma, sigma0, mu0=0.2, mu0_bias=0.1)
    w = rng.standard_normal((4, dim))
    a = rng.standard_normal((5, dim))
    b = rng.uniform(1.0, 4.0, 5)  # one precision per neuron
    counts = np.array([1, 2, 3, 12, 4])
    for num_clients, max_neurons in [(13, 700), (13, 7), (13, 3)]:
        got = matching_cost(w, a, b, counts, num_clients, prior, gamma, max_neurons)
        want = oracle_cost(
            w, a, b, counts, num_clients, sigma, sigma0, prior.mean, gamma, max_neurons
        )
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("seed", range(6))
def test_hungarian_step_equals_brute_force(seed):
    rng = np.random.default_rng(seed)
    dim = 5
    w0 = 2.0 * rng.standard_normal((4, dim))
    near = w0[[3, 1]] + 0.2 * rng.standard_normal((2, dim))  # close to two of client 0's neurons
    w1 = np.vstack([near, 2.0 * rng.standard_normal((1, dim))])[rng.permutation(3)]
    # The cost of matching client 1 against the global layer seeded by client 0 (σ = σ0 = 1).
    mu = prior_mean(dim)
    a, b, counts = mu + w0, np.full(4, 2.0), np.ones(4, dtype=int)
    cost = oracle_cost(w1, a, b, counts, 2, 1.0, 1.0, mu, 7.0, 700)
    best, argmaxes = brute_force(cost)
    cols = assign(cost)
    assert cost[np.arange(3), cols].sum() == pytest.approx(best, abs=1e-9)
    assert partition(cols, 4) in {partition(p, 4) for p in argmaxes}
    # The full matcher without refinement takes exactly that step.
    res = bbp_map_match([w0, w1], iterations=0)
    np.testing.assert_array_equal(res.assignments[0], np.arange(4))
    assert partition(res.assignments[1], 4) in {partition(p, 4) for p in argmaxes}
    assert res.global_size == 4 + sum(c >= 4 for c in cols)


def test_hungarian_brute_force_random_costs():
    rng = np.random.default_rng(9)
    for rows, cols in [(3, 3), (3, 5), (4, 6), (2, 6)]:
        cost = rng.standard_normal((rows, cols))
        picked = assign(cost)
        assert np.unique(picked).size == rows
        assert cost[np.arange(rows), picked].sum() == pytest.approx(brute_force(cost)[0])


# --- new neurons and the cap -------------------------------------------------------------------


def orthogonal_layer(rows: range, dim: int, scale: float = 5.0) -> np.ndarray:
    w = np.zeros((len(rows), dim + 1))
    w[np.arange(len(rows)), list(rows)] = scale
    return w


def test_distinct_neurons_become_new_global_neurons():
    a, b = orthogonal_layer(range(0, 4), 8), orthogonal_layer(range(4, 8), 8)
    res = bbp_map_match([a, b])
    assert res.global_size == 8
    np.testing.assert_array_equal(res.counts, np.ones(8))
    np.testing.assert_array_equal(np.sort(np.concatenate(res.assignments)), np.arange(8))
    owners = np.vstack([a, b])[np.argsort(np.concatenate(res.assignments))]
    np.testing.assert_allclose(res.theta, (owners + prior_mean(9)) / 2)


def test_shared_and_distinct_neurons():
    a = orthogonal_layer(range(0, 4), 8)
    b = orthogonal_layer(range(2, 6), 8)  # shares units 2 and 3 with a
    res = bbp_map_match([a, b])
    assert res.global_size == 6
    assert sorted(res.counts.tolist()) == [1, 1, 1, 1, 2, 2]
    np.testing.assert_array_equal(res.assignments[1][:2], res.assignments[0][2:])


def test_growth_is_capped_by_max_neurons():
    a, b = orthogonal_layer(range(0, 4), 8), orthogonal_layer(range(4, 8), 8)
    assert bbp_map_match([a, b], max_neurons=5).global_size == 5
    assert bbp_map_match([a, b], max_neurons=4).global_size == 5  # at least one new slot per match
    assert num_new_slots(4, 4, 5) == 1
    assert num_new_slots(4, 2, 700) == 4
    assert num_new_slots(4, 700, 700) == 1
    assert num_new_slots(8, 0, 5) == 8  # widened: every local neuron needs a column
    assert num_new_slots(8, 3, 5) == 5


# --- the matched network -----------------------------------------------------------------------


def mlp_weights(seed: int):
    torch.manual_seed(seed)
    net = mlp((6,), 3, MlpParams(hidden=[8])).double()
    with torch.no_grad():
        net[1].weight.mul_(10.0)  # hidden units far enough apart to beat γ's new-neuron prior
        net[1].bias.mul_(10.0)
    params = (net[1].weight, net[1].bias, net[3].weight, net[3].bias)
    return net, [p.detach().numpy().copy() for p in params]


def forward(w1, b1, w2, b2, x):
    return np.maximum(x @ w1.T + b1, 0.0) @ w2.T + b2


def test_mlp_with_permuted_hidden_units():
    net, (w1, b1, w2, b2) = mlp_weights(0)
    x = np.random.default_rng(0).standard_normal((32, 6))
    with torch.no_grad():
        reference = net(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(forward(w1, b1, w2, b2, x), reference, rtol=1e-12)
    rng = np.random.default_rng(1)
    perms = [rng.permutation(8) for _ in range(3)]
    clients = [(w1[p], b1[p], w2[:, p], b2) for p in perms]
    layers = [neurons_of(cw1, cb1, "fc") for cw1, cb1, _, _ in clients]
    res = bbp_map_match(layers)
    assert res.global_size == 8
    # Default σ = σ0 = 1: identical clients give the shrunk mean (3 w + μ0) / 4.
    np.testing.assert_allclose(res.theta[res.assignments[0]], (3 * layers[0] + prior_mean(7)) / 4)

    # Each client in the global order: its own neurons at its assignment, layer 2 permuted.
    for (cw1, cb1, cw2, cb2), layer, s in zip(clients, layers, res.assignments):
        full = res.theta.copy()
        full[s] = layer
        gw1, gb1 = split_neurons(full, 6, "fc")
        gw2 = permute_next_layer(cw2, s, res.global_size, "fc")
        out = forward(gw1, gb1, gw2, cb2, x)
        np.testing.assert_allclose(out, reference, rtol=1e-12, atol=1e-12)
        np.testing.assert_array_equal(slice_to_client(full, s), layer)
        np.testing.assert_array_equal(slice_next_layer(gw2, s, "fc"), cw2)
    # All clients' permuted second layers coincide: the matched layers line up.
    patched = [permute_next_layer(c[2], s, 8) for c, s in zip(clients, res.assignments)]
    for p in patched[1:]:
        np.testing.assert_allclose(p, patched[0])
    # With a sharp likelihood (σ << σ0) θ is the plain average, so the matched net is the original.
    sharp = bbp_map_match(layers, sigma=1e-3)
    gw1, gb1 = split_neurons(sharp.theta, 6, "fc")
    gw2 = np.mean([permute_next_layer(c[2], s, 8) for c, s in zip(clients, sharp.assignments)], 0)
    np.testing.assert_allclose(forward(gw1, gb1, gw2, b2, x), reference, rtol=1e-5, atol=1e-5)


def test_client_function_kept_when_global_layer_is_wider():
    """A client that owns only some global neurons: zero columns silence the others."""
    _, (w1, b1, w2, b2) = mlp_weights(2)
    other = 5.0 * np.random.default_rng(3).standard_normal((8, 7))
    res = bbp_map_match([neurons_of(w1, b1), other])
    assert res.global_size > 8
    s = res.assignments[0]
    full = res.theta.copy()
    full[s] = neurons_of(w1, b1)
    gw1, gb1 = split_neurons(full, 6)
    gw2 = permute_next_layer(w2, s, res.global_size)
    x = np.random.default_rng(4).standard_normal((16, 6))
    want = forward(w1, b1, w2, b2, x)
    np.testing.assert_allclose(forward(gw1, gb1, gw2, b2, x), want, rtol=1e-12)


# --- last layer --------------------------------------------------------------------------------


def test_average_last_layer_by_hand():
    w0, b0 = np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]), np.array([1.0, 1.0, 1.0])
    w1, b1 = np.array([[10.0, 20.0], [30.0, 40.0], [50.0, 60.0]]), np.array([2.0, 2.0, 2.0])
    counts = np.array([[10, 0, 5], [30, 20, 5]])
    w, b = average_last_layer([w0, torch.from_numpy(w1)], [b0, b1], counts)
    # class 0: shares 1/4, 3/4; class 1: 0, 1; class 2: 1/2, 1/2
    np.testing.assert_allclose(w, [[7.75, 15.5], [30.0, 40.0], [27.5, 33.0]])
    np.testing.assert_allclose(b, [1.75, 2.0, 1.5])


def test_average_last_layer_class_nobody_has_is_uniform():
    w, b = average_last_layer([np.ones((2, 1)), 3 * np.ones((2, 1))], [np.zeros(2), np.ones(2)],
                              np.array([[1, 0], [3, 0]]))
    np.testing.assert_allclose(w[:, 0], [2.5, 2.0])
    np.testing.assert_allclose(b, [0.75, 0.5])


# --- conv layers -------------------------------------------------------------------------------


def test_conv_neurons_round_trip():
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 4, 3)
    rows = neurons_of(conv.weight, conv.bias, "conv")
    assert rows.shape == (4, 3 * 3 * 3 + 1)
    for i in range(4):
        np.testing.assert_array_equal(rows[i, :-1], conv.weight[i].detach().numpy().ravel())
        assert rows[i, -1] == conv.bias[i].item()
    w, b = split_neurons(rows, (3, 3, 3), "conv")
    np.testing.assert_array_equal(w, conv.weight.detach().numpy())
    np.testing.assert_array_equal(b, conv.bias.detach().numpy())
    lin = nn.Linear(5, 2)
    w, b = split_neurons(neurons_of(lin.weight, lin.bias, "fc"), 5, "fc")
    np.testing.assert_array_equal(w, lin.weight.detach().numpy())
    with pytest.raises(ValueError):
        split_neurons(rows, (3, 3, 3), "fc")
    with pytest.raises(ValueError):
        split_neurons(rows, (3, 3, 2), "conv")


def test_permute_next_layer_conv_to_conv():
    rng = np.random.default_rng(0)
    nxt = rng.standard_normal((5, 4, 3, 3))
    assignment, global_size = [2, 0, 5, 3], 6
    got = permute_next_layer(nxt, assignment, global_size, "conv")
    # Explicit blocks of k·k on the flattened [out, C_in·k·k] matrix, as the official code does.
    flat, want = nxt.reshape(5, -1), np.zeros((5, global_size * 9))
    for i, g in enumerate(assignment):
        want[:, g * 9:(g + 1) * 9] = flat[:, i * 9:(i + 1) * 9]
    np.testing.assert_array_equal(got.reshape(5, -1), want)
    assert got.shape == (5, 6, 3, 3)
    np.testing.assert_array_equal(slice_next_layer(got, assignment, "conv"), nxt)


def test_permute_next_layer_conv_to_fc():
    rng = np.random.default_rng(1)
    spatial, assignment, global_size = 6, [1, 4, 0], 5
    nxt = rng.standard_normal((7, 3 * spatial))
    got = permute_next_layer(nxt, assignment, global_size, "conv_to_fc", spatial=spatial)
    want = np.zeros((7, global_size * spatial))
    for i, g in enumerate(assignment):
        for p in range(spatial):
            want[:, g * spatial + p] = nxt[:, i * spatial + p]
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(slice_next_layer(got, assignment, "conv_to_fc", spatial), nxt)
    with pytest.raises(ValueError):
        permute_next_layer(nxt, assignment, global_size, "conv_to_fc", spatial=4)


def test_conv_to_fc_keeps_the_function():
    """conv → ReLU → max-pool → flatten → FC: channels scattered into a wider global conv layer
    (unowned channels random) and the FC patched with blocks of H·W give the same outputs."""
    torch.manual_seed(3)
    conv, fc = nn.Conv2d(2, 4, 3).double(), nn.Linear(4 * 3 * 3, 5).double()
    x = torch.randn(6, 2, 8, 8, dtype=torch.float64)

    def net(c, f):
        return f(torch.flatten(torch.max_pool2d(torch.relu(c(x)), 2), 1))

    with torch.no_grad():
        reference = net(conv, fc).numpy()
        assignment, global_size = [5, 1, 3, 0], 7
        rows = torch.randn(global_size, 2 * 9 + 1, dtype=torch.float64).numpy()
        rows[assignment] = neurons_of(conv.weight, conv.bias, "conv")
        w, b = split_neurons(rows, (2, 3, 3), "conv")
        gconv, gfc = nn.Conv2d(2, global_size, 3).double(), nn.Linear(global_size * 9, 5).double()
        gconv.weight.copy_(torch.from_numpy(w))
        gconv.bias.copy_(torch.from_numpy(b))
        patched = permute_next_layer(fc.weight, assignment, global_size, "conv_to_fc", 9)
        gfc.weight.copy_(torch.from_numpy(patched))
        gfc.bias.copy_(fc.bias)
        np.testing.assert_allclose(net(gconv, gfc).numpy(), reference, rtol=1e-12, atol=1e-12)
        own = slice_to_client(gconv.weight, assignment)
        np.testing.assert_array_equal(own, conv.weight.numpy())


def test_bad_assignment_rejected():
    with pytest.raises(ValueError):
        permute_next_layer(np.ones((2, 3)), [0, 0, 1], 4)
    with pytest.raises(ValueError):
        permute_next_layer(np.ones((2, 3)), [0, 1, 4], 4)


# --- parameters --------------------------------------------------------------------------------


def test_params_defaults_and_registered_as_layerwise():
    from fedsim.registry import AGGREGATORS, PROTOCOLS

    p = FedMAParams()
    assert (p.sigma, p.sigma0, p.mu0, p.mu0_bias, p.gamma) == (1.0, 1.0, 0.0, 0.1, 7.0)
    assert (p.iterations, p.max_neurons, p.retrain_epochs, p.retrain_lr) == (5, 700, 20, 0.01)
    assert all(f.description for f in FedMAParams.model_fields.values())
    layers = permuted_clients(np.random.default_rng(0).standard_normal((3, 4)) * 10, 2, 0.0, 0)[1]
    assert bbp_map_match(layers, **p.match_kwargs()).global_size == 3
    entry = PROTOCOLS.get("fedma")  # a round protocol chosen by `aggregator: fedma`, not an [n, d] rule
    assert entry.params is FedMAParams and entry.traits.chosen_by == "aggregator" and not entry.traits.update_pipeline
    assert entry.load("exchange").__name__ == "FedMAExchange" and callable(entry.load("client_step"))
    assert "fedma" not in AGGREGATORS
