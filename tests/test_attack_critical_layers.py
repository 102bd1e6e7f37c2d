"""Backdoor-critical layers (Zhuang et al., ICLR 2024): the layer substitution analysis by hand and
against brute force, on a constructed model whose backdoor lives in two known layers, the LP / LF
uploads by hand, an attacker round (benign outside the BC layers, malicious on them), the
per-batch stamped copies, the YAML errors and short runs on digits through the in-process grid."""

from __future__ import annotations

import copy
import itertools

import numpy as np
import pytest
import torch
from conftest import quick_scenario, run_local

from fedsim.attacks.base import AttackerRound
from fedsim.attacks.critical_layers import (
    LOCAL_MALICIOUS, MEMORY_KEY, backward_substitution, craft, entry_of_coordinate, forward_substitution,
    layer_substitution_analysis, poisoned_loss, train_poisoned,
)
from fedsim.attacks.trigger import stamp, trigger_mask
from fedsim.models.layout import ModelLayout
from fedsim.runtime import Runtime
from fedsim.scenario import ScenarioError, load_scenario
from fedsim.seeding import derive_seed
from fedsim.training import TrainConfig, predict, train

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ATTACK = {"name": "critical_layers", "attacker_ids": [1], "size": 2, "target_class": 0}


def runtime(**attack) -> Runtime:
    return Runtime(quick_scenario(attack={**ATTACK, **attack}))


def trained_global(rt: Runtime, epochs: int = 5) -> torch.Tensor:
    """A global model that already learned digits (so the LSA's benign model starts near its target)."""
    model = rt.build_model()
    rt.layout.load_into(model, rt.initial_weights())
    train(model, rt.data.x_train, rt.data.y_train, TrainConfig(epochs, 32, 0.1), seed=1)
    return rt.layout.flatten_model(model)


def job_for(rt: Runtime, global_vec: torch.Tensor, memory=None) -> AttackerRound:
    model = rt.build_model()
    rt.layout.load_into(model, global_vec)
    return AttackerRound(rt, 1, 1, model, global_vec, rt.layout, TrainConfig(1, 32, 0.1), seed=7,
                         config={"server-round": 1}, memory={} if memory is None else memory)


# --------------------------------------------------------------------------- the substitution analysis
def additive_bsr(weights):
    """A BSR that adds weights[l] for each layer whose (one) coordinate holds the malicious value 1."""
    return lambda vec: float(sum(w for w, v in zip(weights, vec.tolist()) if v == 1.0))


def test_forward_and_backward_substitution_by_hand():
    layout = ModelLayout(names=("a", "b", "c", "d"), shapes=((1,), (1,), (1,), (1,)))
    owner = entry_of_coordinate(layout)
    benign, malicious = torch.zeros(4), torch.ones(4)
    bsr = additive_bsr([0.6, 0.0, 0.3, 0.1])  # layer a carries most of the backdoor, b none of it
    deltas = forward_substitution(benign, malicious, [0, 1, 2, 3], owner, bsr, 1.0)
    assert deltas == pytest.approx([-0.6, 0.0, -0.3, -0.1])
    assert backward_substitution(benign, malicious, [0, 1, 2, 3], deltas, owner, bsr, 0.85) == ([0, 2], pytest.approx(0.9))
    assert backward_substitution(benign, malicious, [0, 1, 2, 3], deltas, owner, bsr, 0.95)[0] == [0, 2, 3]
    assert backward_substitution(benign, malicious, [0, 1, 2, 3], deltas, owner, bsr, 0.5)[0] == [0]
    # never reached: all layers, in Δ order (ties by position, as heapq.nsmallest)
    assert backward_substitution(benign, malicious, [0, 1, 2, 3], deltas, owner, bsr, 1.5)[0] == [0, 2, 3, 1]
    # a malicious model without backdoor (τ·BSR_m = 0): no BC layer, as the official loop that never starts
    assert backward_substitution(benign, malicious, [0, 1, 2, 3], deltas, owner, bsr, 0.0) == ([], 0.0)


@pytest.mark.parametrize("seed", range(5))
def test_backward_substitution_is_the_shortest_prefix_that_reaches_tau_brute_force(seed):
    rng = np.random.default_rng(seed)
    n = 6
    weights = rng.dirichlet(np.ones(n)).tolist()
    layout = ModelLayout(names=tuple("abcdef"), shapes=((1,),) * n)
    owner = entry_of_coordinate(layout)
    bsr = additive_bsr(weights)
    tau = float(rng.uniform(0.3, 0.95))
    found = layer_substitution_analysis(torch.zeros(n), torch.ones(n), layout, bsr, tau)
    order = sorted(range(n), key=lambda i: (-weights[i], i))  # largest drop first
    brute = next(sorted(order[:k]) for k in range(1, n + 1) if sum(weights[i] for i in order[:k]) >= tau * sum(weights))
    assert found["layers"] == brute
    # and no set of fewer layers, in any order, reaches τ with the most critical layers missing
    k = len(brute)
    best_smaller = max((sum(weights[i] for i in c) for c in itertools.combinations(range(n), k - 1)), default=0.0)
    assert best_smaller < tau * sum(weights)


def planted(rt: Runtime, benign: torch.Tensor, target: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(benign, malicious) MLPs of `rt` where the backdoor is a trigger detector: hidden unit 0 reads
    only the trigger's pixels (layer 1.weight, entry 0) and sends its output to `target` (3.weight,
    entry 2). Every layer differs a little (noise), 3.bias a lot (a shift of every class's bias,
    which changes no prediction), 1.bias at unit 0 too (a threshold the trigger passes either way)."""
    names = rt.layout.names
    assert names == ("1.weight", "1.bias", "3.weight", "3.bias")
    b = {n: t.clone() for n, t in rt.layout.unflatten(benign.clone()).items()}
    b["1.weight"][0] = 0.0  # benign: unit 0 is dead
    b["1.bias"][0] = -1.0
    b["3.weight"][:, 0] = 0.0
    benign = rt.layout.flatten(b)
    g = torch.Generator().manual_seed(0)
    m = {n: t + 0.01 * torch.randn(t.shape, generator=g) for n, t in b.items()}
    mask = torch.from_numpy(trigger_mask((8, 8), "square", 2, "bottom_right")).reshape(-1)
    m["1.weight"][0] = torch.where(mask, 3.0, 0.0)
    m["1.bias"][0] = -6.0
    m["3.weight"][target, 0] = 20.0
    m["3.bias"] = m["3.bias"] + 5.0
    return benign, rt.layout.flatten(m)


@pytest.mark.parametrize("tau", [0.5, 0.8, 0.95])
def test_lsa_finds_the_two_layers_that_carry_a_planted_backdoor(tau):
    rt = runtime()
    benign, malicious = planted(rt, trained_global(rt), target=0)
    x, y = rt.data.x_test, rt.data.y_test
    stamped = stamp(x[y != 0], trigger_mask((8, 8), "square", 2, "bottom_right"), 1.0)
    scratch = rt.build_model()

    def bsr(vec):
        rt.layout.load_into(scratch, vec)
        return float((predict(scratch, stamped)[0] == 0).mean())

    assert bsr(benign) < 0.3 and bsr(malicious) > 0.99
    found = layer_substitution_analysis(benign, malicious, rt.layout, bsr, tau)
    assert found["layers"] == [0, 2]  # 1.weight and 3.weight; not 3.bias, the layer that changed most
    assert found["deltas"][0] < -0.7 and found["deltas"][2] < -0.7
    assert abs(found["deltas"][1]) < 0.05 and abs(found["deltas"][3]) < 0.05
    assert found["bsr_reached"] >= tau * found["bsr_malicious"]


# --------------------------------------------------------------------------- the uploads
def test_lp_and_lf_uploads_by_hand():
    layout = ModelLayout(names=("w", "b"), shapes=((2,), (1,)))
    owner = entry_of_coordinate(layout)
    g, b, m = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1.5, 1.0, 4.0]), torch.tensor([3.0, 6.0, -1.0])
    # LP, λ = 0.5 on the BC layer w: g + 0.5(m − g) + 0.5(b − g); b's own values elsewhere
    lp = craft(g, b, m, [0], owner, "lp", 0.5)
    assert torch.allclose(lp, torch.tensor([1 + 0.5 * 2 + 0.5 * 0.5, 2 + 0.5 * 4 + 0.5 * -1, 4.0]))
    # λ = 1: the malicious values; λ = 2: the malicious change doubled, no benign part
    assert torch.equal(craft(g, b, m, [0], owner, "lp", 1.0), torch.tensor([3.0, 6.0, 4.0]))
    assert torch.allclose(craft(g, b, m, [0, 1], owner, "lp", 2.0), g + 2 * (m - g))
    # LF: the malicious change reversed on the BC layers: 2g − m
    assert torch.equal(craft(g, b, m, [1], owner, "lf", 0.5), torch.tensor([1.5, 1.0, 2 * 3.0 - (-1.0)]))
    # no BC layer: the benign model
    assert torch.equal(craft(g, b, m, [], owner, "lp", 1.0), b)


def test_malicious_training_sees_each_batch_and_its_stamped_copy():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 3))
    mask = torch.from_numpy(trigger_mask((4, 4), "square", 2, "top_left"))
    x, y = torch.rand(5, 1, 4, 4), torch.tensor([0, 1, 2, 1, 0])
    loss = poisoned_loss(model, mask, torch.tensor(0.9), target=2)(x, y)
    stamped = x.clone()
    stamped[:, :, :2, :2] = 0.9
    expected = torch.nn.functional.cross_entropy(model(torch.cat([x, stamped])), torch.cat([y, torch.full((5,), 2)]))
    assert torch.allclose(loss, expected)


def test_an_attacker_round_is_benign_outside_the_critical_layers_and_malicious_on_them():
    rt = runtime()
    global_vec = trained_global(rt, epochs=3)
    job = job_for(rt, global_vec)
    x, y = rt.attack.training_set(rt, 1)
    found = rt.attack.identify(job_for(rt, global_vec), x, y)
    n, stats, _ = rt.attack.local_train(job)
    upload = rt.layout.flatten_model(job.model)

    # the two local models, trained again independently from the same global model and seeds
    benign_model, malicious_model = rt.build_model(), rt.build_model()
    rt.layout.load_into(benign_model, global_vec)
    rt.layout.load_into(malicious_model, global_vec)
    train(benign_model, x, y, job.train, job.seed)
    train_poisoned(malicious_model, x, y, job.train, derive_seed(job.seed, LOCAL_MALICIOUS),
                   trigger_mask((8, 8), "square", 2, "bottom_right"), rt.data.x_train.max(axis=(0, 2, 3)), 0)
    benign, malicious = rt.layout.flatten_model(benign_model), rt.layout.flatten_model(malicious_model)
    owner = entry_of_coordinate(rt.layout)
    critical = torch.isin(owner, torch.tensor(found["layers"], dtype=torch.long))

    assert n == len(x) and stats["samples"] == 3 * len(x) * job.train.epochs + found["lsa_samples"] > 0
    assert 0 < len(found["layers"]) and job.memory[MEMORY_KEY].tolist() == found["layers"]
    assert torch.equal(upload[~critical], benign[~critical])
    assert torch.allclose(upload[critical], malicious[critical], rtol=0, atol=1e-6)  # λ = 1: g + (m − g)
    assert not torch.equal(benign[critical], malicious[critical])

    rt.attack.params = rt.attack.params.model_copy(update={"variant": "lf"})
    job = job_for(rt, global_vec)
    rt.attack.local_train(job)
    flipped = rt.layout.flatten_model(job.model)
    assert torch.equal(flipped[~critical], benign[~critical])
    assert torch.allclose(flipped[critical], (2 * global_vec - malicious)[critical], atol=1e-6)


def test_an_untrainable_start_finds_no_layer_and_sends_the_benign_model():
    rt = runtime(lsa_max_epochs=0, lsa_min_accuracy=0.99, lsa_fallback_accuracy=0.9)  # a random model: no LSA
    job = job_for(rt, rt.initial_weights())
    found = rt.attack.identify(copy.copy(job), *rt.attack.training_set(rt, 1))
    assert found["layers"] == [] and found["skipped"]
    rt.attack.local_train(job)
    benign = rt.build_model()
    rt.layout.load_into(benign, rt.initial_weights())
    x, y = rt.attack.training_set(rt, 1)
    train(benign, x, y, job.train, job.seed)
    assert torch.equal(rt.layout.flatten_model(job.model), rt.layout.flatten_model(benign))
    assert job.memory[MEMORY_KEY].tolist() == []


# --------------------------------------------------------------------------- YAML and whole runs
@pytest.mark.parametrize("field,value", [("tau", 0), ("tau", 1.5), ("variant", "xx"), ("lambda_value", -1),
                                         ("lsa_fallback_accuracy", 0.95)])
def test_bad_parameters_name_their_field(field, value):
    with pytest.raises(ScenarioError, match=f"attack.critical_layers.*{field}"):
        load_scenario("scenarios/quickstart.yaml", [f"attack={{name: critical_layers, {field}: {value}}}"])


@pytest.mark.parametrize("variant", ["lp", "lf"])
def test_short_run_on_digits(tmp_path, variant):
    scenario = quick_scenario(attack={**ATTACK, "attacker_ids": None, "schedule": {"name": "every_round"},
                                      "variant": variant})
    rounds, summary, _ = run_local(scenario, tmp_path)
    assert [r["round"] for r in rounds] == [1, 2]
    assert all(len(r["attackers"]) == 1 for r in rounds)
    assert all(0.0 <= r["backdoor_success"] <= 1.0 for r in rounds)
    assert summary["attack"]["variant"] == variant and summary["attack"]["trigger_pixels"] == 4


def test_example_scenarios_validate():
    for name in ("critical_layers_digits", "poisonedfl_digits"):
        scenario = load_scenario(f"scenarios/attacks/{name}.yaml")
        assert scenario.attack is not None
