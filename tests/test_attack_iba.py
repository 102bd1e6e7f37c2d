"""IBA (attacks/iba.py): the trigger's bounds, generator training, the attacker's phases and memory,
the model-level constraints and the backdoor test set, on digits with tiny generators."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import quick_scenario

import fedsim.attacks.iba as iba
from fedsim.attacks.base import AttackerRound, AttackParams, attacker_train_config
from fedsim.attacks.iba import (
    EPS, GEN, PHASE, IBAParams, IrreversibleBackdoor, MNISTAutoencoder, UNetGenerator, apply_trigger,
    build_generator, decayed_eps, generator_arrays, neurotoxin_mask, train_generator, triggered,
)
from fedsim.runtime import Runtime
from fedsim.scenario import ScenarioError
from fedsim.training import TrainConfig, train

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py: why


SMALL = {"generator_width": 4, "generator_epochs": 1, "generator_lr": 0.01}


def scenario(seed=0, **attack):
    return quick_scenario(
        name="iba", seed=seed, model={"name": "mlp", "hidden": [32]},  # QUICK's digits
        federation={"num_clients": 8, "clients_per_round": 4, "rounds": 3, "local_epochs": 1, "batch_size": 32,
                    "lr": 0.1, "momentum": 0.0},
        attack={"name": "iba", "attacker_ids": [1], **SMALL, **attack})


def attack_round(rt, rnd, memory=None, global_vec=None, seed=None, epochs=1):
    """One attacker round as the ClientApp builds it (fedsim.client.steps.local_update)."""
    global_vec = rt.initial_weights() if global_vec is None else global_vec
    model = rt.build_model()
    rt.layout.load_into(model, global_vec)
    cfg = TrainConfig(epochs, 32, 0.1)
    job = AttackerRound(rt, 1, rnd, model, global_vec, rt.layout, attacker_train_config(rt.attack.params, cfg, 1.0),
                        seed if seed is not None else 1000 + rnd, {"server-round": rnd},
                        memory if memory is not None else {})
    n, stats, info = rt.attack.local_train(job)
    delta = rt.attack.finish_update(rt.layout.flatten_model(model) - global_vec, info)
    return job, delta, stats, info


def trained_classifier(rt, epochs=8):
    torch.manual_seed(0)
    model = rt.build_model()
    train(model, rt.data.x_train, rt.data.y_train, TrainConfig(epochs, 32, 0.1, 0.9), 0)
    return model


def saturated(gen: torch.nn.Module) -> torch.nn.Module:
    """The generator with its last BatchNorm's shift set to ±50: tanh output at ±1 almost everywhere."""
    bn = [m for m in gen.modules() if isinstance(m, torch.nn.BatchNorm2d)][-1]
    with torch.no_grad():
        bn.bias.copy_(torch.where(torch.arange(bn.num_features) % 2 == 0, 50.0, -50.0))
    return gen


# --------------------------------------------------------------------------- the trigger
@pytest.mark.parametrize(
    "make, shape",
    [(lambda: UNetGenerator(1, 4), (1, 8, 8)), (lambda: UNetGenerator(3, 4), (3, 32, 32)),
     (lambda: UNetGenerator(1, 4), (1, 28, 28)), (MNISTAutoencoder, (1, 28, 28))],
    ids=["unet-8x8", "unet-32x32", "unet-28x28", "autoencoder-28x28"],
)
@pytest.mark.parametrize("saturate", [False, True])
def test_trigger_is_within_eps_and_the_data_range(make, shape, saturate):
    torch.manual_seed(0)
    gen = saturated(make()) if saturate else make()
    rng = np.random.default_rng(0)
    lo = torch.tensor([-0.5, 0.0, 0.2][: shape[0]]).view(1, -1, 1, 1)
    hi = lo + 1.0
    x = (lo + torch.from_numpy(rng.uniform(size=(6, *shape)).astype(np.float32)) * (hi - lo)).numpy()
    x[0] = np.broadcast_to(lo[0].numpy(), shape)  # inputs on the range's edges
    x[1] = np.broadcast_to(hi[0].numpy(), shape)
    eps = 0.3
    out = triggered(gen, x, eps, lo, hi)
    assert out.shape == x.shape and out.dtype == np.float32
    assert np.abs(out - x).max() <= eps + 1e-6
    assert (out >= lo.numpy()).all() and (out <= hi.numpy()).all()
    assert np.abs(out - x).max() > 0.05  # a trigger, not the identity
    if saturate:  # |T(x)| = 1: interior pixels move by exactly eps
        inner = (x > lo.numpy() + eps) & (x < hi.numpy() - eps)
        np.testing.assert_allclose(np.abs(out - x)[inner], eps, atol=1e-5)


def test_zero_eps_leaves_inputs_unchanged():
    gen = saturated(UNetGenerator(1, 4))
    rng = np.random.default_rng(1)
    x = rng.uniform(size=(5, 1, 8, 8)).astype(np.float32)
    lo, hi = torch.zeros(1, 1, 1, 1), torch.ones(1, 1, 1, 1)
    np.testing.assert_array_equal(triggered(gen, x, 0.0, lo, hi), x)
    # the whole attack at eps = 0: the backdoor test set is the clean non-target test images
    rt = Runtime(scenario(eps=0.0, test_eps=0.0, target_class=3))
    x_bd, y_bd = rt.attack.backdoor_test_set(rt)
    np.testing.assert_array_equal(x_bd, rt.data.x_test[rt.data.y_test != 3])
    assert (y_bd == 3).all()


def test_generator_training_lowers_the_target_loss_and_leaves_the_classifier():
    rt = Runtime(scenario())
    model = trained_classifier(rt)
    before = rt.layout.flatten_model(model).clone()
    grads = [q.grad.clone() for q in model.parameters()]  # its last training step's
    x = rt.data.x_train[rt.partitions[1]]
    lo, hi = rt.attack.data_range(rt)
    gen = build_generator("unet", (1, 8, 8), 4, 7)

    def target_loss():
        with torch.no_grad():
            model.eval()
            gen.train()  # batch statistics, as the loss being minimised
            logits = model(apply_trigger(gen, torch.from_numpy(x), 0.3, lo, hi))
            return F.cross_entropy(logits, torch.zeros(len(x), dtype=torch.int64)).item()

    start = target_loss()
    losses = train_generator(gen, model, x, 0, 0.3, lo, hi, lr=0.01, epochs=5, batch_size=32, seed=0)
    assert target_loss() < 0.5 * start
    assert losses[-1] < losses[0]
    assert torch.equal(rt.layout.flatten_model(model), before)  # the classifier is only read
    assert all(torch.equal(q.grad, g) and q.requires_grad for q, g in zip(model.parameters(), grads))  # left as it was


# --------------------------------------------------------------------------- the attacker's rounds
def test_before_the_backdoor_phase_the_update_is_the_honest_one():
    rt = Runtime(scenario(switch_asr=1.0))  # never switches
    job, delta, stats, info = attack_round(rt, 1, epochs=2)
    model = rt.build_model()
    start = rt.initial_weights()
    rt.layout.load_into(model, start)
    train(model, *rt.attack.training_set(rt, 1), TrainConfig(2, 32, 0.1), job.seed)
    assert torch.equal(delta, rt.layout.flatten_model(model) - start)
    assert not info["iba_backdoor_round"] and job.memory[PHASE].tolist() == [0, 0, 0]
    assert any(k.startswith(GEN) for k in job.memory) and job.memory[EPS][0] == 0.3


def test_same_seed_same_generator_and_update():
    runs = [attack_round(Runtime(scenario()), 1) for _ in range(2)]
    (job_a, delta_a, *_), (job_b, delta_b, *_) = runs
    assert job_a.memory.keys() == job_b.memory.keys()
    for k in job_a.memory:
        np.testing.assert_array_equal(job_a.memory[k], job_b.memory[k])
    assert torch.equal(delta_a, delta_b)
    other, *_ = attack_round(Runtime(scenario()), 1, seed=77)  # another round seed: another batch order
    assert any(not np.array_equal(job_a.memory[k], other.memory[k]) for k in job_a.memory if k.startswith(GEN))
    init_a = generator_arrays(IrreversibleBackdoor(IBAParams(**SMALL)).initial_generator(Runtime(scenario(seed=0))))
    init_b = generator_arrays(IrreversibleBackdoor(IBAParams(**SMALL)).initial_generator(Runtime(scenario(seed=1))))
    assert any(not np.array_equal(init_a[k], init_b[k]) for k in init_a)  # initial weights follow the scenario seed


def test_memory_round_trip_round_two_starts_from_round_one(monkeypatch, tmp_path):
    rt = Runtime(scenario(switch_asr=1.0))
    job1, *_ = attack_round(rt, 1)
    # the ClientApp keeps memory on the client's disk: an npz round trip
    np.savez(tmp_path / "state.npz", **job1.memory)
    with np.load(tmp_path / "state.npz", allow_pickle=False) as saved:
        memory = {k: saved[k] for k in saved.files}
    starts = []
    real = iba.train_generator

    def spy(gen, *args, **kwargs):
        starts.append(generator_arrays(gen))
        return real(gen, *args, **kwargs)

    monkeypatch.setattr(iba, "train_generator", spy)
    job2, *_ = attack_round(rt, 2, memory=memory)
    attack_round(rt, 2, memory={})
    round1 = {k: v for k, v in job1.memory.items() if k.startswith(GEN)}
    for k, v in round1.items():
        np.testing.assert_array_equal(starts[0][k], v)  # round 2 trains round 1's generator on
    initial = generator_arrays(rt.attack.initial_generator(rt))
    for k, v in initial.items():
        np.testing.assert_array_equal(starts[1][k], v)  # without memory: the seeded initial generator
    assert any(not np.array_equal(job2.memory[k], round1[k]) for k in round1)  # and it moved on
    assert job2.memory is memory  # updated in place, as the ClientApp expects


def test_backdoor_phase_schedule_eps_decay_and_alternating_retraining():
    rt = Runtime(scenario(switch_asr=0.0, eps_decay=0.5, test_eps=0.05, constraint="none"))
    memory: dict = {}
    gens, eps, phases = [], [], []
    for rnd in (1, 2, 3, 4, 5, 6):
        job, _, _, info = attack_round(rt, rnd, memory)
        gens.append({k: v.copy() for k, v in memory.items() if k.startswith(GEN)})
        eps.append(float(memory[EPS][0]))
        phases.append(memory[PHASE].tolist())
        assert info["iba_backdoor_round"] == (rnd >= 2)
    # round 1 learns the generator at eps; the backdoor phase starts in round 2 and eps halves each round
    assert eps == [0.3, 0.3, 0.15, 0.075, 0.05, 0.05]
    assert [p[:2] for p in phases] == [[0, 0]] + [[1, 2]] * 5
    changed = [any(not np.array_equal(a[k], b[k]) for k in a) for a, b in zip(gens, gens[1:])]
    assert changed == [True, False, True, False, True]  # retrained in rounds 2, 4, 6; kept in 3, 5
    assert decayed_eps(0.3, 0.05, 0.001, 0) == 0.3
    assert decayed_eps(0.3, 0.05, 0.001, 10) == pytest.approx(0.3 * 0.999**10)
    assert decayed_eps(0.3, 0.05, 0.001, 5000) == 0.05


def test_backdoor_training_sends_triggered_inputs_to_the_target():
    rt = Runtime(scenario())
    x, y = rt.attack.training_set(rt, 1)
    lo, hi = rt.attack.data_range(rt)
    torch.manual_seed(3)
    x_trig = triggered(saturated(UNetGenerator(1, 4)), x, 0.3, lo, hi)
    cfg = TrainConfig(8, 32, 0.1, 0.9)
    models = {}
    for alpha in (0.5, 1.0):  # 1.0: the same training without the poisoned term
        models[alpha] = trained_classifier(rt, epochs=3)
        iba.train_backdoor(models[alpha], x, y, x_trig, 4, alpha, 1.0, cfg, seed=0)
    assert iba.success_rate(models[0.5], x_trig, 4) > 0.9
    assert iba.success_rate(models[1.0], x_trig, 4) < 0.5
    assert iba.success_rate(models[0.5], x, 4) < 0.5  # clean inputs keep their classes


def test_pgd_bounds_the_update_norm():
    kwargs = dict(switch_asr=0.0, pgd_eps=0.05)
    memory: dict = {}
    rt = Runtime(scenario(**kwargs))
    attack_round(rt, 1, memory)
    _, delta, _, _ = attack_round(rt, 2, dict(memory), epochs=3)
    free_rt = Runtime(scenario(**kwargs, constraint="none"))
    _, free, _, _ = attack_round(free_rt, 2, dict(memory), epochs=3)
    assert free.norm() > 0.5  # unconstrained it goes far, so the bound below is the projection's
    assert delta.norm() <= 0.05 + 1e-5
    # round 1 (before the backdoor phase) is not projected
    _, first, _, _ = attack_round(Runtime(scenario(**kwargs)), 1, {})
    assert first.norm() > 0.05


def test_neurotoxin_trains_only_the_smallest_gradient_coordinates():
    rt = Runtime(scenario(switch_asr=0.0, constraint="neurotoxin", mask_ratio=0.3))
    memory: dict = {}
    attack_round(rt, 1, memory)
    start = rt.initial_weights()
    _, delta, _, _ = attack_round(rt, 2, dict(memory), global_vec=start)
    # brute force: |gradient| of the summed clean loss at the global model, coordinate by coordinate
    model = rt.build_model()
    rt.layout.load_into(model, start)
    x, y = rt.attack.training_set(rt, 1)
    loss = F.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(y), reduction="sum")
    grad = torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, list(model.parameters()))]).abs()
    k = int(0.3 * len(grad))
    threshold = torch.sort(grad).values[k - 1]
    mask = torch.cat([m.reshape(-1) for m in neurotoxin_mask(model, x, y, 0.3, 32)])
    assert int(mask.sum()) == k
    assert grad[mask == 1].max() <= threshold + 1e-6 and grad[mask == 0].min() >= threshold - 1e-6
    outside = delta[mask == 0]  # SGD without momentum or weight decay: masked coordinates do not move
    assert torch.count_nonzero(outside) == 0 and torch.count_nonzero(delta) > 0


def test_scale_applies_to_backdoor_rounds_only():
    attack = IrreversibleBackdoor(IBAParams(scale="auto"))
    delta = torch.randn(20)
    info = {"num_examples": 40, "round_total_examples": 200}
    assert torch.equal(attack.finish_update(delta, {**info, "iba_backdoor_round": True}), delta * 5.0)
    assert torch.equal(attack.finish_update(delta, {**info, "iba_backdoor_round": False}), delta)
    assert torch.equal(IrreversibleBackdoor(IBAParams()).finish_update(delta, {**info, "iba_backdoor_round": True}), delta)


# --------------------------------------------------------------------------- measurement and errors
def test_backdoor_test_set_follows_the_report():
    rt = Runtime(scenario(target_class=2))
    keep = rt.data.y_test != 2
    lo, hi = rt.attack.data_range(rt)
    x0, y0 = rt.attack.backdoor_test_set(rt)
    expected = triggered(rt.attack.initial_generator(rt), rt.data.x_test[keep], 0.3, lo, hi)
    np.testing.assert_array_equal(x0, expected)
    assert len(y0) == keep.sum() and (y0 == 2).all() and y0.dtype == np.int64
    job, *_ = attack_round(rt, 1)
    shared = rt.attack.shared_state(job)
    assert set(shared) == {k for k in job.memory if k.startswith(GEN)} | {EPS}
    report = {**shared, EPS: np.array([0.1])}
    x1, _ = rt.attack.backdoor_test_set(rt, report)
    gen = rt.attack.generator_from(rt, report)
    np.testing.assert_array_equal(x1, triggered(gen, rt.data.x_test[keep], 0.1, lo, hi))
    assert np.abs(x1 - rt.data.x_test[keep]).max() <= 0.1 + 1e-6
    assert not np.array_equal(x1, x0)


def test_bad_parameters_name_their_field():
    with pytest.raises(ScenarioError, match="test_eps"):
        scenario(eps=0.1, test_eps=0.2)
    with pytest.raises(ScenarioError, match="eps_decay"):
        scenario(eps_decay=1.0)
    with pytest.raises(ValueError, match="attack.target_class=10"):
        rt = Runtime(scenario(target_class=10))
        rt.attack.backdoor_test_set(rt)
    with pytest.raises(ValueError, match="attack.generator='mnist_autoencoder'"):
        rt = Runtime(scenario(generator="mnist_autoencoder"))
        rt.attack.backdoor_test_set(rt)
    with pytest.raises(ValueError, match="generator_width"):  # the official width-64 U-Net: too big a report here
        rt = Runtime(scenario(generator_width=64))
        rt.attack.backdoor_test_set(rt)
    own = {k: f for k, f in IBAParams.model_fields.items() if k not in AttackParams.model_fields}
    assert own and all(f.description for f in own.values())
    assert build_generator("auto", (1, 28, 28), 4, 0).__class__ is MNISTAutoencoder
    assert build_generator("auto", (3, 32, 32), 4, 0).__class__ is UNetGenerator


# --------------------------------------------------------------------------- a whole run
def test_whole_run_measures_the_generator_the_attacker_reported(tmp_path):
    from fedsim.client.app import make_client_app
    from fedsim.flower.local_grid import LocalGrid
    from fedsim.runs.checkpoint import load_client, load_server
    from fedsim.runs.folder import RunFolder
    from fedsim.runs.results import read_rounds
    from fedsim.server.app import run_server
    from fedsim.training import predict

    sc = scenario(switch_asr=0.0, schedule={"name": "every_round"}, constraint="none")
    sc = sc.model_copy(update={"federation": sc.federation.model_copy(update={"rounds": 3})})
    folder = RunFolder.create(sc, tmp_path)
    grid = LocalGrid(make_client_app(sc, state_dir=folder.client_states), sc.federation.num_clients)
    run_server(grid, sc, folder.path, checkpoints=True)
    rounds = read_rounds(folder.path)
    assert [r["attackers"] for r in rounds] == [[1], [1], [1]]
    saved = load_server(folder.path, 3)
    report = {k: v.numpy() for k, v in saved["extra"]["backdoor_report"].items()}
    assert report[EPS][0] == pytest.approx(0.3 * 0.999)  # round 3: one round into the backdoor phase (started in round 2)
    # the server's number is the final model on the reported generator's backdoor set
    rt = Runtime(sc)
    x_bd, y_bd = rt.attack.backdoor_test_set(rt, report)
    model = rt.build_model()
    rt.layout.load_into(model, saved["global"])
    assert rounds[-1]["backdoor_success"] == pytest.approx(float((predict(model, x_bd)[0] == y_bd).mean()))
    # the attacker kept that generator in its own state (the client's state folder), in the backdoor phase
    own = load_client(folder.client_states, 1, 99)
    assert own["attack." + PHASE].tolist()[:2] == [1, 2]
    for k, v in report.items():
        np.testing.assert_array_equal(own["attack." + k], v)
