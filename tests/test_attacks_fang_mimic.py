"""Fang et al.'s Krum and trimmed-mean attacks and Karimireddy et al.'s mimic attack (#20), against
independent oracles: a brute-force Krum and λ bound in numpy, the paper's sampling intervals, a
loop-by-loop port of the official mimic recurrence, an eigendecomposition, and whole rounds on
digits (in-process grid), a resumed run included."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedsim.aggregators.coordinate import median, trimmed_mean
from fedsim.attacks.byzantine import ALIE, IPM, ALIEParams, IPMParams
from fedsim.attacks.fang import FangKrum, FangKrumParams, FangTrim, FangTrimParams
from fedsim.attacks.mimic import Mimic, MimicParams
from fedsim.models.layout import ModelLayout
from fedsim.registry import ATTACKS
from fedsim.scenario import ScenarioError, load_scenario
from fedsim.server.pipeline import RoundPipeline
from fedsim.updates import RoundContext, UpdateBatch


def make_ctx(d: int, seed: int = 0, rnd: int = 1) -> RoundContext:
    layout = ModelLayout(names=("w",), shapes=((d,),))
    return RoundContext(round=rnd, global_weights=torch.zeros(d), layout=layout, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------ numpy oracles


def np_krum_pick(rows: np.ndarray, f: int) -> int:
    """Blanchard et al.'s Krum by brute force: for each row, the sum of its n - f - 2 smallest squared
    distances to the other rows; the lowest score (first on ties)."""
    n = len(rows)
    scores = []
    for i in range(n):
        d2 = sorted(float(((rows[i] - rows[j]) ** 2).sum()) for j in range(n) if j != i)
        scores.append(sum(d2[: n - f - 2]))
    return int(np.argmin(scores))


def np_fang_bound(x: np.ndarray, c: int) -> float:
    """The paper's λ bound for Krum's f = c, written out with loops (model space with w_Re = 0)."""
    h, d = x.shape
    m = h + c
    sums = []
    for i in range(h):
        dist = sorted(float(np.linalg.norm(x[i] - x[j])) for j in range(h) if j != i)
        sums.append(sum(dist[: m - c - 2]))
    return min(sums) / ((m - 2 * c - 1) * math.sqrt(d)) + max(float(np.linalg.norm(x[i])) for i in range(h)) / math.sqrt(d)


def digits_updates(num_clients: int, seed: int = 0, steps: int = 3, lr: float = 0.5) -> torch.Tensor:
    """[num_clients, d] honest updates of a small MLP on scikit-learn's digits: IID shards of equal
    size, `steps` full-batch gradient steps from a common initial model, all clients at once."""
    from sklearn.datasets import load_digits
    from torch.func import functional_call, grad, vmap

    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(seed).permutation(len(y))
    per = len(y) // num_clients
    idx = order[: per * num_clients].reshape(num_clients, per)
    xs, ys = torch.tensor(x[idx] / 16.0, dtype=torch.float32), torch.tensor(y[idx])
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    start = {k: v.detach() for k, v in net.named_parameters()}

    def loss(params, xb, yb):
        return torch.nn.functional.cross_entropy(functional_call(net, params, (xb,)), yb)

    params = {k: v.expand(num_clients, *v.shape).clone() for k, v in start.items()}
    step = vmap(grad(loss))
    for _ in range(steps):
        g = step(params, xs, ys)
        params = {k: params[k] - lr * g[k] for k in params}
    return torch.cat([(params[k] - start[k]).reshape(num_clients, -1) for k in start], dim=1)


# ---------------------------------------------------------------------------------- fang_krum


def test_fang_krum_lambda_bound_matches_the_papers_formula():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(9, 40)) * rng.uniform(0.5, 2.0, size=(9, 1))
    from fedsim.aggregators.distances import pairwise_sq_distances
    from fedsim.attacks.fang import fang_lambda_bound

    xt = torch.from_numpy(x)
    for c in (1, 2, 3):
        got = fang_lambda_bound(pairwise_sq_distances(xt), torch.linalg.vector_norm(xt, dim=1), 9 + c, c, c, 40)
        assert got == pytest.approx(np_fang_bound(x, c), rel=1e-9)


def test_fang_krum_is_selected_by_krum_in_the_papers_setting():
    """100 clients of which c = 20 compromised, Krum with f = c (Fang et al.'s MNIST setting): the
    crafted update is Krum's pick, λ is the bound halved the fewest times that makes it so, and the
    other attackers sit within ε of the first."""
    updates = digits_updates(100)
    honest = updates[:80]
    attack = FangKrum(FangKrumParams())
    crafted = attack.craft(honest, 20, make_ctx(honest.shape[1], seed=5))
    mal, log = crafted.rows, crafted.log
    lam = log["lambda"]
    assert log["selected"] is True and mal.shape == (20, honest.shape[1]) and mal.dtype == honest.dtype

    x = honest.double().numpy()
    rows = np.concatenate([x, mal.double().numpy()])
    assert np_krum_pick(rows, 20) >= 80  # an oracle Krum picks an attacker

    s = np.sign(x.mean(axis=0))
    np.testing.assert_allclose(mal[0].double().numpy(), -lam * s, rtol=1e-6, atol=1e-9)
    offsets = np.linalg.norm(rows[81:] - rows[80], axis=1)
    assert (offsets <= 0.01 + 1e-6).all() and (offsets > 0).all()
    bound = np_fang_bound(x, 20)
    assert lam == pytest.approx(bound / 2 ** log["halvings"], rel=1e-9)
    if log["halvings"]:  # twice this λ (the previous try) was not picked: λ is the largest on the halving grid
        tried = rows.copy()
        tried[80:] = tried[80:] + (-lam * s)  # −2λs + the same offsets
        assert np_krum_pick(tried, 20) < 80


def test_fang_krum_with_exact_copies_and_an_explicit_krum_f():
    rng = np.random.default_rng(11)
    honest = torch.from_numpy((0.2 * rng.normal(size=(12, 50)) + 0.05).astype(np.float32))
    attack = FangKrum(FangKrumParams(epsilon=0.0, krum_f=3))
    crafted = attack.craft(honest, 3, make_ctx(50))
    mal = crafted.rows
    assert (mal == mal[0]).all() and crafted.log["selected"]
    assert np_krum_pick(np.concatenate([honest.double().numpy(), mal.double().numpy()]), 3) >= 12


def test_fang_krum_round_too_small_for_krum_ends_at_the_stop_threshold():
    honest = torch.randn(3, 20, generator=torch.Generator().manual_seed(0))
    attack = FangKrum(FangKrumParams(stop_threshold=1e-3))
    crafted = attack.craft(honest, 2, make_ctx(20))  # n = 5 < 2f + 3 = 7: Krum cannot score
    mal = crafted.rows
    assert crafted.log["selected"] is False and crafted.log["lambda"] < 1e-3
    assert torch.isfinite(mal).all()


# ---------------------------------------------------------------------------------- fang_trim


@pytest.mark.parametrize("b", [2.0, 3.5])
def test_fang_trim_values_lie_past_the_honest_range_opposite_the_honest_direction(b):
    g = torch.Generator().manual_seed(2)
    honest = torch.randn(10, 400, generator=g) + 0.5 * torch.randn(400, generator=g)
    honest[:, :5] = 0.0  # untouched parameters: s = 0, everyone sends 0
    attack = FangTrim(FangTrimParams(b=b))
    mal = attack.craft(honest, 4, make_ctx(400, seed=9)).rows.double()
    x = honest.double()
    s, lo, hi = torch.sign(x.mean(0)), x.min(0).values, x.max(0).values
    up, down = s > 0, s < 0
    assert (mal[:, up] <= lo[up]).all() and (mal[:, down] >= hi[down]).all()
    assert (mal[:, :5] == 0).all()
    # the paper's intervals: [min/b, min] or [b·min, min] on the min side, [max, b·max] or [max/b, max] on the max side
    lo_ok = torch.where(lo > 0, mal >= lo / b - 1e-12, mal >= b * lo - 1e-12)
    hi_ok = torch.where(hi > 0, mal <= b * hi + 1e-12, mal <= hi / b + 1e-12)
    assert lo_ok[:, up].all() and hi_ok[:, down].all()
    assert len(torch.unique(mal[:, up][:, 0])) == 4  # each attacker its own draw
    again = attack.craft(honest, 4, make_ctx(400, seed=9)).rows.double()
    other = attack.craft(honest, 4, make_ctx(400, seed=10)).rows.double()
    assert torch.equal(mal, again) and not torch.equal(mal, other)


def test_fang_trim_moves_median_and_trimmed_mean_further_than_alie_and_ipm():
    """Heterogeneous honest updates (spread as large as the mean), 16 honest and 4 attackers (20 %):
    the aggregate lands further from the honest mean under fang_trim than under ALIE (z_max) or
    IPM (ε = 0.1). Not a law: with many clients ALIE's z_max grows and its median shift matches
    Fang's; with a mean far larger than the spread, IPM's -0.1·μ is below every honest value and
    moves the median exactly as much as Fang's values do."""
    for seed in range(5):
        g = torch.Generator().manual_seed(seed)
        d = 300
        honest = torch.randn(d, generator=g) + torch.randn(16, d, generator=g)
        mean = honest.mean(0)
        shift = {}
        for name, attack in (("fang", FangTrim(FangTrimParams())), ("alie", ALIE(ALIEParams())), ("ipm", IPM(IPMParams(epsilon=0.1)))):
            rows = torch.cat([honest, attack.craft(honest, 4, make_ctx(d, seed)).rows])
            w = torch.ones(20)
            shift[name] = [float((median(rows, w) - mean).norm()), float((trimmed_mean(rows, w, num_trim=4) - mean).norm())]
        for rule in (0, 1):
            assert shift["fang"][rule] > 1.05 * max(shift["alie"][rule], shift["ipm"][rule]), (seed, rule, shift)


# -------------------------------------------------------------------------------------- mimic


def official_mimic(rounds: list[np.ndarray], z0: np.ndarray, warmup: int) -> tuple[np.ndarray, list[int]]:
    """The official code's MimicVariantAttacker, one worker at a time, in float64: (z, target per round)."""
    mu = z = None
    targets = []
    for t, grads in enumerate(rounds):
        avg = sum(grads) / len(grads)
        if t == 0:
            mu = avg
            cumu = sum(float((g - mu) @ z0) * (g - mu) for g in grads)
            z = cumu / np.linalg.norm(cumu)
        elif t < warmup:
            mu = t / (1 + t) * mu + avg / (1 + t)
            cumu = sum(float((g - mu) @ z) * (g - mu) for g in grads)
            z = t / (1 + t) * z + cumu / np.linalg.norm(cumu) / (1 + t)
            z = z / np.linalg.norm(z)
        if t < warmup:
            best = None
            for i, g in enumerate(grads):
                if best is None or g @ z > grads[best] @ z:
                    best = i
            targets.append(best)
        else:
            targets.append(targets[-1])
    return z, targets


def spiky_rounds(rounds: int, h: int, d: int, seed: int, spread: float = 3.0) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Honest updates with one dominant direction v (std `spread`) over unit isotropic noise."""
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(d, generator=g)
    v /= v.norm()
    base = torch.randn(d, generator=g)
    out = [base + spread * torch.randn(h, 1, generator=g) * v + torch.randn(h, d, generator=g) for _ in range(rounds)]
    return out, v


def test_mimic_follows_the_official_recurrence_and_choice():
    rounds, _ = spiky_rounds(6, 8, 30, seed=1)
    attack = Mimic(MimicParams(warmup=4))
    sent = []
    for t, x in enumerate(rounds):
        out = attack.craft(x, 3, make_ctx(30, seed=100 + t)).rows
        assert out.shape == (3, 30) and (out == out[0]).all()
        sent.append(int(torch.nonzero((x == out[0]).all(dim=1))[0]))
        if t == 3:
            z_after_warmup = attack.z.clone()
    z0 = torch.randn(30, generator=torch.Generator().manual_seed(100), dtype=torch.float32).double().numpy()
    z, targets = official_mimic([r.double().numpy() for r in rounds], z0, warmup=4)
    np.testing.assert_allclose(z_after_warmup.double().numpy(), z, atol=1e-5)
    assert sent == targets and targets[4] == targets[5] == targets[3]
    assert torch.equal(attack.z, z_after_warmup)  # z stays fixed after the warm-up


def test_mimic_chosen_client_maximises_the_projection_and_is_followed_by_id():
    rounds, _ = spiky_rounds(3, 10, 40, seed=4)
    attack = Mimic(MimicParams(warmup=3))
    ids = tuple(range(20, 30))
    for t, x in enumerate(rounds):
        crafted = attack.craft(x, 2, make_ctx(40, seed=t), honest_ids=ids)
    x, z, mu = rounds[-1].double(), attack.z.double(), attack.mu.double()
    brute = max(range(10), key=lambda i: float((x[i] - mu) @ z))  # argmax of ⟨x_i − μ, z⟩, client by client
    assert attack.target == ids[brute] and crafted.log["mimicked"] == ids[brute]

    # after the warm-up: the same client, wherever its row is, even where it is not extreme
    later = torch.randn(10, 40, generator=torch.Generator().manual_seed(7))
    shuffled = (29, 21, 20, 22, 23, 24, 25, 26, 27, 28)
    row = shuffled.index(attack.target)
    crafted = attack.craft(later, 3, make_ctx(40, seed=8), honest_ids=shuffled)
    assert torch.equal(crafted.rows, later[row].expand(3, -1)) and crafted.log["fallback"] is False
    # that client not sampled this round: this round's extreme along z stands in, the target stays
    absent = tuple(i for i in range(40, 50))
    crafted = attack.craft(later, 2, make_ctx(40, seed=9), honest_ids=absent)
    best = int(torch.argmax(later.double() @ attack.z.double()))
    assert torch.equal(crafted.rows[0], later[best]) and crafted.log["fallback"] is True and attack.target == ids[brute]


def test_mimic_direction_converges_to_the_top_principal_direction():
    rounds, v = spiky_rounds(40, 12, 30, seed=2, spread=6.0)
    attack = Mimic(MimicParams(warmup=40))
    for t, x in enumerate(rounds):
        attack.craft(x, 2, make_ctx(30, seed=t))
    pooled = torch.cat([r - r.mean(0) for r in rounds]).double()
    top = torch.linalg.eigh(pooled.T @ pooled).eigenvectors[:, -1]  # oracle: top eigenvector of the scatter
    z = attack.z.double()
    assert abs(float(z @ top)) > 0.999 and abs(float(z @ v.double())) > 0.99
    early = Mimic(MimicParams(warmup=1))
    early.craft(rounds[0], 2, make_ctx(30, seed=0))
    assert abs(float(early.z.double() @ top)) < abs(float(z @ top))  # the warm-up improves on one step


def test_mimic_state_survives_a_pipeline_checkpoint(tmp_path):
    """Save the pipeline's history after round 3, load it into a fresh pipeline, run rounds 4-6:
    the same updates and aggregates as six uninterrupted rounds; without the load they differ."""
    scenario = load_scenario("scenarios/quickstart.yaml", ["attack=null", "aggregator=median", "defenses=[]"])
    spec = ATTACKS.get("mimic").spec_model()(name="mimic", warmup=4, num_attackers=2)
    rounds, _ = spiky_rounds(6, 8, 30, seed=3)
    ids = tuple(range(10))
    strikers = {3, 7}

    def step(pipe, t):
        rows = torch.cat([rounds[t], torch.zeros(2, 30)])  # honest 0-2,4-6,8,9 and attackers 3, 7
        order = [0, 1, 2, 8, 3, 4, 5, 9, 6, 7]
        batch = UpdateBatch(rows[order], torch.ones(10), ids)
        return pipe.run(batch, strikers, make_ctx(30, seed=t, rnd=t + 1))

    full = RoundPipeline(scenario, ATTACKS.get("mimic").obj(spec))
    expected = [step(full, t).aggregate for t in range(6)]

    first = RoundPipeline(scenario, ATTACKS.get("mimic").obj(spec))
    for t in range(3):
        assert torch.equal(step(first, t).aggregate, expected[t])
    torch.save(first.history(), tmp_path / "history.pt")
    resumed = RoundPipeline(scenario, ATTACKS.get("mimic").obj(spec))
    resumed.load_history(torch.load(tmp_path / "history.pt", weights_only=True))
    assert [torch.equal(step(resumed, t).aggregate, expected[t]) for t in range(3, 6)] == [True] * 3

    cold = RoundPipeline(scenario, ATTACKS.get("mimic").obj(spec))
    assert not all(torch.equal(step(cold, t).aggregate, expected[t]) for t in range(3, 6))


def test_a_stateful_attack_gets_its_own_instance_per_pipeline():
    scenario = load_scenario("scenarios/quickstart.yaml", ["attack=null", "aggregator=median", "defenses=[]"])
    shared = Mimic(MimicParams())
    a, b = RoundPipeline(scenario, shared), RoundPipeline(scenario, shared)
    assert a.attack is not shared and b.attack is not a.attack and a.attack.params == shared.params
    stateless = FangTrim(FangTrimParams())
    assert RoundPipeline(scenario, stateless).attack is stateless


# --------------------------------------------------------------------------- YAML and rounds


@pytest.mark.parametrize("override,field", [
    ("attack={name: fang_trim, b: 0.5}", "attack.fang_trim.b"),
    ("attack={name: fang_krum, stop_threshold: 0}", "attack.fang_krum.stop_threshold"),
    ("attack={name: fang_krum, epsilon: -1}", "attack.fang_krum.epsilon"),
    ("attack={name: mimic, warmup: 0}", "attack.mimic.warmup"),
])
def test_bad_parameters_name_their_field(override, field):
    with pytest.raises(ScenarioError) as err:
        load_scenario("scenarios/quickstart.yaml", [override])
    assert field in str(err.value)


class Killed(Exception):
    pass


def grid_run(parent, overrides, kill_after=None, run_dir=None):
    """Run the quickstart on digits with 10 clients, all in every round, through the in-process grid
    with checkpoints; `kill_after` stops it as if the process died after that round's line."""
    from fedsim.client.app import make_client_app
    from fedsim.flower.local_grid import LocalGrid
    from fedsim.runs.folder import RunFolder
    from fedsim.server.app import run_server

    scenario = load_scenario("scenarios/quickstart.yaml", [
        "federation.num_clients=10", "federation.clients_per_round=10", "federation.local_epochs=1", *overrides])
    run_dir = run_dir or RunFolder.create(scenario, parent).path

    def progress(record):
        if kill_after is not None and record["round"] == kill_after:
            raise Killed

    grid = LocalGrid(make_client_app(scenario, RunFolder(run_dir).client_states), scenario.federation.num_clients)
    try:
        return run_dir, run_server(grid, scenario, run_dir, progress, checkpoints=True)
    except Killed:
        return run_dir, None


def test_fang_krum_is_picked_by_krum_every_round_on_digits(tmp_path):
    from fedsim.runs.results import read_rounds

    run_dir, summary = grid_run(tmp_path, ["federation.rounds=3", "aggregator={name: krum, num_malicious: 3}",
                                           "attack={name: fang_krum, num_attackers: 3, schedule: fixed_pool}"])
    rounds = read_rounds(run_dir)
    assert summary["rounds_completed"] == 3 and len(rounds) == 3
    for r in rounds:
        assert len(r["attackers"]) == 3 and r["aggregator"]["selected"][0] in r["attackers"]


@pytest.mark.parametrize("attack,rule", [("fang_trim", "{name: trimmed_mean, num_trim: 2}"), ("mimic", "median")])
def test_fang_trim_and_mimic_run_whole_rounds_on_digits(tmp_path, attack, rule):
    from fedsim.runs.results import read_rounds

    run_dir, summary = grid_run(tmp_path, ["federation.rounds=2", f"aggregator={rule}",
                                           f"attack={{name: {attack}, num_attackers: 2, schedule: fixed_pool}}"])
    from fedsim.runs.checkpoint import load_server

    rounds = read_rounds(run_dir)
    assert summary["rounds_completed"] == 2
    for r in rounds:
        assert r["skipped"] is None and len(r["attackers"]) == 2 and math.isfinite(r["main_accuracy"])
    if attack == "mimic":  # the client it copies is an honest one, named by its client id
        state = load_server(run_dir, 2)["extra"]["pipeline"]["attack"]
        assert state["t"] == 2 and state["target"] in set(range(10)) - set(rounds[-1]["attackers"])


def test_mimic_resumed_run_matches_uninterrupted(tmp_path):
    """`fedsim run --resume` after round 3 of 4: the mimic state (past its 2 warm-up rounds) is in
    the checkpoint and the resumed run's lines equal the uninterrupted run's."""
    from fedsim.runs.checkpoint import load_server
    from fedsim.runs.results import read_rounds
    from fedsim.server.record import without_times

    overrides = ["federation.rounds=4", "aggregator=median",
                 "attack={name: mimic, warmup: 2, num_attackers: 2, schedule: fixed_pool}"]
    full_dir, _ = grid_run(tmp_path / "full", overrides)
    cut_dir, summary = grid_run(tmp_path / "cut", overrides, kill_after=3)
    assert summary is None and max(r["round"] for r in read_rounds(cut_dir)) == 3
    state = load_server(cut_dir, 3)["extra"]["pipeline"]["attack"]
    assert state["t"] == 3 and state["target"] is not None and state["z"].shape == state["mu"].shape
    _, summary = grid_run(None, overrides, run_dir=cut_dir)
    assert summary["rounds_completed"] == 4
    assert without_times(read_rounds(cut_dir)) == without_times(read_rounds(full_dir))
