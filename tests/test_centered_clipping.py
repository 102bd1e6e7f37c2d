"""Centered clipping (aggregators/centered_clipping.py) against independent oracles: hand
computations, the plain-loop reference (update_samples.loop_centered_clip: float64, one row at a
time), and properties from the paper (an outlier's bounded pull, the previous aggregate as the
center). Its registry, schema and DETOX checks are with bucketing's and NNM's in
test_aggregators_mixing.py."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import QUICKSTART, quick_scenario, round_context, update_batch
from update_samples import close, loop_centered_clip, make_updates
from fedsim.aggregators.centered_clipping import centered_clip, centered_clipping
from fedsim.server.pipeline import RoundPipeline

HUGE_TAU = 1e30  # the schema refuses inf; this clips nothing


def scenario(*overrides: str):
    return quick_scenario("attack=null", "defenses=[]", *overrides, base=QUICKSTART)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_huge_tau_one_iteration_is_the_plain_unweighted_mean(seed):
    updates, weights = make_updates(9, 30, seed)
    mean = updates.double().mean(dim=0)
    close(centered_clipping(updates, weights, tau=HUGE_TAU, iterations=1, center="zero"), mean)
    # from any center, one unclipped step lands on the mean: v + mean(x - v) = mean(x)
    previous = torch.randn(30, generator=torch.Generator().manual_seed(seed + 10)) * 5
    close(centered_clipping(updates, weights, tau=HUGE_TAU, iterations=1, ctx=round_context(30, previous=previous)), mean)


def test_two_dimensional_example_by_hand():
    updates = torch.tensor([[3.0, 4.0], [0.0, 0.0], [0.0, 1.0]])
    ones = torch.ones(3)
    # from 0 with tau = 1: [3, 4] (norm 5) clips to [0.6, 0.8]; [0, 0] and [0, 1] stay
    v1 = torch.tensor([0.6 + 0.0 + 0.0, 0.8 + 0.0 + 1.0]) / 3  # [0.2, 0.6]
    close(centered_clipping(updates, ones, tau=1.0, iterations=1, center="zero"), v1)
    # second iteration from [0.2, 0.6]: [2.8, 3.4] has norm sqrt(19.4) and clips; [-0.2, -0.6] and [-0.2, 0.4] stay
    r = math.sqrt(19.4)
    v2 = v1 + torch.tensor([2.8 / r - 0.2 - 0.2, 3.4 / r - 0.6 + 0.4]) / 3
    close(centered_clipping(updates, ones, tau=1.0, iterations=2, center="zero"), v2)
    # from last round's [3, 4]: [0, 0]; [-3, -4] clips to [-0.6, -0.8]; [-3, -3] clips to -[1, 1]/sqrt(2)
    ctx = round_context(2, previous=torch.tensor([3.0, 4.0]))
    expected = torch.tensor([3.0, 4.0]) + torch.tensor([-0.6 - 1 / math.sqrt(2), -0.8 - 1 / math.sqrt(2)]) / 3
    close(centered_clipping(updates, ones, tau=1.0, iterations=1, ctx=ctx), expected)


@pytest.mark.parametrize("n,iterations,tau", [(7, 1, 0.5), (10, 3, 2.0), (15, 5, 1.0)])
def test_matches_the_loop_reference(n, iterations, tau):
    updates, weights = make_updates(n, 40, seed=n)
    previous = updates[0] * 0.5
    out = centered_clipping(updates, weights, tau=tau, iterations=iterations, ctx=round_context(40, previous=previous))
    close(out, loop_centered_clip(updates, previous, tau, iterations))


@pytest.mark.parametrize("iterations", [1, 3, 5])
@pytest.mark.parametrize("magnitude", [1e3, 1e12, 1e30])
def test_one_outlier_pulls_at_most_tau_over_n_per_iteration(iterations, magnitude):
    honest, weights = make_updates(9, 20, seed=5)
    honest = honest * 0.1
    direction = torch.randn(20, generator=torch.Generator().manual_seed(6))
    direction = direction / torch.linalg.vector_norm(direction)
    updates = torch.cat([honest, (magnitude * direction)[None]])
    n, tau = 10, 0.5
    out = centered_clipping(updates, torch.cat([weights, torch.tensor([1e6])]), tau=tau, iterations=iterations, center="zero")
    # the same iteration with the outlier's term left out (it still counts in 1/n): the honest
    # part is non-expansive, so each iteration adds at most the outlier's own tau / n
    without = loop_centered_clip(updates, torch.zeros(20), tau, iterations, skip={9})
    assert float(torch.linalg.vector_norm(out.double() - without)) <= iterations * tau / n * (1 + 1e-5)
    if iterations == 1:  # the outlier's pull is exactly tau / n along its direction, however far it is
        close(out.double() - without, direction.double() * tau / n)


def test_non_finite_update_adds_nothing_and_a_huge_finite_one_is_clipped_exactly():
    updates, weights = make_updates(8, 12, seed=3)
    updates[2, 4] = float("nan")
    updates[5] = float("inf")
    updates[6] = 3e38  # finite, but its norm does not fit in float32
    out = centered_clipping(updates, weights, tau=1.0, iterations=3, center="zero")
    assert torch.isfinite(out).all()
    close(out, loop_centered_clip(updates, torch.zeros(12), 1.0, 3, skip={2, 5}))


def test_center_previous_comes_from_the_context_and_zero_ignores_it():
    updates, weights = make_updates(6, 10, seed=4)
    previous = torch.full((10,), 2.0)
    from_zero = centered_clip(updates, torch.zeros(10), 1.0, 1)
    assert torch.equal(centered_clipping(updates, weights, tau=1.0), from_zero)  # no context: zeros
    assert torch.equal(centered_clipping(updates, weights, tau=1.0, ctx=round_context(10)), from_zero)  # first round
    assert torch.equal(centered_clipping(updates, weights, tau=1.0, center="zero", ctx=round_context(10, previous=previous)),
                       from_zero)
    close(centered_clipping(updates, weights, tau=1.0, ctx=round_context(10, previous=previous)),
          loop_centered_clip(updates, previous, 1.0, 1))
    with pytest.raises(ValueError, match="previous aggregate has shape"):
        centered_clipping(updates, weights, ctx=round_context(10, previous=torch.zeros(9)))


def test_weights_are_ignored():
    updates, weights = make_updates(7, 10, seed=8)
    assert torch.equal(centered_clipping(updates, weights, tau=0.3, iterations=2, center="zero"),
                       centered_clipping(updates, torch.ones(7), tau=0.3, iterations=2, center="zero"))



def test_pipeline_centers_each_round_on_the_previous_aggregate():
    pipe = RoundPipeline(scenario("aggregator={name: centered_clipping, tau: 0.5, iterations: 2}"))
    first, _ = make_updates(10, 6, seed=9)
    second, _ = make_updates(10, 6, seed=10)
    out1 = pipe.run(update_batch(first), set(), round_context(6, rnd=1))
    close(out1.aggregate, loop_centered_clip(first, torch.zeros(6), 0.5, 2))
    out2 = pipe.run(update_batch(second), set(), round_context(6, rnd=2))
    close(out2.aggregate, loop_centered_clip(second, out1.aggregate, 0.5, 2))
