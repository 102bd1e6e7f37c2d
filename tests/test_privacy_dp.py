"""Differential privacy against independent oracles: opacus' published accountant values, closed
forms of the Gaussian mechanism, Flower's own DP functions on the same inputs, hand computations."""

from __future__ import annotations

import io
import json
import math

import numpy as np
import pytest
import torch
from scipy.optimize import brentq
from scipy.stats import kstest, norm

from conftest import QUICKSTART, quick_scenario, round_context, run_local, update_batch
from fedsim.aggregators.fedavg import fedavg
from fedsim.defenses.dp_fedavg import DPFedAvg, DPFedAvgParams, adaptive_noise_params, next_clip_norm, noise_std
from fedsim.privacy.accountant import PrivacyAccountant, default_delta, gaussian_epsilon
from fedsim.privacy.local import LOCAL_DP, LocalPrivacyLedger, local_epsilon, privatize, privatize_release
from fedsim.runs.results import central_privacy, local_privacy, summarize
from fedsim.scenario import LocalDPSection, ScenarioError, dump_scenario, validate_scenario
from fedsim.seeding import torch_generator
from fedsim.server.pipeline import RoundPipeline
from fedsim.updates import RoundContext, UpdateBatch

OPACUS_ORDERS = [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64))  # RDPAccountant.DEFAULT_ALPHAS


def ctx(d: int, rnd: int = 1, seed: int = 0) -> RoundContext:
    """The shared round context, on a layout of a weight vector and a one-value bias."""
    return round_context(d, rnd, seed, bias=True)


def batch(rows, weights=None) -> UpdateBatch:
    """The shared update batch: client ids from 100, example counts 7, 14, 21, ... unless given."""
    n = len(rows)
    return update_batch(rows, range(100, 100 + n), torch.arange(1, n + 1, dtype=torch.float32) * 7 if weights is None else weights)


class Fed:  # the two numbers of the federation section the defense reads
    def __init__(self, num_clients: int, clients_per_round: int) -> None:
        self.num_clients, self.clients_per_round = num_clients, clients_per_round


def one_round(defense: DPFedAvg, b: UpdateBatch, c: RoundContext) -> tuple[torch.Tensor, dict]:
    """before -> the rule (fedavg, as validation requires) -> after, as the pipeline runs them."""
    out, log = defense.before(b, c)
    agg, info = defense.after(fedavg(out.updates, out.weights), c)
    return agg, {**log, **info}


def scenario(**over):
    return quick_scenario(base={}, federation={"num_clients": 20, "clients_per_round": 5, "rounds": 2},
                          defenses=[{"name": "dp_fedavg", **over}])


# ------------------------------------------------------------------------------------- accountant


def test_rdp_epsilon_is_opacus_published_value():
    # opacus tests/accountants_test.py: z = 1.5, q = 0.04, 90 epochs of steps, δ = 1e-5 -> ε = 7.32911117143
    acc = PrivacyAccountant("rdp")
    for _ in range(int(90 / 0.04)):
        acc.step(1.5, 0.04)
    assert acc.steps == 2250
    assert acc.epsilon(1e-5) == pytest.approx(7.32911117143, abs=1e-9)


def test_prv_epsilon_is_within_its_error_of_opacus_published_value():
    # same test file: the PRV accountant gives 6.777395712150674; its estimate is an upper bound within eps_error 0.01
    eps = gaussian_epsilon(1.5, 0.04, 2250, 1e-5, "prv")
    assert abs(eps - 6.777395712150674) < 0.01
    assert eps < gaussian_epsilon(1.5, 0.04, 2250, 1e-5, "rdp")


def test_defense_reports_the_published_epsilon_after_resuming_the_accountant():
    d = DPFedAvg(DPFedAvgParams(noise_multiplier=1.5, sample_rate=0.04, delta=1e-5), Fed(100, 4))
    d.load_state_dict({"clip_norm": torch.tensor(1.0, dtype=torch.float64),
                       "history": torch.tensor([[1.5, 0.04, 2249]], dtype=torch.float64)})
    _, info = one_round(d, batch(np.ones((4, 6))), ctx(6))
    assert info["rounds"] == 2250 and info["epsilon"] == pytest.approx(7.32911117143, abs=1e-9)


def rdp_closed_form_epsilon(z: float, steps: int, delta: float) -> float:
    """Gaussian mechanism without sampling: RDP α·steps/(2z²), converted as Balle et al. 2020 Thm 21."""
    a = np.array(OPACUS_ORDERS)
    eps = steps * a / (2 * z * z) - (np.log(delta) + np.log(a)) / (a - 1) + np.log((a - 1) / a)
    return float(eps.min())


def exact_gaussian_epsilon(mu: float, delta: float) -> float:
    """The exact ε of a Gaussian mechanism with sensitivity/std = mu (Balle & Wang 2018)."""
    def gap(eps):
        return norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * norm.cdf(-eps / mu - mu / 2) - delta
    return brentq(gap, 0.0, 500.0)


@pytest.mark.parametrize("z,steps", [(1.0, 1), (2.0, 10), (4.0, 30)])
def test_unsampled_epsilon_matches_closed_form_and_bounds_the_exact_one(z, steps):
    eps = gaussian_epsilon(z, 1.0, steps, 1e-5)
    assert eps == pytest.approx(rdp_closed_form_epsilon(z, steps, 1e-5), rel=1e-12)
    exact = exact_gaussian_epsilon(math.sqrt(steps) / z, 1e-5)  # k Gaussians at z compose to one at z/√k
    assert exact <= eps <= 1.6 * exact


def test_accountant_edges_and_default_delta():
    acc = PrivacyAccountant()
    assert acc.epsilon(1e-5) == 0.0
    acc.step(0.0, 0.5)
    assert acc.epsilon(1e-5) == math.inf
    with pytest.raises(ValueError):
        acc.step(1.0, 0.0)
    with pytest.raises(ValueError):
        acc.epsilon(0.0)
    assert [default_delta(n) for n in (1, 9, 10, 20, 100, 3383)] == [0.1, 0.1, 0.01, 0.01, 0.001, 0.0001]
    assert all(default_delta(n) < 1 / n for n in (2, 10, 99, 100, 101, 10**6))


# ------------------------------------------------------------------------------ DP-FedAvg, fixed


def test_no_noise_and_a_large_clip_is_fedavg_with_equal_weights_bit_for_bit():
    g = torch.Generator().manual_seed(3)
    u = torch.randn(5, 40, generator=g)
    b = batch(u)  # unequal example counts: DP-FedAvg ignores them
    agg, info = one_round(DPFedAvg(DPFedAvgParams(noise_multiplier=0.0, clip_norm=1e6), Fed(20, 5)), b, ctx(40))
    assert torch.equal(agg, fedavg(u, torch.ones(5)))
    torch.testing.assert_close(agg, u.mean(0), rtol=0, atol=1e-6)  # the rule's (w/Σw)·U, not torch.mean's summation
    assert info["clipped"] == {} and info["noise_std"] == 0.0 and info["epsilon"] == math.inf


def test_no_noise_in_the_pipeline_equals_plain_fedavg_when_weights_are_equal():
    raw = {"federation": {"num_clients": 10, "clients_per_round": 4}}
    plain = RoundPipeline(validate_scenario(raw))
    dp = RoundPipeline(validate_scenario({**raw, "defenses": [{"name": "dp_fedavg", "noise_multiplier": 0, "clip_norm": 1e6}]}))
    u = torch.randn(4, 30, generator=torch.Generator().manual_seed(4))
    b = batch(u, weights=[5.0] * 4)
    a, o = plain.run(b, set(), ctx(30)), dp.run(b, set(), ctx(30))
    assert torch.equal(a.aggregate, o.aggregate)
    assert o.defenses["dp_fedavg"]["sample_rate"] == 0.4 and o.defenses["dp_fedavg"]["delta"] == 0.01


def test_fixed_clipping_and_noise_std_equal_flowers_functions():
    from flwr.supercore.differential_privacy import clip_inputs_inplace, compute_stdv

    g = torch.Generator().manual_seed(5)
    u = torch.randn(6, 33, generator=g) * torch.tensor([0.1, 0.5, 1.0, 2.0, 5.0, 40.0])[:, None]
    d = DPFedAvg(DPFedAvgParams(noise_multiplier=1.3, clip_norm=1.7), Fed(60, 6))
    out, log = d.before(batch(u), ctx(33))
    for row, mine in zip(u.numpy(), out.updates.numpy()):
        layers = [row[:20].copy(), row[20:].copy()]  # Flower clips a list of layers by their joint norm
        clip_inputs_inplace(layers, 1.7)
        np.testing.assert_allclose(mine, np.concatenate(layers), rtol=1e-6, atol=1e-7)
    assert torch.equal(out.weights, torch.ones(6))
    _, info = d.after(fedavg(out.updates, out.weights), ctx(33))
    assert info["noise_std"] == compute_stdv(1.3, 1.7, 6) == noise_std(1.3, 1.7, 6)
    assert set(log["clipped"]) == {i + 100 for i in range(6) if float(u[i].norm()) > 1.7}


def test_noise_is_the_round_generators_gaussian_times_z_s_over_m():
    d = DPFedAvg(DPFedAvgParams(noise_multiplier=1.0, clip_norm=2.0), Fed(100, 10))
    dim = 200_000
    b = batch(np.zeros((10, dim)))
    d.before(b, ctx(dim, seed=9))
    noisy, info = d.after(torch.zeros(dim), ctx(dim, seed=9))
    expected = torch.randn(dim, generator=torch.Generator().manual_seed(9)) * 0.2  # the same draw, fed by hand
    assert info["noise_std"] == 0.2 and torch.equal(noisy, expected)
    assert kstest(noisy.numpy() / 0.2, "norm").pvalue > 1e-3


def test_missing_updates_keep_the_denominator_m():
    d = DPFedAvg(DPFedAvgParams(noise_multiplier=0.0, clip_norm=1e6), Fed(40, 8))
    u = torch.randn(3, 10, generator=torch.Generator().manual_seed(6))  # 3 of 8 sampled clients replied
    agg, info = one_round(d, batch(u), ctx(10))
    torch.testing.assert_close(agg, u.sum(0) / 8, rtol=1e-6, atol=1e-7)
    assert info["expected_clients"] == 8


# --------------------------------------------------------------------------- DP-FedAvg, adaptive


def test_adaptive_round_equals_flowers_formulas_on_the_same_noise():
    from flwr.serverapp.strategy import DifferentialPrivacyServerSideAdaptiveClipping, FedAvg
    from flwr.supercore.differential_privacy import compute_stdv

    z, m, S, sb = 0.8, 5, 2.5, 1.0
    flower = DifferentialPrivacyServerSideAdaptiveClipping(FedAvg(), noise_multiplier=z, num_sampled_clients=m,
                                                           initial_clipping_norm=S, target_clipped_quantile=0.4,
                                                           clip_norm_lr=0.3, clipped_count_stddev=sb)
    params = DPFedAvgParams(clipping="adaptive", noise_multiplier=z, clip_norm=S, target_quantile=0.4, clip_norm_lr=0.3,
                            clipped_count_stddev=sb)
    d = DPFedAvg(params, Fed(50, m))
    rows = np.zeros((5, 4))
    rows[:, 0] = [0.5, 1.0, 2.5, 3.0, 4.0]  # 3 updates fit under S = 2.5 (the norm equal to S is not clipped)
    c = ctx(4, seed=11)
    count_noise = float(torch.randn((), generator=torch.Generator().manual_seed(11), dtype=torch.float64))
    _, info = one_round(d, batch(rows), c)
    assert info["unclipped"] == 3
    assert (info["clipped_count_stddev"], info["update_noise_multiplier"]) == (flower.clipped_count_stddev, flower.noise_multiplier)
    # the paper's b̃ is the noisy *unclipped* fraction; Flower's strategy feeds its rule the clipped one (see below)
    flower._geometric_update((3 + sb * count_noise) / m)
    assert info["next_clip_norm"] == flower.clipping_norm == d.clip_norm
    assert info["noise_std"] == compute_stdv(flower.noise_multiplier, S, m)  # the S the updates were clipped to


def test_adaptive_noise_params_refuse_like_flower():
    from flwr.supercore.differential_privacy import compute_adaptive_noise_params

    for args in [(1.0, 100, None), (0.5, 10, 2.0), (0.0, 10, None)]:
        assert adaptive_noise_params(*args) == compute_adaptive_noise_params(*args)
    for args in [(1.0, 10, None), (2.0, 100, 1.0)]:
        with pytest.raises(ValueError):
            compute_adaptive_noise_params(*args)
        with pytest.raises(ValueError):
            adaptive_noise_params(*args)


def test_adaptive_clip_norm_converges_to_the_target_quantile():
    norms = np.arange(1.0, 11.0)  # γ = 0.5: between the 5th and 6th norm
    S = 1.0
    for _ in range(200):
        S = next_clip_norm(S, float((norms <= S).mean()), 0.5, 0.2)
    assert 5.0 * 0.9 <= S <= 6.0 * 1.1


def test_flower_server_side_adaptive_clipping_moves_the_wrong_way():
    """Why fedsim does not call Flower's strategy: it counts clipped updates in the paper's rule, so S
    collapses while most updates are clipped (flwr 1.41). If this fails, Flower changed: re-read it."""
    from flwr.serverapp.strategy import DifferentialPrivacyServerSideAdaptiveClipping, FedAvg
    from flwr.supercore.differential_privacy import adaptive_clip_inputs_inplace

    s = DifferentialPrivacyServerSideAdaptiveClipping(FedAvg(), noise_multiplier=0.0, num_sampled_clients=10,
                                                      initial_clipping_norm=1.0)
    for _ in range(40):
        s._geometric_update(sum(adaptive_clip_inputs_inplace([np.array([float(v)])], s.clipping_norm) for v in range(1, 11)) / 10)
    assert s.clipping_norm < 0.1


# ------------------------------------------------------------------------------ checkpoint/resume


def test_state_round_trip_gives_the_same_rounds_epsilon_and_clip():
    params = DPFedAvgParams(clipping="adaptive", noise_multiplier=0.5, clip_norm=0.3, clipped_count_stddev=1.0, accountant="rdp")
    g = torch.Generator().manual_seed(8)
    rounds = [batch(torch.randn(6, 12, generator=g)) for _ in range(4)]
    whole = DPFedAvg(params, Fed(30, 6))
    straight = [one_round(whole, b, ctx(12, rnd=r + 1, seed=r)) for r, b in enumerate(rounds)]
    first = DPFedAvg(params, Fed(30, 6))
    for r, b in enumerate(rounds[:2]):
        one_round(first, b, ctx(12, rnd=r + 1, seed=r))
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    buf.seek(0)
    resumed = DPFedAvg(params, Fed(30, 6))
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    for r, b in enumerate(rounds[2:], start=2):
        agg, info = one_round(resumed, b, ctx(12, rnd=r + 1, seed=r))
        assert torch.equal(agg, straight[r][0]) and info == straight[r][1]
    assert straight[-1][1]["rounds"] == 4 and straight[-1][1]["clip_norm"] != 0.3


# ------------------------------------------------------------------------------------ validation


def test_scenario_refuses_what_would_void_the_epsilon():
    with pytest.raises(ScenarioError, match="aggregator"):
        validate_scenario({"aggregator": "median", "defenses": ["dp_fedavg"]})
    with pytest.raises(ScenarioError, match="last defense"):
        validate_scenario({"defenses": ["dp_fedavg", "foolsgold"]})
    with pytest.raises(ScenarioError, match="clipped_count_stddev"):  # m = 5: default σ_b = 0.25 < z/2
        scenario(clipping="adaptive", noise_multiplier=1.0)
    with pytest.raises(ScenarioError, match="only apply with clipping: adaptive"):
        scenario(target_quantile=0.7)
    for ok in (scenario(), scenario(clipping="adaptive", noise_multiplier=1.0, clipped_count_stddev=1.0)):
        assert load_scenario_text(dump_scenario(ok)) == ok  # the resolved file (every default written) loads back: resume


def load_scenario_text(text: str):
    import yaml

    return validate_scenario(yaml.safe_load(text))


def test_local_dp_is_refused_where_per_client_noise_cannot_work():
    fed = {"num_clients": 12, "clients_per_round": 9, "local_dp": {"clip": 1.0, "noise_multiplier": 1.0}}
    with pytest.raises(ScenarioError, match="redundant group"):
        validate_scenario({"federation": fed, "aggregator": {"name": "detox", "group_size": 3, "inner": "median"}})
    with pytest.raises(ScenarioError, match="client protocol"):
        validate_scenario({"federation": fed, "aggregator": "fedma"})
    validate_scenario({"federation": fed, "aggregator": {"name": "detox", "group_size": 3, "inner": "median", "redundancy": False}})
    with pytest.raises(ScenarioError, match="noise_multiplier"):
        validate_scenario({"federation": {"local_dp": {"clip": 1.0}}})


def test_pipeline_gives_the_defense_the_federation():
    pipe = RoundPipeline(scenario(delta=1e-6))
    d = dict(pipe.defenses)["dp_fedavg"]
    assert (d.expected, d.sample_rate, d.delta) == (5, 0.25, 1e-6)
    d = dict(RoundPipeline(scenario(sample_rate=0.01)).defenses)["dp_fedavg"]
    assert (d.sample_rate, d.delta) == (0.01, 0.01)


# ------------------------------------------------------------------------------------- local DP


def test_privatize_by_hand():
    g = torch.Generator().manual_seed(2)
    u = torch.tensor([3.0, 4.0, 0.0])  # norm 5
    assert torch.allclose(privatize(u, 1.0, 0.0, g), torch.tensor([0.6, 0.8, 0.0]))
    small = torch.tensor([0.1, -0.2, 0.2])  # norm 0.3 < clip: kept as it is
    out = privatize(small, 1.0, 0.5, torch.Generator().manual_seed(2))
    assert torch.equal(out, small + torch.randn(3, generator=torch.Generator().manual_seed(2)) * 0.5)
    with pytest.raises(ValueError):
        privatize(u, 0.0, 1.0, g)


def test_privatize_release_is_seeded_per_client_and_round():
    s = LocalDPSection(clip=1.0, noise_multiplier=1.0)
    u = torch.ones(50)
    assert privatize_release(u, None, 0, 1, 3) is u
    a, b = privatize_release(u, s, 0, 1, 3), privatize_release(u, s, 0, 1, 3)
    assert torch.equal(a, b)
    assert not torch.equal(a, privatize_release(u, s, 0, 1, 4)) and not torch.equal(a, privatize_release(u, s, 0, 2, 3))
    assert torch.equal(a, privatize(u, 1.0, 1.0, torch_generator(0, LOCAL_DP, 1, 3)))


def test_local_epsilon_is_the_gaussian_mechanism_at_sensitivity_two_c():
    # k releases, noise z·C, sensitivity 2C: RDP α·k·4/(2z²), i.e. multiplier z/2, no sampling
    for z, k in [(2.0, 1), (4.0, 5), (8.0, 20)]:
        assert local_epsilon(z, k, 1e-4) == pytest.approx(rdp_closed_form_epsilon(z / 2, k, 1e-4), rel=1e-12)
    assert local_epsilon(1.0, 0, 1e-4) == 0.0 and local_epsilon(0.0, 3, 1e-4) == math.inf


def test_ledger_reports_the_most_sampled_client():
    ledger = LocalPrivacyLedger(LocalDPSection(clip=0.5, noise_multiplier=4.0), num_clients=50)
    for sampled in ([1, 2, 3], [2, 3], [3, 4]):
        ledger.count(sampled)
    rep = ledger.report()
    assert rep["releases"] == 3 and rep["delta"] == 0.01 and rep["clip"] == 0.5
    assert rep["epsilon"] == local_epsilon(4.0, 3, 0.01)


# --------------------------------------------------------------------------------------- summary


def test_summary_privacy_entries():
    sc = validate_scenario({"federation": {"num_clients": 10, "clients_per_round": 2,
                                           "local_dp": {"clip": 1.0, "noise_multiplier": 2.0}},
                            "defenses": ["dp_fedavg"]})
    dp = {"epsilon": 1.5, "delta": 0.01, "accountant": "rdp", "rounds": 1, "clip_norm": 1.0}
    rounds = [{"round": 0, "sampled": []},
              {"round": 1, "sampled": [0, 1], "defenses": {"dp_fedavg": dp}},
              {"round": 2, "sampled": [1, 2], "defenses": {}, "skipped": "no updates"}]
    s = summarize(sc, rounds, {})
    assert s["privacy"] == {"epsilon": 1.5, "delta": 0.01, "accountant": "rdp", "rounds": 1, "defense": "dp_fedavg"}
    assert s["local_privacy"]["releases"] == 2 and s["local_privacy"]["epsilon"] == local_epsilon(2.0, 2, 0.01)
    assert central_privacy([{"round": 1, "defenses": {"weak_dp": {"noise_std": 0.1}}}]) is None
    assert local_privacy(validate_scenario({}), rounds) is None
    assert "privacy" not in summarize(validate_scenario({}), rounds[:1], {})


def short_run(tmp_path, rounds: int, *overrides: str):
    """A 6-client digits run in-process: its run folder and trained round lines."""
    from fedsim.runs.folder import RunFolder

    sc = quick_scenario(
        "federation.num_clients=6", "federation.clients_per_round=3", f"federation.rounds={rounds}",
        "federation.local_epochs=1", "attack=null", *overrides, base=QUICKSTART)
    run = run_local(sc, tmp_path, nodes=6)
    return RunFolder(run.path), [r for r in run.rounds if r["round"] > 0]


def test_a_short_run_records_epsilon_each_round_and_in_the_summary(tmp_path):
    run, lines = short_run(tmp_path, 2, "defenses=[{name: dp_fedavg, noise_multiplier: 1.0, clip_norm: 0.5}]")
    eps = [r["defenses"]["dp_fedavg"]["epsilon"] for r in lines]
    assert eps == [gaussian_epsilon(1.0, 0.5, k, 0.1) for k in (1, 2)]
    summary = json.loads(run.summary_file.read_text())
    assert summary["privacy"] == {"epsilon": eps[-1], "delta": 0.1, "accountant": "rdp", "rounds": 2, "defense": "dp_fedavg"}


def test_local_dp_noises_honest_uploads_and_each_round_line_counts_the_releases(tmp_path):
    """With federation.local_dp every honest upload is clipped and noised on the client (its norm is
    about z·C·sqrt(d)), and each round's `local_privacy` is the most-sampled client's ε so far,
    recounted by hand from the lines' `sampled` lists."""
    from collections import Counter

    _, lines = short_run(tmp_path, 3, "federation.local_dp={clip: 1.0, noise_multiplier: 1.0}")
    d = lines[0]["model_params"]
    counts = Counter()
    for line in lines:
        counts.update(line["sampled"])
        most = max(counts.values())
        assert line["local_privacy"]["releases"] == most
        assert line["local_privacy"]["epsilon"] == pytest.approx(local_epsilon(1.0, most, line["local_privacy"]["delta"]))
        assert 0.8 * d ** 0.5 < line["honest_update_norm_median"] < 1.2 * d ** 0.5  # the noise dominates: ~ z·C·sqrt(d)
