"""Karimireddy et al.'s mimic attack (#20), against independent oracles: a loop-by-loop port of the
official recurrence, the projection argmax client by client, an eigendecomposition, its state
through a pipeline checkpoint, and whole rounds on digits (in-process grid), a resumed run included."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import QUICKSTART, quick_scenario, round_context, run_local

from fedsim.attacks.fang import FangTrim, FangTrimParams
from fedsim.attacks.mimic import Mimic, MimicParams
from fedsim.registry import ATTACKS
from fedsim.runs.folder import RunFolder
from fedsim.scenario import ScenarioError, load_scenario
from fedsim.server.pipeline import RoundPipeline
from fedsim.updates import UpdateBatch


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
        out = attack.craft(x, 3, round_context(30, seed=100 + t)).rows
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
        crafted = attack.craft(x, 2, round_context(40, seed=t), honest_ids=ids)
    x, z, mu = rounds[-1].double(), attack.z.double(), attack.mu.double()
    brute = max(range(10), key=lambda i: float((x[i] - mu) @ z))  # argmax of ⟨x_i − μ, z⟩, client by client
    assert attack.target == ids[brute] and crafted.log["mimicked"] == ids[brute]

    # after the warm-up: the same client, wherever its row is, even where it is not extreme
    later = torch.randn(10, 40, generator=torch.Generator().manual_seed(7))
    shuffled = (29, 21, 20, 22, 23, 24, 25, 26, 27, 28)
    row = shuffled.index(attack.target)
    crafted = attack.craft(later, 3, round_context(40, seed=8), honest_ids=shuffled)
    assert torch.equal(crafted.rows, later[row].expand(3, -1)) and crafted.log["fallback"] is False
    # that client not sampled this round: this round's extreme along z stands in, the target stays
    absent = tuple(i for i in range(40, 50))
    crafted = attack.craft(later, 2, round_context(40, seed=9), honest_ids=absent)
    best = int(torch.argmax(later.double() @ attack.z.double()))
    assert torch.equal(crafted.rows[0], later[best]) and crafted.log["fallback"] is True and attack.target == ids[brute]


def test_mimic_direction_converges_to_the_top_principal_direction():
    rounds, v = spiky_rounds(40, 12, 30, seed=2, spread=6.0)
    attack = Mimic(MimicParams(warmup=40))
    for t, x in enumerate(rounds):
        attack.craft(x, 2, round_context(30, seed=t))
    pooled = torch.cat([r - r.mean(0) for r in rounds]).double()
    top = torch.linalg.eigh(pooled.T @ pooled).eigenvectors[:, -1]  # oracle: top eigenvector of the scatter
    z = attack.z.double()
    assert abs(float(z @ top)) > 0.999 and abs(float(z @ v.double())) > 0.99
    early = Mimic(MimicParams(warmup=1))
    early.craft(rounds[0], 2, round_context(30, seed=0))
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
        return pipe.run(batch, strikers, round_context(30, rnd=t + 1, seed=t))

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


def test_bad_parameters_name_their_field():
    with pytest.raises(ScenarioError) as err:
        load_scenario("scenarios/quickstart.yaml", ["attack={name: mimic, warmup: 0}"])
    assert "attack.mimic.warmup" in str(err.value)


class Killed(Exception):
    pass


def digits_run(parent, overrides, kill_after=None, run_dir=None):
    """The quickstart on digits with 10 clients, all in every round, in-process, with checkpoints;
    `kill_after` stops it as if the process died after that round's line; `run_dir` resumes one."""
    scenario = quick_scenario("federation.num_clients=10", "federation.clients_per_round=10",
                              "federation.local_epochs=1", *overrides, base=QUICKSTART)
    folder = RunFolder(run_dir) if run_dir is not None else RunFolder.create(scenario, parent)

    def progress(record):
        if kill_after is not None and record["round"] == kill_after:
            raise Killed

    try:
        return folder.path, run_local(scenario, folder, progress=progress, checkpoints=True, client_states=True).summary
    except Killed:
        return folder.path, None


def test_mimic_runs_whole_rounds_on_digits_and_copies_an_honest_client(tmp_path):
    from fedsim.runs.checkpoint import load_server
    from fedsim.runs.results import read_rounds

    run_dir, summary = digits_run(tmp_path, ["federation.rounds=2", "aggregator=median",
                                             "attack={name: mimic, num_attackers: 2, schedule: fixed_pool}"])
    rounds = read_rounds(run_dir)
    assert summary["rounds_completed"] == 2
    for r in rounds:
        assert r["skipped"] is None and len(r["attackers"]) == 2 and math.isfinite(r["main_accuracy"])
    state = load_server(run_dir, 2)["extra"]["pipeline"]["attack"]  # the client it copies: honest, by id
    assert state["t"] == 2 and state["target"] in set(range(10)) - set(rounds[-1]["attackers"])


def test_mimic_resumed_run_matches_uninterrupted(tmp_path):
    """`fedsim run --resume` after round 3 of 4: the mimic state (past its 2 warm-up rounds) is in
    the checkpoint and the resumed run's lines equal the uninterrupted run's."""
    from fedsim.runs.checkpoint import load_server
    from fedsim.runs.results import read_rounds
    from fedsim.server.record import without_times

    overrides = ["federation.rounds=4", "aggregator=median",
                 "attack={name: mimic, warmup: 2, num_attackers: 2, schedule: fixed_pool}"]
    full_dir, _ = digits_run(tmp_path / "full", overrides)
    cut_dir, summary = digits_run(tmp_path / "cut", overrides, kill_after=3)
    assert summary is None and max(r["round"] for r in read_rounds(cut_dir)) == 3
    state = load_server(cut_dir, 3)["extra"]["pipeline"]["attack"]
    assert state["t"] == 3 and state["target"] is not None and state["z"].shape == state["mu"].shape
    _, summary = digits_run(None, overrides, run_dir=cut_dir)
    assert summary["rounds_completed"] == 4
    assert without_times(read_rounds(cut_dir)) == without_times(read_rounds(full_dir))
