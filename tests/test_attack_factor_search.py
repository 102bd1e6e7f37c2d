"""ALIE and IPM tuned against the configured rule (ByzFL's "optimal" variants): the line search on
functions with a known maximum, the mean rule's closed form, a brute-force grid on the median, and
the pipeline giving the attack exactly the rule (weights, groups, random draws) the round then uses."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fedsim.attacks.byzantine import FactorSearch, line_maximize
from fedsim.models.layout import ModelLayout
from fedsim.registry import ATTACKS, AGGREGATORS
from fedsim.scenario import load_scenario
from fedsim.server.pipeline import RoundPipeline
from fedsim.updates import RoundContext, UpdateBatch

ROOT = Path(__file__).resolve().parents[1]


def attack(name: str, **params):
    entry = ATTACKS.get(name)
    return entry.obj(entry.spec_model()(name=name, **params))


def ctx(d: int, seed: int = 0) -> RoundContext:
    return RoundContext(1, torch.zeros(d), ModelLayout(names=("w",), shapes=((d,),)), torch.Generator().manual_seed(seed))


def honest_rows(h: int = 12, d: int = 40, seed: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return 0.5 + torch.randn(h, d, generator=g)


def test_line_search_finds_the_peak_of_a_concave_function():
    x, y = line_maximize(lambda v: -(v - 3.3) ** 2, FactorSearch())
    assert abs(x - 3.3) < 0.25 and y == pytest.approx(-(x - 3.3) ** 2)


def test_line_search_on_an_increasing_function_keeps_doubling_by_hand():
    tried = []
    x, _ = line_maximize(lambda v: tried.append(v) or v, FactorSearch(evals=6))
    assert tried == [0.0, 1.0, 3.0, 7.0, 15.0, 31.0] and x == 31.0  # start, then steps 1, 2, 4, 8, 16


def test_alie_search_against_the_mean_is_its_closed_form():
    """Under FedAvg the aggregate moves by m/n · z · ||σ||: strictly increasing in z, so the search
    returns the last expansion point and the distance it logs is the closed form there."""
    x = honest_rows()
    m, n = 3, x.shape[0] + 3
    a = attack("alie", search={"evals": 8})
    mean_rule = lambda mal: torch.cat([x, mal]).mean(dim=0)  # noqa: E731
    made = a.craft(x, m, ctx(x.shape[1]), rule=mean_rule)
    crafted, z = made.rows, made.log["z"]
    assert z == 2.0 ** 7 - 1
    sigma = x.double().std(dim=0)
    assert torch.allclose(crafted[0].double(), x.double().mean(0) + z * sigma, atol=1e-3)
    assert made.log["distance_from_honest_mean"] == pytest.approx(m / n * z * float(sigma.norm()), rel=1e-5)


@pytest.mark.parametrize("name, factor_key, craft_row", [
    ("alie", "z", lambda x, f: x.double().mean(0) + f * x.double().std(dim=0)),
    ("ipm", "epsilon", lambda x, f: -f * x.double().mean(0)),
])
def test_search_against_median_reaches_the_brute_force_best(name, factor_key, craft_row):
    """Coordinate-wise median moves towards the copies until they pass an honest order statistic: a
    monotone, saturating curve. The search must reach (within 1%) the best of a fine grid."""
    x, m = honest_rows(), 5
    median = AGGREGATORS.get("median").obj
    rule = lambda mal: median(torch.cat([x, mal]), torch.ones(x.shape[0] + m))  # noqa: E731
    mu = x.double().mean(0)
    grid = torch.linspace(0, 60, 601).tolist()
    best = max(float((rule(craft_row(x, f).float()[None].expand(m, -1)).double() - mu).norm()) for f in grid)
    a = attack(name, search={})
    log = a.craft(x, m, ctx(x.shape[1]), rule=rule).log
    assert log["distance_from_honest_mean"] >= 0.99 * best
    assert log[factor_key] >= 0


def test_without_search_the_paper_values_stand():
    x = honest_rows()
    a = attack("alie")
    assert "distance_from_honest_mean" not in a.craft(x, 3, ctx(x.shape[1])).log
    b = attack("ipm", epsilon=0.5)
    assert torch.allclose(b.craft(x, 2, ctx(x.shape[1])).rows[0], -0.5 * x.mean(0))
    with pytest.raises(ValueError, match="needs the server's rule"):
        attack("alie", search={}).craft(x, 3, ctx(x.shape[1]))  # outside the pipeline: no rule to search against


@pytest.mark.parametrize("aggregator", [
    "{name: bucketing, s: 2, inner: {name: krum, num_malicious: 1}}",  # random draws from ctx.generator
    "{name: trimmed_mean, beta: 0.2}",
])
def test_pipeline_gives_the_attack_the_rule_the_round_then_runs(aggregator):
    """Running the round with the searched z equals running it with that z fixed, bit for bit: the
    search saw the same weights and random draws (the generator is restored after each try)."""
    sc = load_scenario(str(ROOT / "scenarios/quickstart.yaml"), ["attack=null", f"aggregator={aggregator}", "defenses=[]"])
    x = honest_rows(h=10, d=30)
    rows = torch.cat([x, torch.zeros(3, 30)])
    batch = UpdateBatch(rows, torch.arange(1.0, 14.0), tuple(range(13)))
    strikers = {10, 11, 12}
    searched = RoundPipeline(sc, attack("alie", search={"evals": 10}))
    out = searched.run(batch, strikers, ctx(30, seed=5))
    z = out.attack["z"]
    fixed = RoundPipeline(sc, attack("alie", z=z)).run(batch, strikers, ctx(30, seed=5))
    assert torch.equal(out.aggregate, fixed.aggregate)
    honest_mean = x.double().mean(0)
    assert out.attack["distance_from_honest_mean"] == pytest.approx(float((out.aggregate.double() - honest_mean).norm()), rel=1e-5)
