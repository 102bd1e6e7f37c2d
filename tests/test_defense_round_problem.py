"""Each defense's `round_problem(n)` (fedsim/registry.py: Params) against what the defense does on n
updates in the round pipeline with fedavg: where it declares no problem, rounds of n random updates
run and give a finite aggregate; where it declares one, running it there fails or is degenerate, as
asserted per defense (a filter that keeps a blatant outlier, equal weights for sybils, every
coordinate reversed, ...). An asynchronous server (FedBuff, FedAsync: K = 1) runs the same pipeline
on each buffer of K updates, so these are the checks that refuse a defense for a buffer size."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from conftest import quick_scenario
from fedsim.models.layout import ModelLayout
from fedsim.registry import DEFENSES
from fedsim.server.pipeline import RoundPipeline
from fedsim.updates import RoundContext, UpdateBatch

NS = range(1, 7)
M = 6  # federation.clients_per_round: DP-FedAvg's expected m, at least every n tried


class NetTools:
    """Stands in for the server's tools (DeepSight builds models to probe): a 6-8-5 MLP from flat weights."""

    input_shape, num_classes = (6,), 5

    def __init__(self) -> None:
        self.layout = ModelLayout.of(self.build())

    @staticmethod
    def build() -> nn.Module:
        return nn.Sequential(nn.Flatten(), nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 5))

    def model_of(self, vec: torch.Tensor) -> nn.Module:
        model = self.build()
        self.layout.load_into(model, vec)
        return model


TOOLS = NetTools()
D = TOOLS.layout.dim

# every defense with its defaults, and variants whose parameters move the check
SPECS = [f"{{name: {name}}}" for name in DEFENSES.names()] + [
    "{name: norm_clipping, adaptive: true}",
    "{name: flame, min_cluster_size: 4}",
    "{name: freqfed, min_cluster_size: 4}",
    "{name: deepsight, min_cluster_size: 3}",
    "{name: fldetector, ban: false}",
    "{name: rlr, threshold: 0}",
    "{name: rlr, threshold: 2}",
    "{name: dp_fedavg, clipping: adaptive, clipped_count_stddev: 1.0}",
    "{name: alignins, lambda_s: 1.5, lambda_c: 1.5, clip: false}",
]


@functools.cache
def scenario(spec: str):
    return quick_scenario("aggregator=fedavg", f"defenses=[{spec}]",
                          federation={"num_clients": M, "clients_per_round": M, "rounds": 2, "local_epochs": 1})


def pipeline(spec: str) -> RoundPipeline:
    return RoundPipeline(scenario(spec))


def defense_spec(spec: str):
    return scenario(spec).defenses[0]


def context(rnd: int, global_weights: torch.Tensor, seed: int = 0) -> RoundContext:
    return RoundContext(rnd, global_weights, TOOLS.layout, torch.Generator().manual_seed(1000 * seed + rnd), tools=TOOLS)


def run_rounds(spec: str, rows_of, rounds: int, global_weights: torch.Tensor | None = None, seed: int = 0):
    """The pipeline's outcomes of `rounds` rounds, the rows of round r from rows_of(r) (clients 0..n-1,
    10 examples each); each aggregate moves the global model."""
    pipe = pipeline(spec)
    gw = torch.zeros(D) if global_weights is None else global_weights
    outs = []
    for rnd in range(1, rounds + 1):
        rows = rows_of(rnd)
        n = rows.shape[0]
        out = pipe.run(UpdateBatch(rows, torch.full((n,), 10.0), tuple(range(n))), set(), context(rnd, gw, seed))
        if out.aggregate is not None:
            gw = gw + out.aggregate
        outs.append(out)
    return outs


def random_rows(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return lambda rnd: 0.05 * torch.randn(n, D, generator=g)


def rounds_for(spec: str) -> int:
    return 14 if "fldetector" in spec else 3  # FLDetector scores once its window of 10 pairs is full


def name_of(spec: str) -> str:
    return spec.split(",")[0].removeprefix("{name:").strip(" }")


def problem(spec: str, n: int):
    return defense_spec(spec).round_problem(n)


# ------------------------------------------------------------------------------------ the property


# AlignIns removes an update whose MZ-score reaches λ in either metric, so on unstructured random rows
# (its two metrics independent) the clients central in one metric may all be outliers in the other
# and every update goes: the official code then returns a zero update, the pipeline skips the round.
# It happens at any n, more often the fewer the rows; the other rounds must run.
MAY_REMOVE_EVERY_UPDATE = {"alignins"}


@pytest.mark.parametrize("spec", SPECS)
def test_no_declared_problem_means_rounds_run(spec):
    for n in NS:
        if problem(spec, n) is not None:
            continue
        for seed in range(2):
            gw = 0.3 * torch.randn(D, generator=torch.Generator().manual_seed(seed))
            ran = 0
            for out in run_rounds(spec, random_rows(n, seed), rounds_for(spec), gw, seed):
                if name_of(spec) in MAY_REMOVE_EVERY_UPDATE and out.skipped is not None:
                    assert out.skipped == f"defense {name_of(spec)} removed every update", (spec, n, out.skipped)
                    continue
                assert out.skipped is None, (spec, n, out.skipped)
                assert out.aggregate.shape == (D,) and torch.isfinite(out.aggregate).all(), (spec, n)
                ran += 1
            assert ran, (spec, n, seed)


def test_the_declared_problems_at_default_parameters():
    declared = {name: [n for n in NS if problem(f"{{name: {name}}}", n)] for name in DEFENSES.names()}
    assert declared == {
        "alignins": [1, 2], "crfl": [], "deepsight": [1, 2], "dp_fedavg": [], "flame": [1, 2], "fldetector": [1, 2],
        "foolsgold": [1, 2], "freqfed": [1, 2], "norm_clipping": [], "rlr": [1, 2, 3], "weak_dp": [],
    }


def test_a_declared_problem_names_the_defense_the_parameter_and_n():
    for spec in SPECS:
        spec_obj = defense_spec(spec)
        for n in NS:
            found = spec_obj.round_problem(n)
            if found is None:
                continue
            param, reason, value = found
            assert reason.startswith(spec_obj.name) or reason.startswith(f"adaptive {spec_obj.name}"), reason
            assert f"n={n}" in reason
            if param:
                assert param in type(spec_obj).model_fields and getattr(spec_obj, param) == value
            else:
                assert value == n


# ----------------------------------------------------------- where a problem is declared, it is real


def alike_and_outlier(n: int, seed: int = 0) -> torch.Tensor:
    """n - 1 updates along one direction (small noise) and, last, one pointing the other way, 10x as long."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(D, generator=g)
    rows = [a + 0.05 * torch.randn(D, generator=g) for _ in range(n - 1)]
    return torch.stack([*rows, -10 * a])


def backdoor_rows(n: int, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """(global weights, rows): n - 1 honest updates (noise on every tensor) and, last, one raising
    output neuron 2 (its weight row and bias): few threshold exceedings, DeepSight's suspicious kind."""
    g = torch.Generator().manual_seed(seed)
    gw = 0.3 * torch.randn(D, generator=g)
    honest = 0.05 * torch.randn(n - 1, D, generator=g)
    bad = 0.005 * torch.randn(D, generator=g)
    w, b = TOOLS.layout.slice(TOOLS.layout.names[-2]), TOOLS.layout.slice(TOOLS.layout.names[-1])
    weight = bad[w].reshape(5, 8)
    weight[2] += 0.5
    bad[w] = weight.reshape(-1)
    bad[b.start + 2] += 0.5
    return gw, torch.cat([honest, bad[None]])


def one_round(spec: str, rows: torch.Tensor, gw: torch.Tensor | None = None):
    return run_rounds(spec, lambda rnd: rows, 1, gw)[0]


def degenerate_cluster_filter(spec: str, n: int) -> None:
    """FLAME, FreqFed: the blatant outlier is kept, nothing is removed."""
    out = one_round(spec, alike_and_outlier(n))
    info = out.defenses[name_of(spec)]
    assert out.skipped is None and info["removed"] == [] and out.aggregated == list(range(n))


def degenerate_deepsight(spec: str, n: int) -> None:
    """Kept or removed together: never the backdoor alone (n = 1: it is kept)."""
    gw, rows = backdoor_rows(n)
    out = one_round(spec, rows, gw)
    if out.skipped is not None:
        assert "removed every update" in out.skipped and n > 1
    else:
        assert out.defenses["deepsight"]["removed"] == [] and out.aggregated == list(range(n))


def degenerate_foolsgold(spec: str, n: int) -> None:
    """A sybil pair (n = 2) or a lone client: every weight the same."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(D, generator=g)
    rows = torch.stack([a, a + 1e-3 * torch.randn(D, generator=g)])[:n]
    out = one_round(spec, rows)
    assert out.skipped is None and len(set(out.weights.values())) == 1


def degenerate_fldetector(spec: str, n: int) -> None:
    """n = 1: never a detection; n = 2: one of the two detected in every round it scores."""
    outs = run_rounds(spec, random_rows(n, 0), 16)
    infos = [o.defenses["fldetector"] for o in outs if "scores" in o.defenses.get("fldetector", {})]
    assert infos  # the window filled
    if n == 1:
        assert all("detected" not in i and "removed" not in i for i in infos)
    else:
        assert all(len(i.get("detected", [])) == 1 for i in infos)


def degenerate_rlr(spec: str, n: int) -> None:
    """Every coordinate reversed: the aggregate is minus the clients' mean."""
    rows = random_rows(n, 0)(1)
    out = one_round(spec, rows)
    assert out.defenses["rlr"]["flipped_fraction"] == 1.0
    torch.testing.assert_close(out.aggregate, -rows.mean(dim=0))


def degenerate_norm_clipping(spec: str, n: int) -> None:
    """Adaptive δ is the one update's own norm: even a huge update is not clipped."""
    rows = 1000 * random_rows(n, 0)(1)
    out = one_round(spec, rows)
    assert out.defenses["norm_clipping"]["clipped"] == {}
    torch.testing.assert_close(out.aggregate, rows[0])


def degenerate_alignins(spec: str, n: int) -> None:
    """Never the outlier alone: a lone update is kept (its MZ-scores are 0); of two, both MZ-scores
    of each metric are equal, so both are kept or both removed (the round skipped)."""
    out = one_round(spec, alike_and_outlier(n))
    if out.skipped is not None:
        assert "removed every update" in out.skipped and n == 2
    else:
        assert out.defenses["alignins"]["removed"] == [] and out.aggregated == list(range(n))


DEGENERATE = {
    "alignins": degenerate_alignins,
    "flame": degenerate_cluster_filter, "freqfed": degenerate_cluster_filter, "deepsight": degenerate_deepsight,
    "foolsgold": degenerate_foolsgold, "fldetector": degenerate_fldetector, "rlr": degenerate_rlr,
    "norm_clipping": degenerate_norm_clipping,
}
DECLARED = [(spec, n) for spec in SPECS for n in NS if problem(spec, n) is not None]


def test_every_declared_problem_has_its_check():
    assert {name_of(spec) for spec, _ in DECLARED} <= set(DEGENERATE)


@pytest.mark.parametrize("spec,n", DECLARED)
def test_a_declared_problem_is_real(spec, n):
    DEGENERATE[name_of(spec)](spec, n)


# ------------------------------------------------- and the same inputs work where none is declared


@pytest.mark.parametrize("spec", ["{name: flame}", "{name: freqfed}"])
def test_cluster_filters_remove_the_outlier_from_three_updates_on(spec):
    for n in range(3, 7):
        out = one_round(spec, alike_and_outlier(n))  # FLAME may drop an honest one on the fringe as well
        assert n - 1 in out.defenses[name_of(spec)]["removed"] and out.aggregated, (spec, n)


def test_alignins_removes_the_outlier_alone_from_three_updates_on():
    for n in range(3, 7):
        out = one_round("{name: alignins}", alike_and_outlier(n))
        assert out.defenses["alignins"]["removed"] == [n - 1] and out.aggregated == list(range(n - 1)), n


def test_flame_with_min_cluster_size_below_n_removes_the_outlier():
    assert problem("{name: flame, min_cluster_size: 4}", 5) is None
    out = one_round("{name: flame, min_cluster_size: 4}", alike_and_outlier(5))
    assert 4 in out.defenses["flame"]["removed"]


def test_deepsight_can_remove_the_backdoor_alone_from_three_updates_on():
    for n in range(3, 7):  # not in every draw: a lone suspicious model may sit in an honest cluster
        removed = []
        for seed in (3, 4, 5):
            gw, rows = backdoor_rows(n, seed)
            removed.append(one_round("{name: deepsight}", rows, gw).defenses["deepsight"]["removed"])
        assert [n - 1] in removed, (n, removed)


def test_foolsgold_zeroes_a_sybil_pair_among_three():
    g = torch.Generator().manual_seed(0)
    a, other = torch.randn(D, generator=g), torch.randn(D, generator=g)
    out = one_round("{name: foolsgold}", torch.stack([a, a + 1e-3 * torch.randn(D, generator=g), other]))
    assert out.weights[0] == out.weights[1] == 0.0 and out.weights[2] > 0


def test_dp_fedavg_more_updates_than_its_expected_m_skip_the_round():
    """Not a `round_problem`: the bound is federation.clients_per_round (m), which the defense's
    parameters do not hold; within it (n <= m) any n runs (the property test, m = 6)."""
    sc = quick_scenario("aggregator=fedavg", "defenses=[{name: dp_fedavg}]",
                        federation={"num_clients": M, "clients_per_round": 3, "rounds": 2, "local_epochs": 1})
    out = RoundPipeline(sc).run(UpdateBatch(torch.randn(4, D), torch.ones(4), (0, 1, 2, 3)), set(), context(1, torch.zeros(D)))
    assert out.aggregate is None and "4 updates but only m=3" in out.skipped
