"""A3FL (issue #20): the trigger search against the global model and its adapted copies, the
poisoned training set, the attacker's memory across rounds, its report to the server, and a short
whole run on digits through the in-process grid.

Oracles: one signed-gradient step recomputed with autograd on the official multiplicative stamping
δ·m + (1 − m)·x; the `trigger` attack's own poisoned set and test set (an A3FL trigger that is not
optimised is a plain `trigger` patch); `fedsim.training.evaluate` for the backdoor loss; numpy for
the cosine similarity; the server's checkpoint for what the whole run measured.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn
from conftest import quick_scenario

from fedsim.attacks.a3fl import (
    SEARCH, A3FL, A3FLParams, adapted_model, mean_cosine, patch_mask, search_trigger, similarity_layers,
)
from fedsim.attacks.base import AttackerRound
from fedsim.attacks.trigger import TriggerBackdoor, TriggerParams, choose_poisoned, stamp
from fedsim.client.app import make_client_app
from fedsim.flower.local_grid import LocalGrid
from fedsim.models.nets import LeNet
from fedsim.runs.checkpoint import load_server
from fedsim.runs.folder import RunFolder
from fedsim.runs.results import read_rounds
from fedsim.runtime import Runtime
from fedsim.scenario import ScenarioError
from fedsim.seeding import derive_seed
from fedsim.server.app import run_server
from fedsim.training import TrainConfig, evaluate, predict, train

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py: why

PID = 1  # the attacker's partition in the unit tests


def scenario(attack: dict, seed: int = 0, **federation):
    fed = {"num_clients": 8, "clients_per_round": 4, "rounds": 3, "local_epochs": 1, "batch_size": 16, "lr": 0.1,
           "momentum": 0.9}
    return quick_scenario(
        name="a3fl", seed=seed, data={"dataset": "digits", "partition": "iid"}, model={"name": "mlp", "hidden": [32]},
        federation={**fed, **federation}, attack={"name": "a3fl", "attacker_ids": [PID], **attack}
    )


def runtime(**attack) -> Runtime:
    return Runtime(scenario({"size": 3, "trigger_epochs": 2, **attack}))


def global_model(rt: Runtime, pretrain_epochs: int = 0) -> nn.Module:
    """A seeded model; optionally trained on clean digits so the backdoor loss has room to fall."""
    torch.manual_seed(0)
    model = rt.build_model()
    if pretrain_epochs:
        train(model, rt.data.x_train, rt.data.y_train, TrainConfig(pretrain_epochs, 32, 0.1, momentum=0.9), seed=0)
    return model


def job(rt: Runtime, model: nn.Module, memory: dict | None = None, seed: int = 123, rnd: int = 1) -> AttackerRound:
    model = copy.deepcopy(model)
    vec = rt.layout.flatten_model(model)
    cfg = TrainConfig(1, 16, 0.1, momentum=0.9)
    return AttackerRound(rt, PID, rnd, model, vec, rt.layout, cfg, seed, {}, memory if memory is not None else {})


def square(shape, size, r0, c0) -> np.ndarray:
    mask = np.zeros(shape, dtype=bool)
    mask[r0 : r0 + size, c0 : c0 + size] = True
    return mask


def backdoor_loss(model: nn.Module, x: np.ndarray, mask: np.ndarray, trigger: np.ndarray, target: int) -> float:
    """Mean cross-entropy of the target label on every input stamped with `trigger` (fedsim.training.evaluate)."""
    return evaluate(model, stamp(x, mask, trigger), np.full(len(x), target, dtype=np.int64))["loss"]


# --------------------------------------------------------------------------- parameters
def test_defaults_are_the_official_config_and_every_field_is_described():
    p = A3FLParams()
    official = {  # hfzhang31/A3FL main/configs/config.yaml and fl_utils/attacker.py's constants
        "target_class": 2, "size": 5, "offset": (2, 2), "init_value": 0.5, "poison_fraction": 0.25,
        "trigger_epochs": 200, "trigger_lr": 0.01, "lambda0": 0.01, "adapt_every": 1, "adapt_models": 1,
        "adapt_epochs": 5, "adapt_lr": 0.01, "adapt_momentum": 0.9, "adapt_weight_decay": 5e-4,
        "similarity": "gradients", "scale": 1.0,
    }
    assert {k: getattr(p, k) for k in official} == official
    own = set(A3FLParams.model_fields) - {"num_attackers", "attacker_ids", "schedule"}
    assert all(A3FLParams.model_fields[k].description for k in own)


@pytest.mark.parametrize(
    "bad, field, needle",
    [
        ({"trigger_lr": 0}, "attack.a3fl.trigger_lr", "greater than 0"),
        ({"trigger_epochs": -1}, "attack.a3fl.trigger_epochs", "greater than or equal to 0"),
        ({"adapt_epochs": 0}, "attack.a3fl.adapt_epochs", "greater than or equal to 1"),
        ({"poison_fraction": 1.5}, "attack.a3fl.poison_fraction", "less than or equal to 1"),
        ({"similarity": "cosine"}, "attack.a3fl.similarity", "'gradients'"),
        ({"bounds": [1.0, 0.0]}, "attack.a3fl", "attack.bounds"),
        ({"bounds": [0.0, 0.4]}, "attack.a3fl", "attack.init_value=0.5"),
        ({"offset": [-1, 0]}, "attack.a3fl", "attack.offset"),
    ],
)
def test_a_bad_parameter_is_named(bad, field, needle):
    with pytest.raises(ScenarioError) as info:
        scenario(bad)
    got = {path: msg for path, msg, _ in info.value.problems}
    assert field in got and needle in got[field], got


def test_geometry_and_init_value_are_checked_against_the_data():
    rt = runtime(size=5, offset=(4, 0))
    with pytest.raises(ValueError, match="attack.size=5 at attack.offset=\\[4, 0\\]"):
        rt.attack.backdoor_test_set(rt)
    rt = runtime(init_value=3.0)  # digits lie in [0, 1]
    with pytest.raises(ValueError, match="attack.init_value=3.0 lies outside the data range"):
        rt.attack.backdoor_test_set(rt)
    ok = runtime(init_value=3.0, bounds=(0.0, 4.0))  # an explicit range may exceed the data's
    assert (ok.attack.initial_trigger(ok) == 3.0).all()


def test_patch_mask_exact_pixels():
    mask = patch_mask((6, 8), 2, (1, 5))  # not square: rows and columns cannot be swapped
    assert set(zip(*np.nonzero(mask))) == {(1, 5), (1, 6), (2, 5), (2, 6)}
    assert patch_mask((8, 8), 8, (0, 0)).all()


# --------------------------------------------------------------------------- one step, range, mask
def test_one_full_batch_epoch_is_one_signed_gradient_step():
    """Epoch 0 has no adapted model: δ ← clamp(δ − lr·sign(∇δ CE(model(δ·m + (1−m)·x), target)))."""
    rt = runtime()
    model = global_model(rt, pretrain_epochs=1)
    p = A3FLParams(size=3, trigger_epochs=1, trigger_lr=0.3, target_class=2)
    x = rt.data.x_train[rt.partitions[PID]]
    mask = square((8, 8), 3, 2, 2)
    start = np.full((1, 8, 8), 0.5, np.float32)
    y = rt.data.y_train[rt.partitions[PID]]
    got = search_trigger(model, x, y, start, mask, p, np.zeros(1), np.ones(1), len(x), seed=5)

    t = torch.tensor(start, requires_grad=True)
    m = torch.from_numpy(mask).float()
    model.eval()
    loss = nn.functional.cross_entropy(model(t * m + (1 - m) * torch.from_numpy(x)), torch.full((len(x),), 2))
    (grad,) = torch.autograd.grad(loss, t)
    expected = np.clip(start - 0.3 * np.sign(grad.numpy()), 0, 1)
    assert (grad.numpy()[:, mask] != 0).all()  # every trigger pixel moves
    np.testing.assert_allclose(got, expected, atol=1e-6)
    down, up = np.isclose(got[:, mask], 0.2), np.isclose(got[:, mask], 0.8)
    assert (down | up).all() and down.any() and up.any()  # one step of 0.3, in both directions


@pytest.mark.parametrize("bounds", [None, (0.2, 0.9)])
def test_the_trigger_stays_in_its_range_and_its_mask(bounds):
    rt = runtime(trigger_epochs=4, trigger_lr=0.4, size=3, offset=(1, 4), bounds=bounds)
    j = job(rt, global_model(rt))
    rt.attack.local_train(j)
    t = j.memory["trigger"]
    lo, hi = bounds or (0.0, 1.0)  # digits are scaled to [0, 1]
    mask = square((8, 8), 3, 1, 4)
    assert t.shape == (1, 8, 8) and t.dtype == np.float32
    assert (t >= lo).all() and (t <= hi).all()
    assert (t[:, ~mask] == 0.5).all()  # nothing outside the patch changes
    assert (t[:, mask] != 0.5).any()
    assert np.isclose(t[:, mask], lo).any() or np.isclose(t[:, mask], hi).any()  # the clamp was reached


# --------------------------------------------------------------------------- the search lowers the backdoor loss
def test_each_epoch_lowers_the_backdoor_loss_of_a_fixed_model():
    """Without adaptation (λ0 = 0) and with full batches, a run of k epochs is the first k epochs of a
    longer run: the backdoor loss on the global model falls epoch after epoch."""
    rt = runtime()
    model = global_model(rt, pretrain_epochs=2)
    idx = rt.partitions[PID]
    x, y = rt.data.x_train[idx], rt.data.y_train[idx]
    mask = square((8, 8), 3, 2, 2)
    start = np.full((1, 8, 8), 0.5, np.float32)
    losses = []
    for k in range(6):
        p = A3FLParams(size=3, trigger_epochs=k, trigger_lr=0.05, lambda0=0.0)
        t = search_trigger(model, x, y, start, mask, p, np.zeros(1), np.ones(1), len(x), seed=0)
        losses.append(backdoor_loss(model, x, mask, t, 2))
    assert all(b < a for a, b in zip(losses, losses[1:])), losses


@pytest.mark.parametrize("similarity", ["gradients", "weights"])
def test_the_search_with_adaptation_lowers_the_backdoor_loss_and_the_adaptation_matters(similarity):
    rt = runtime()
    model = global_model(rt, pretrain_epochs=2)
    idx = rt.partitions[PID]
    x, y = rt.data.x_train[idx], rt.data.y_train[idx]
    mask = square((8, 8), 3, 2, 2)
    start = np.full((1, 8, 8), 0.5, np.float32)
    args = (model, x, y, start, mask)
    bounds = (np.zeros(1), np.ones(1), 16)
    p = A3FLParams(size=3, trigger_epochs=4, trigger_lr=0.05, lambda0=10.0, similarity=similarity)
    t = search_trigger(*args, p, *bounds, seed=0)
    assert backdoor_loss(model, x, mask, t, 2) < backdoor_loss(model, x, mask, start, 2)
    plain = search_trigger(*args, p.model_copy(update={"lambda0": 0.0}), *bounds, seed=0)
    assert not np.array_equal(t, plain)  # the adapted model's loss takes part
    other = "weights" if similarity == "gradients" else "gradients"
    assert not np.array_equal(t, search_trigger(*args, p.model_copy(update={"similarity": other}), *bounds, seed=0))


def test_the_adapted_model_unlearns_the_trigger():
    """θ'_t is trained on stamped inputs with their true labels: its loss there falls below the global model's."""
    rt = runtime()
    model = global_model(rt, pretrain_epochs=2)
    idx = rt.partitions[PID]
    x, y = torch.from_numpy(rt.data.x_train[idx]), torch.from_numpy(rt.data.y_train[idx])
    mask = torch.from_numpy(square((8, 8), 3, 2, 2))
    t = torch.zeros(1, 8, 8)
    before = copy.deepcopy(model.state_dict())
    adv = adapted_model(model, x, y, t, mask, A3FLParams(), 16, torch.Generator().manual_seed(0))
    stamped = torch.where(mask, t, x).numpy()
    assert evaluate(adv, stamped, y.numpy())["loss"] < evaluate(model, stamped, y.numpy())["loss"]
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())  # the global model is untouched
    assert all(q.grad is not None for q in adv.parameters())  # its last batch's gradient, for sim


def test_similarity_layers_and_mean_cosine():
    lenet = LeNet((1, 8, 8), 10)
    assert similarity_layers(lenet) == ["conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias"]
    mlp = nn.Sequential(nn.Flatten(), nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    assert similarity_layers(mlp) == ["1.weight", "1.bias", "3.weight", "3.bias"]  # no conv layer: all
    rng = np.random.default_rng(0)
    a = [rng.normal(size=(3, 4)), rng.normal(size=5)]
    b = [rng.normal(size=(3, 4)), -a[1]]
    cos = [float(u.ravel() @ v.ravel() / np.linalg.norm(u) / np.linalg.norm(v)) for u, v in zip(a, b)]
    got = mean_cosine([torch.tensor(u) for u in a], [torch.tensor(v) for v in b])
    assert got == pytest.approx(np.mean(cos)) and cos[1] == pytest.approx(-1.0)


# --------------------------------------------------------------------------- the poisoned training
def test_without_optimisation_the_attacker_trains_like_a_plain_trigger_patch():
    """trigger_epochs = 0: the trigger stays the initial 0.5 patch, and the attacker trains on exactly
    the `trigger` attack's set for a top-left square of value 0.5 and the same share."""
    rt = Runtime(scenario({"size": 3, "offset": (0, 0), "trigger_epochs": 0, "target_class": 4}))
    plain = TriggerBackdoor(TriggerParams(size=3, location="top_left", value=0.5, poison_fraction=0.25, target_class=4))
    model = global_model(rt)
    j = job(rt, model)
    n, _, info = rt.attack.local_train(j)
    np.testing.assert_array_equal(j.memory["trigger"], np.full((1, 8, 8), 0.5, np.float32))

    x, y = plain.training_set(rt, PID)
    assert n == len(x) == info["num_examples"] == len(rt.partitions[PID])
    expected = copy.deepcopy(model)
    train(expected, x, y, j.train, j.seed)
    for a, b in zip(j.model.parameters(), expected.parameters()):
        assert torch.equal(a, b)
    xa, ya = rt.attack.backdoor_test_set(rt)
    xb, yb = plain.backdoor_test_set(rt)
    np.testing.assert_array_equal(xa, xb)
    np.testing.assert_array_equal(ya, yb)


def test_the_attacker_trains_on_its_optimised_trigger():
    rt = runtime(trigger_epochs=2)
    model = global_model(rt)
    j = job(rt, model)
    rt.attack.local_train(j)
    t = j.memory["trigger"]
    idx = rt.partitions[PID]
    rows = choose_poisoned(len(idx), 0.25, 0, PID)
    x, y = rt.data.x_train[idx].copy(), rt.data.y_train[idx].copy()
    x[rows] = np.where(square((8, 8), 3, 2, 2), t, x[rows])
    y[rows] = 2
    expected = copy.deepcopy(model)
    train(expected, x, y, j.train, j.seed)
    assert all(torch.equal(a, b) for a, b in zip(j.model.parameters(), expected.parameters()))
    # and the trigger is what search_trigger makes from the initial one with the round's own stream
    direct = search_trigger(model, rt.data.x_train[idx], rt.data.y_train[idx], np.full((1, 8, 8), 0.5, np.float32),
                            square((8, 8), 3, 2, 2), rt.attack.params, np.zeros(1), np.ones(1), 16,
                            derive_seed(j.seed, SEARCH))
    np.testing.assert_array_equal(t, direct)


def test_same_seed_same_trigger_and_model_other_seed_other_trigger():
    rt = runtime(trigger_epochs=3)
    model = global_model(rt)
    a, b, c = job(rt, model, seed=7), job(rt, model, seed=7), job(rt, model, seed=8)
    for j in (a, b, c):
        Runtime(rt.scenario).attack.local_train(j)  # a fresh process's view each time
    np.testing.assert_array_equal(a.memory["trigger"], b.memory["trigger"])
    assert torch.equal(rt.layout.flatten_model(a.model), rt.layout.flatten_model(b.model))
    assert not np.array_equal(a.memory["trigger"], c.memory["trigger"])


# --------------------------------------------------------------------------- memory and report
def test_the_second_attack_round_starts_from_the_first_rounds_trigger():
    rt = runtime(trigger_epochs=2)
    model = global_model(rt)
    memory: dict = {}
    first = job(rt, model, memory, rnd=1)
    rt.attack.local_train(first)
    t1 = memory["trigger"].copy()
    assert (t1 != 0.5).any()
    stored = {"trigger": t1.copy()}
    stored["trigger"].flags.writeable = False  # as a memory-mapped / unpacked array may come back

    frozen = Runtime(scenario({"size": 3, "trigger_epochs": 0}))  # no search: round 2 plants round 1's trigger
    second = job(frozen, model, dict(stored), rnd=2)
    frozen.attack.local_train(second)
    np.testing.assert_array_equal(second.memory["trigger"], t1)
    x_bd, _ = frozen.attack.backdoor_test_set(frozen, frozen.attack.shared_state(second))
    np.testing.assert_array_equal(x_bd, stamp(rt.data.x_test[rt.data.y_test != 2], square((8, 8), 3, 2, 2), t1))

    again = job(rt, model, dict(stored), rnd=2, seed=99)  # a search continues from round 1's trigger
    rt.attack.local_train(again)
    idx = rt.partitions[PID]
    direct = search_trigger(model, rt.data.x_train[idx], rt.data.y_train[idx], t1, square((8, 8), 3, 2, 2),
                            rt.attack.params, np.zeros(1), np.ones(1), 16, derive_seed(99, SEARCH))
    np.testing.assert_array_equal(again.memory["trigger"], direct)

    with pytest.raises(ValueError, match="shape"):
        rt.attack.local_train(job(rt, model, {"trigger": np.zeros((3, 8, 8), np.float32)}))


def test_the_report_sets_the_backdoor_test_set():
    rt = runtime()
    attack = rt.attack
    j = job(rt, global_model(rt))
    assert attack.shared_state(j) is None  # nothing planted yet
    attack.local_train(j)
    report = attack.shared_state(j)
    assert set(report) == {"trigger"} and report["trigger"] is not j.memory["trigger"]
    keep = rt.data.y_test != 2
    mask = square((8, 8), 3, 2, 2)
    x, y = attack.backdoor_test_set(rt, report)
    assert (y == 2).all() and len(y) == keep.sum() and y.dtype == np.int64
    np.testing.assert_array_equal(x, np.where(mask, report["trigger"], rt.data.x_test[keep]))
    x0, _ = attack.backdoor_test_set(rt)  # before any report: the initial patch
    np.testing.assert_array_equal(x0, stamp(rt.data.x_test[keep], mask, 0.5))
    with pytest.raises(ValueError, match="expected \\(1, 8, 8\\)"):
        attack.backdoor_test_set(rt, {"trigger": np.zeros((8, 8), np.float32)})
    with pytest.raises(ValueError, match="no 'trigger'"):
        attack.backdoor_test_set(rt, {"other": np.zeros(1)})
    with pytest.raises(ValueError, match="non-finite"):
        attack.backdoor_test_set(rt, {"trigger": np.full((1, 8, 8), np.nan, np.float32)})
    assert not attack.poisons_data_only()  # FedMA's data-only path would skip the search


# --------------------------------------------------------------------------- a whole run
def test_short_run_measures_the_backdoor_with_the_lowest_attackers_planted_trigger(tmp_path, monkeypatch):
    """Two attackers in rounds 1 and 3 through the real strategy and ClientApp: each continues from
    its own trigger of round 1, and the server measures with the trigger attacker 1 (the lower id)
    planted in round 3."""
    seen: dict[int, list[tuple[np.ndarray | None, np.ndarray]]] = {1: [], 5: []}
    plain = A3FL.local_train

    def spy(self, job):
        start = job.memory.get("trigger")
        out = plain(self, job)
        seen[job.partition_id].append((None if start is None else np.array(start), job.memory["trigger"].copy()))
        return out

    monkeypatch.setattr(A3FL, "local_train", spy)
    scen = scenario({"size": 3, "trigger_epochs": 2, "trigger_lr": 0.1, "attacker_ids": [5, 1],
                     "schedule": {"name": "rounds", "rounds": [1, 3], "attackers_per_round": 2}})
    run_dir = RunFolder.create(scen, tmp_path).path
    run_server(LocalGrid(make_client_app(scen), scen.federation.num_clients), scen, run_dir, checkpoints=True)
    rounds = read_rounds(run_dir)
    assert [r["attackers"] for r in rounds] == [[1, 5], [], [1, 5]]
    for pid in (1, 5):
        (start1, end1), (start3, end3) = seen[pid]
        assert start1 is None  # a fresh attacker starts from the initial patch
        np.testing.assert_array_equal(start3, end1)  # round 3 continues from its own round-1 trigger
    assert not np.array_equal(seen[1][1][1], seen[5][1][1])  # two partitions, two triggers

    saved = load_server(run_dir, 3)
    trigger = saved["extra"]["backdoor_report"]["trigger"].numpy()
    np.testing.assert_array_equal(trigger, seen[1][1][1])  # the lower id's round-3 trigger
    rt = Runtime(scen)
    model = rt.build_model()
    rt.layout.load_into(model, saved["global"])
    x_bd, y_bd = rt.attack.backdoor_test_set(rt, {"trigger": trigger})
    assert rounds[-1]["backdoor_success"] == pytest.approx(float((predict(model, x_bd)[0] == y_bd).mean()))
