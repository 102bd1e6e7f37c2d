"""The federation clock (fedsim/clock/, fedsim/server/clocked.py): each time component against a hand
computation, the round policies against their definitions, availability, AdaComm's rule, stored
simulated times (the same on any machine), and what the schema and a deployment refuse."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from conftest import quick_scenario, run_local
from fedsim.clock.adacomm import AdaCommPeriod
from fedsim.clock.clock import FederationClock
from fedsim.clock.config import AdaComm, Deadline, OverSelection, SystemsSection, WaitForAll
from fedsim.clock.cost import train_flops_per_sample
from fedsim.clock.profiles import draw_profiles
from fedsim.scenario import ScenarioError, validate_scenario
from fedsim.server.record import without_times

ONE_NETWORK = [{"name": "slow", "share": 1, "down_mbps": 8.0, "up_mbps": 2.0, "latency_ms": 50.0, "spread": 0.0}]
ONE_DEVICE = [{"name": "phone", "share": 1, "gflops": 0.004, "spread": 0.0}]


def systems(**fields) -> SystemsSection:
    return SystemsSection(**fields)


# --- each time component, by hand ------------------------------------------------------------
def test_client_time_is_bytes_over_bandwidth_plus_latency_and_work_over_speed():
    clock = FederationClock(systems(devices=ONE_DEVICE, networks=ONE_NETWORK), 3, [], seed=0)
    t = clock.client_time(1, bytes_down=10_000, samples=300, flops_per_sample=20_000.0, bytes_up=5_000)
    assert t.down == pytest.approx(10_000 * 8 / 8e6 + 0.050)  # 10 ms + 50 ms
    assert t.compute == pytest.approx(300 * 20_000 / 4e6)  # 1.5 s at 4 MFLOP/s
    assert t.up == pytest.approx(5_000 * 8 / 2e6 + 0.050)  # 20 ms + 50 ms
    assert t.total == pytest.approx(t.down + t.compute + t.up)


def test_jitter_scales_a_client_rounds_times_by_its_seeded_factor():
    sy = systems(devices=ONE_DEVICE, networks=ONE_NETWORK, jitter=0.5)
    clock = FederationClock(sy, 1000, [], seed=0)
    base = FederationClock(systems(devices=ONE_DEVICE, networks=ONE_NETWORK), 1000, [], seed=0)
    t, t0 = clock.client_time(7, 10_000, 300, 2e4, 5_000, rnd=3), base.client_time(7, 10_000, 300, 2e4, 5_000, rnd=3)
    factor = clock.slowdown(3)[7]
    assert (t.down, t.compute, t.up) == pytest.approx((t0.down * factor, t0.compute * factor, t0.up * factor))
    assert np.std(np.log(clock.slowdown(3))) == pytest.approx(0.5, rel=0.1)
    assert not np.array_equal(clock.slowdown(3), clock.slowdown(4))  # drawn anew each round


def test_training_flops_are_counted_matrix_products_forward_and_backward():
    """Two linear layers a->b->c: forward 2ab + 2bc per sample; backward the weight gradients
    (2ab + 2bc) and the input gradient of the second layer only (2bc): the data needs none."""
    a, b, c = 7, 5, 3
    model = torch.nn.Sequential(torch.nn.Linear(a, b), torch.nn.ReLU(), torch.nn.Linear(b, c))
    x = np.random.default_rng(0).standard_normal((4, a)).astype(np.float32)
    assert train_flops_per_sample(model, x) == 2 * a * b * 2 + 2 * b * c * 3
    assert all(p.grad is None for p in model.parameters())  # leaves the model as it was


def test_profiles_are_the_class_medians_times_a_lognormal_spread():
    sy = systems(devices=[{"name": "d", "share": 1, "gflops": 10.0, "spread": 0.5}],
                 networks=[{"name": "n", "share": 1, "down_mbps": 40, "up_mbps": 10, "latency_ms": 30, "spread": 0.0}])
    prof = draw_profiles(sy, 20_000, [], seed=3)
    assert np.median(prof.gflops) == pytest.approx(10.0, rel=0.03)
    assert np.std(np.log(prof.gflops)) == pytest.approx(0.5, rel=0.03)
    assert np.all(prof.up_bps == 10e6) and np.all(prof.down_bps == 40e6) and np.all(prof.latency_s == 0.030)


def test_attackers_get_the_fastest_classes_medians():
    prof = draw_profiles(systems(), 50, [3, 7], seed=0)
    assert prof.gflops[3] == prof.gflops[7] == 20.0  # high_end's median
    assert prof.up_bps[3] == 45.74e6 and prof.down_bps[7] == 85.73e6  # wifi's


# --- availability ----------------------------------------------------------------------------
def test_diurnal_window_in_each_clients_local_time():
    sy = systems(availability={"diurnal": {"start_hour": 22, "hours": 8, "timezones": 24}}, start_hour=0)
    clock = FederationClock(sy, 500, [], seed=1)
    mask = clock.checked_in(1)  # 00:00 at time zone 0: local hour = the client's offset
    expected = np.isin(clock.profiles.timezone, [22, 23, 0, 1, 2, 3, 4, 5])
    assert np.array_equal(mask, expected) and 0 < mask.sum() < 500
    clock.close_round(1, 11 * 3600.0, 0.0)  # round 2 starts at 11:00: the window moved 11 zones
    assert np.array_equal(clock.checked_in(2), np.isin(clock.profiles.timezone, [(h - 11) % 24 for h in (22, 23, 0, 1, 2, 3, 4, 5)]))


def test_offline_and_dropout_draws_spare_always_on_attackers():
    sy = systems(availability={"offline": 0.3, "dropout": 0.2})
    clock = FederationClock(sy, 10_000, [5], seed=0)
    mask = clock.checked_in(4)
    assert mask[5] and (1 - mask.mean()) == pytest.approx(0.3, abs=0.02)
    gone = clock.dropouts(4, list(range(10_000)))
    assert 5 not in gone and len(gone) / 9_999 == pytest.approx(0.2, abs=0.02)
    assert gone == clock.dropouts(4, list(range(10_000)))  # seeded by the round


# --- the round policies ------------------------------------------------------------------------
def test_policies_close_where_their_definitions_say():
    finish = [3.0, 1.0, 7.0, 2.0, 5.0]
    assert WaitForAll().close(finish, 3) == 7.0
    assert Deadline(seconds=4.0).close(finish, 3) == 4.0 and Deadline(seconds=9.0).close(finish, 3) == 7.0
    assert OverSelection().close(finish, 3) == 3.0  # the third report closes the round
    assert OverSelection(deadline=2.5).close(finish, 3) == 2.5
    assert OverSelection().selected(10) == 13 and OverSelection(factor=1.25).selected(4) == 5


def _clocked(tmp_path, policy, **availability):
    sc = quick_scenario(
        "federation.num_clients=12", "federation.clients_per_round=4", "federation.rounds=3",
        systems={"devices": [{"name": "d", "share": 1, "gflops": 0.02, "spread": 1.0}],
                 "networks": [{"name": "n", "share": 1, "down_mbps": 1, "up_mbps": 0.5, "latency_ms": 20, "spread": 1.0}],
                 "round": policy, "availability": availability})
    return run_local(sc, tmp_path, nodes=12)


def test_over_selection_drops_exactly_the_clients_finishing_after_the_close(tmp_path):
    rounds = [r for r in _clocked(tmp_path, {"name": "over_selection", "factor": 1.5}).rounds if r["round"] > 0]
    for r in rounds:
        assert len(r["sampled"]) == 6  # ⌈1.5 · 4⌉ selected
        finish = {int(p): sum(t) for p, t in r["client_seconds"].items()}
        close = sorted(finish.values())[3]  # the fourth report
        assert sorted(r["stragglers"]) == sorted(p for p, f in finish.items() if f > close + 1e-5)
        assert sorted(r["aggregated"]) == sorted(p for p, f in finish.items() if f <= close + 1e-5)
        assert len(r["aggregated"]) == 4 and not r["rejected"]  # late is not a failure
        assert r["sim_seconds"] == pytest.approx(close, abs=1e-5)  # server_seconds: 0
        assert r["bytes_up"] == sum(r["bytes_up_per_client"][str(p)] for p in r["aggregated"])
    times = [r["sim_time"] for r in rounds]
    assert times == sorted(times) and rounds[1]["sim_start"] == pytest.approx(rounds[0]["sim_time"])


def test_deadline_discards_late_clients_and_dropouts_are_not_failures(tmp_path):
    rounds = [r for r in _clocked(tmp_path, {"name": "deadline", "seconds": 0.3}, dropout=0.3).rounds if r["round"] > 0]
    assert any(r["stragglers"] for r in rounds) and any(r["dropped_out"] for r in rounds)
    for r in rounds:
        finish = {int(p): sum(t) for p, t in r["client_seconds"].items()}
        assert sorted(r["stragglers"]) == sorted(p for p, f in finish.items() if f > 0.3)
        assert not set(r["dropped_out"]) & set(map(int, r["client_seconds"]))  # never messaged
        assert not r["rejected"] and r["sim_seconds"] <= 0.3 + 1e-9


def test_a_round_nobody_can_join_lasts_idle_seconds_and_the_window_then_opens(tmp_path):
    """One time zone, a window from 02:00 to 04:00, the clock starting at midnight: rounds 1 and 2
    find nobody checked in (skipped, an hour each), round 3 starts at 02:00 and trains."""
    sc = quick_scenario("federation.rounds=3", systems={
        "availability": {"diurnal": {"start_hour": 2, "hours": 2, "timezones": 1}}, "idle_seconds": 3600})
    rounds = [r for r in run_local(sc, tmp_path, nodes=6).rounds if r["round"] > 0]
    assert [r["unavailable"] for r in rounds] == [6, 6, 0]
    assert [r["unavailable_clients"] for r in rounds] == [list(range(6)), list(range(6)), []]
    assert [r["sim_start"] for r in rounds] == [0.0, 3600.0, 7200.0]
    assert rounds[0]["skipped"] and rounds[1]["skipped"] and not rounds[2]["skipped"]
    assert rounds[2]["sim_time"] > 7200.0 and rounds[2]["aggregated"]


# The same scenario and seed give these simulated times on any machine: bytes are serialized
# records, samples are counted, FLOPs are counted, and every draw is seeded.
STORED_SIM_TIMES = [0.442997, 0.685404, 1.033626]


def test_simulated_times_are_reproducible_and_match_stored_values(tmp_path):
    first = _clocked(tmp_path / "a", {"name": "over_selection", "factor": 1.5}, dropout=0.2, offline=0.2).rounds
    again = _clocked(tmp_path / "b", {"name": "over_selection", "factor": 1.5}, dropout=0.2, offline=0.2).rounds
    assert without_times(first) == without_times(again)
    times = [r["sim_time"] for r in first if r["round"] > 0]
    assert times == pytest.approx(STORED_SIM_TIMES, rel=1e-6)


def test_a_scenario_without_systems_has_no_clock_fields(tmp_path):
    rounds = run_local(quick_scenario(), tmp_path, nodes=6).rounds
    clock_fields = {"sim_start", "sim_seconds", "sim_time", "stragglers", "dropped_out", "unavailable", "client_seconds"}
    assert not any(clock_fields & set(r) for r in rounds)


# --- AdaComm -----------------------------------------------------------------------------------
def test_adacomm_period_follows_the_square_root_of_the_loss_ratio():
    rule = AdaCommPeriod(AdaComm(tau0=20, interval=100.0))
    assert rule.period(0.0, None, 0.1) == 20  # before any loss: τ0
    assert rule.period(30.0, 2.0, 0.1) == 20  # F_0 = 2.0; the first interval is still running
    assert rule.period(99.0, 0.5, 0.1) == 20
    assert rule.period(100.0, 0.5, 0.1) == math.ceil(math.sqrt(0.5 / 2.0) * 20) == 10
    assert rule.period(150.0, 0.02, 0.1) == 10  # re-evaluated once per interval only
    assert rule.period(200.0, 0.02, 0.1) == 2
    assert rule.interval_start == 200.0  # intervals start at multiples of T0
    assert rule.period(330.0, 0.08, 0.1) == 4 and rule.interval_start == 300.0  # not at 330
    coupled = AdaCommPeriod(AdaComm(tau0=16, interval=10.0, lr_coupled=True))
    coupled.period(0.0, 1.0, 0.1)
    assert coupled.period(10.0, 0.25, 0.025) == 16  # sqrt(η_0 F_l / (η_l F_0)) = sqrt(4 · 1/4) = 1


def test_adacomm_sets_each_rounds_local_steps(tmp_path):
    sc = quick_scenario("federation.rounds=4", systems={"adacomm": {"tau0": 3, "interval": 1e-9}})
    rounds = [r for r in run_local(sc, tmp_path, nodes=6).rounds if r["round"] > 0]
    f0 = rounds[0]["start_loss"]  # F(x_0): round 1's clients' loss at the initial model
    assert f0 == pytest.approx(math.log(10), rel=0.1)  # an untrained 10-class model: about ln 10
    expected = [3, 3] + [math.ceil(math.sqrt(r["start_loss"] / f0) * 3 - 1e-9) for r in rounds[1:-1]]
    assert [r["local_steps"] for r in rounds] == expected
    assert rounds[-1]["start_loss"] < f0
    # a client's compute time is proportional to the samples of its τ steps of full batches
    seconds = {int(p): t[1] for p, t in rounds[0]["client_seconds"].items()}
    per_sample = {p: s / (3 * 32) for p, s in seconds.items()}
    assert all(v > 0 for v in per_sample.values())


# --- what is refused -----------------------------------------------------------------------------
@pytest.mark.parametrize("systems_raw, field, words", [
    ({"round": "fastest"}, "systems.round", "wait_for_all"),
    ({"round": {"name": "deadline", "seconds": -1}}, "systems.round.deadline.seconds", "greater than 0"),
    ({"server_seconds": "sometimes"}, "systems.server_seconds", "measured"),
    ({"devices": [{"name": "a", "share": 1, "gflops": 1}, {"name": "a", "share": 1, "gflops": 2}]}, "systems", "more than once"),
    ({"round": {"name": "over_selection", "factor": 5}}, "systems.round.factor", "num_clients"),
])
def test_a_wrong_systems_section_names_the_field(systems_raw, field, words):
    with pytest.raises(ScenarioError) as err:
        validate_scenario({"federation": {"num_clients": 20, "clients_per_round": 10}, "systems": systems_raw})
    text = str(err.value)
    assert field in text and words in text, text


def test_adacomm_with_fixed_local_steps_and_clock_with_secure_aggregation_are_refused():
    with pytest.raises(ScenarioError, match="drop federation.local_steps"):
        validate_scenario({"federation": {"local_steps": 5}, "systems": {"adacomm": {"tau0": 4, "interval": 10}}})
    with pytest.raises(ScenarioError, match="two round protocols"):
        validate_scenario({"systems": {}, "secure_aggregation": "secaggplus"})


def test_a_deployment_refuses_the_systems_section():
    from fedsim.deploy.run_config import deployable

    with pytest.raises(ScenarioError, match="real clock"):
        deployable(quick_scenario(systems={}), "x.yaml")
    assert deployable(quick_scenario(), "x.yaml") is not None
