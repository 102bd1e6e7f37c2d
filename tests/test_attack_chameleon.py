"""Chameleon: its contrastive loss against a brute-force double loop, its stages against their
definitions (nothing but the encoder moves in stage 1, nothing but the head in stage 2, the plain
nested attack when the contrastive stage is off), the pull it exerts on poisoned embeddings, the
lr schedule against torch's MultiStepLR, the update bound, the nested spec's validation, and a
short whole run on digits."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import yaml
from torch import nn
from conftest import quick_scenario

from fedsim.attacks.base import AttackerRound, ClientAttack, attacker_train_config
from fedsim.attacks.chameleon import (
    CONTRASTIVE, Chameleon, ChameleonParams, contrastive_stage, epoch_lrs, split_parameters, supcon_loss,
)
from fedsim.attacks.nested import OUTER_FIELDS
from fedsim.attacks.trigger import TriggerParams
from fedsim.cli import main
from fedsim.client.app import make_client_app
from fedsim.client.steps import local_update
from fedsim.flower.local_grid import LocalGrid
from fedsim.lowrank.layers import build_factorized
from fedsim.models.nets import LeNet, LeNetParams, MlpParams, Vgg9Params, features, head, lenet, mlp, vgg9
from fedsim.registry import ATTACKS
from fedsim.runs.folder import RunFolder
from fedsim.runs.results import read_rounds
from fedsim.runtime import Runtime
from fedsim.scenario import ScenarioError, load_scenario, scenario_dict, validate_scenario
from fedsim.seeding import derive_seed
from fedsim.server.app import run_server
from fedsim.training import TrainConfig

ATTACKER = 1
CONFIG = {"server-round": 1, "lr": 0.1, "round_total_examples": 1000}
SMALL_TAIL = {"name": "tail", "transform": "rotate", "pca_components": 2, "gmm_components": 1}  # cheap to build
TRIGGER = {"name": "trigger", "size": 2, "target_class": 9, "poison_fraction": 0.3}  # 9: common in the attacker's partition


def scenario(attack: dict, hidden=(32,), **federation):
    fed = {"num_clients": 4, "clients_per_round": 2, "rounds": 3, "local_epochs": 2, "batch_size": 32, "lr": 0.1,
           "momentum": 0.9, **federation}
    return quick_scenario(name="cham", seed=3, model={"name": "mlp", "hidden": list(hidden)}, federation=fed,
                          attack={"attacker_ids": [ATTACKER], **attack})  # QUICK's digits


def chameleon(**params) -> dict:
    return {"name": "chameleon", "poison": TRIGGER, **params}


def job_for(rt: Runtime) -> AttackerRound:
    """The attacker's round as the ClientApp builds it (round 1, from the initial model)."""
    fed = rt.scenario.federation
    vec = rt.initial_weights()
    model = rt.build_model()
    rt.layout.load_into(model, vec)
    honest = TrainConfig(fed.local_epochs, fed.batch_size, rt.lr(1), fed.momentum, fed.weight_decay)
    return AttackerRound(rt, ATTACKER, 1, model, vec, rt.layout, attacker_train_config(rt.attack.params, honest, 1.0),
                         seed=12345, config=dict(CONFIG))


# --------------------------------------------------------------------------- the loss
def double_loop(z: np.ndarray, labels: list[int], target: int, t: float, tb: float, w: float) -> float:
    """The paper's / the code's loss written out pair by pair (float64)."""
    n, total = len(labels), 0.0
    for i in range(n):
        denom = sum(math.exp(float(z[i] @ z[a]) / t) for a in range(n) if a != i)
        positives = [p for p in range(n) if p != i and labels[p] == labels[i]]
        if not positives:
            continue  # an anchor without positives adds 0 but still counts in the mean
        s = sum(math.log(math.exp(float(z[i] @ z[p]) / t) / denom) for p in positives)
        total += -(t / tb) * (w if labels[i] == target else 1.0) * s / len(positives)
    return total / n


@pytest.mark.parametrize("t, tb, w", [(0.07, 0.07, 1.0), (0.07, 0.07, 6.0), (0.5, 0.07, 4.0), (1.0, 2.0, 0.5)])
def test_supcon_loss_equals_the_double_loop(t, tb, w):
    rng = np.random.default_rng(0)
    z = rng.normal(size=(9, 5))
    z /= np.linalg.norm(z, axis=1, keepdims=True)
    labels = [2, 2, 2, 0, 0, 1, 2, 4, 0]  # class 1 and class 4 anchors have no positives
    got = supcon_loss(torch.tensor(z), torch.tensor(labels), target=2, temperature=t, base_temperature=tb,
                      facilitator_weight=w)
    assert got.dtype == torch.float64
    assert got.item() == pytest.approx(double_loop(z, labels, 2, t, tb, w), rel=1e-10, abs=1e-12)


def test_supcon_loss_of_a_single_row_is_zero_and_differentiable():
    z = torch.randn(1, 4, requires_grad=True)
    loss = supcon_loss(z, torch.tensor([3]), target=3)
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(z.grad, torch.zeros_like(z))


# --------------------------------------------------------------------------- the model split
@pytest.mark.parametrize("name", ["mlp", "lenet", "lenet_factorized", "vgg9"])
def test_features_then_head_is_the_forward_pass(name):
    torch.manual_seed(0)
    if name == "vgg9":
        model, x = vgg9((3, 32, 32), 10, Vgg9Params()), torch.randn(2, 3, 32, 32)
    elif name == "mlp":
        model, x = mlp((1, 8, 8), 10, MlpParams(hidden=[16, 8])), torch.randn(5, 1, 8, 8)
    else:
        build = lambda: lenet((1, 12, 12), 10, LeNetParams())  # noqa: E731
        model = build() if name == "lenet" else build_factorized(build, {"fc1": 4, "fc2": 3})
        x = torch.randn(5, 1, 12, 12)
    keys = list(model.state_dict())
    encoder, head_params = split_parameters(model)
    assert [id(p) for p in encoder + head_params] == [id(p) for p in model.parameters()]  # head last, order kept
    assert {id(p) for p in head_params} == {id(p) for p in head(model).parameters()} and encoder
    for train in (False, True):  # train mode: the same dropout masks from the same seed
        model.train(train)
        torch.manual_seed(7)
        whole = model(x)
        torch.manual_seed(7)
        split = head(model)(features(model, x))
        assert torch.equal(whole, split)
    assert list(model.state_dict()) == keys
    if isinstance(model, LeNet):
        assert features(model, x).shape[1] == model.fc2.in_features


# --------------------------------------------------------------------------- the stages
def local_delta(rt: Runtime) -> torch.Tensor:
    return local_update(rt, ATTACKER, rt.initial_weights(), 1, CONFIG)[0]


EDGE = {"name": "edge_case", "num_edge": 20, "num_clean": 60, "edge_set": SMALL_TAIL}


@pytest.mark.parametrize("poison", [TRIGGER, EDGE], ids=["trigger", "edge_case"])
def test_without_the_contrastive_stage_it_trains_exactly_like_the_nested_attack(poison):
    # stage 2 on the whole model with a flat schedule and no bound: the nested attack's plain training
    plain = {"contrastive_epochs": 0, "freeze_encoder": False, "milestones": [], "pgd_norm": None,
             "local_epochs": None, "lr": None}
    ours = local_delta(Runtime(scenario({"name": "chameleon", "poison": poison, **plain})))
    theirs = local_delta(Runtime(scenario(poison)))
    assert torch.equal(ours, theirs)
    assert torch.linalg.vector_norm(ours) > 0


def test_stage_two_moves_only_the_head_and_stage_one_only_the_encoder():
    rt = Runtime(scenario(chameleon(contrastive_epochs=2, local_epochs=2, pgd_norm=None)))
    job = job_for(rt)
    x, y = rt.attack.training_set(rt, ATTACKER)
    target = rt.attack.target_class(rt)
    assert target == 9

    # stage 1 alone, from the global model with the seed local_train derives for it
    alone = rt.build_model()
    rt.layout.load_into(alone, job.global_vec)
    head_before = [p.detach().clone() for p in head(alone).parameters()]
    contrastive_stage(alone, x, y, target, rt.attack.params, job.train.batch_size, derive_seed(job.seed, CONTRASTIVE))
    assert all(torch.equal(a, b) for a, b in zip(head(alone).parameters(), head_before))  # the head did not move
    after_one = split_parameters(alone)[0]
    start = rt.build_model()
    rt.layout.load_into(start, job.global_vec)
    assert not all(torch.equal(a, b) for a, b in zip(after_one, split_parameters(start)[0]))

    rt.attack.local_train(job)
    encoder, head_params = split_parameters(job.model)
    assert all(torch.equal(a, b) for a, b in zip(encoder, after_one))  # stage 2 left the encoder as stage 1 made it
    assert not all(torch.equal(a, b) for a, b in zip(head_params, head_before))  # and trained the head
    assert all(p.requires_grad for p in job.model.parameters())  # unfrozen afterwards


def test_without_the_contrastive_stage_the_frozen_encoder_stays_global():
    rt = Runtime(scenario(chameleon(contrastive_epochs=0, pgd_norm=None)))
    job = job_for(rt)
    _, stats, _ = rt.attack.local_train(job)
    start = rt.build_model()
    rt.layout.load_into(start, job.global_vec)
    assert all(torch.equal(a, b) for a, b in zip(split_parameters(job.model)[0], split_parameters(start)[0]))
    assert stats["steps"] > 0 and "contrastive_loss" not in stats


def mean_cosines(model: nn.Module, x: np.ndarray, poisoned: np.ndarray, target_rows: np.ndarray, other_rows: np.ndarray):
    model.eval()
    with torch.no_grad():
        z = nn.functional.normalize(features(model, torch.from_numpy(x)), dim=1)
    to_target = (z[poisoned] @ z[target_rows].T).mean().item()
    to_others = (z[poisoned] @ z[other_rows].T).mean().item()
    return to_target, to_others


def test_contrastive_stage_pulls_poisoned_embeddings_to_the_target_class():
    # lr 0.01 (the code's CIFAR-10 edge-case value): at EMNIST's 0.05 this small untrained MLP's
    # ReLU embedding collapses onto one direction within an epoch
    rt = Runtime(scenario(chameleon(contrastive_epochs=5, contrastive_lr=0.01)))
    x, y = rt.attack.training_set(rt, ATTACKER)
    poisoned = rt.attack.poison.poisoned_rows(rt, ATTACKER)
    clean = np.setdiff1d(np.arange(len(y)), poisoned)
    target_rows, other_rows = clean[y[clean] == 9], clean[y[clean] != 9]
    assert len(poisoned) and len(target_rows) and len(other_rows)
    model = rt.build_model()
    rt.layout.load_into(model, rt.initial_weights())
    before = mean_cosines(model, x, poisoned, target_rows, other_rows)
    contrastive_stage(model, x, y, 9, rt.attack.params, 32, seed=0)
    after = mean_cosines(model, x, poisoned, target_rows, other_rows)
    assert after[0] > before[0] + 0.1  # closer to the facilitators
    assert after[0] - after[1] > before[0] - before[1] + 0.1  # and closer to them than to the other classes


def test_lr_schedule_is_torch_multisteplr_stepped_before_each_epoch():
    # the official code calls scheduler.step() at the start of every internal epoch
    for epochs, milestones, gamma in [(10, [3, 5, 7, 9], 0.005), (3, [3, 5], 0.1), (4, [], 0.5), (6, [2, 2, 5], 0.3)]:
        opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.05)
        sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=milestones, gamma=gamma)
        expected = []
        for _ in range(epochs):
            opt.step()
            sched.step()
            expected.append(opt.param_groups[0]["lr"])
        assert epoch_lrs(0.05, epochs, milestones, gamma) == pytest.approx(expected, rel=1e-12)


# --------------------------------------------------------------------------- the update
def test_update_is_bounded_by_pgd_norm_and_scaled_before_the_last_clip():
    free = local_delta(Runtime(scenario(chameleon(contrastive_epochs=1, pgd_norm=None))))
    bound = 0.3 * float(torch.linalg.vector_norm(free))
    bounded = local_delta(Runtime(scenario(chameleon(contrastive_epochs=1, pgd_norm=bound))))
    assert float(torch.linalg.vector_norm(bounded)) <= bound * (1 + 1e-5)
    scaled = local_delta(Runtime(scenario(chameleon(contrastive_epochs=1, pgd_norm=None, scale=3.0))))
    assert torch.equal(scaled, free * 3.0)
    # the last projection comes after the scaling: the sent update never leaves the ball
    attack = Chameleon(ChameleonParams(poison=TriggerParams(), scale=3.0, pgd_norm=1.0))
    delta = torch.randn(100)
    out = attack.finish_update(delta, {"num_examples": 10})
    assert float(torch.linalg.vector_norm(out)) == pytest.approx(1.0, rel=1e-5)
    assert torch.nn.functional.cosine_similarity(out, delta, dim=0) == pytest.approx(1.0, rel=1e-5)
    auto = Chameleon(ChameleonParams(scale="auto", pgd_norm=None))
    assert torch.equal(auto.finish_update(delta, {"num_examples": 40, "round_total_examples": 250}), delta * (250 / 40))


# --------------------------------------------------------------------------- the nested spec
def problems(attack: dict) -> str:
    with pytest.raises(ScenarioError) as err:
        validate_scenario({"attack": attack})
    return str(err.value)


def test_nested_spec_is_validated_like_any_attack_and_refuses_what_chameleon_cannot_use():
    assert "cannot be chameleon itself" in problems({"name": "chameleon", "poison": "chameleon"})
    assert "server-side" in problems({"name": "chameleon", "poison": "alie"})
    assert "unknown attack.poison 'nope'" in problems({"name": "chameleon", "poison": "nope"})
    assert "attack.chameleon.poison" in problems({"name": "chameleon", "poison": {"name": "trigger", "size": 0}})
    for key, value in [("num_attackers", 2), ("attacker_ids", [0]), ("schedule", {"name": "every_round"}), ("lr", 0.5)]:
        assert f"attack.poison.{key} is chameleon's own setting" in problems(
            {"name": "chameleon", "poison": {"name": "trigger", key: value}})
    assert "update transform" in problems({"name": "chameleon", "poison": {"name": "trigger", "scale": 2}})
    assert "update transform" in problems({"name": "chameleon", "poison": {"name": "edge_case", "mode": "pgd"}})
    assert "update transform" in problems({"name": "chameleon", "poison": "dba"})  # DBA's default scale is "auto"
    assert "attack.chameleon.milestones" in problems({"name": "chameleon", "milestones": [0, 2]})
    own = [n for n in ATTACKS.names() if ATTACKS.get(n).obj.side == "client" and n != "chameleon"
           and ATTACKS.get(n).obj.local_train is not ClientAttack.local_train]
    for name in own:  # an attack that trains with its own objective has no fixed poisoned set to reuse
        assert "its own objective" in problems({"name": "chameleon", "poison": name})


def test_nested_spec_defaults_and_round_trip():
    sc = validate_scenario({"attack": "chameleon"})
    assert sc.attack.poison.name == "trigger" and sc.attack.contrastive_epochs == 10 and sc.attack.pgd_norm == 5.0
    sc = validate_scenario({"attack": {"name": "chameleon", "poison": {"name": "dba", "scale": 1}, "num_attackers": 2}})
    dumped = scenario_dict(sc)
    assert dumped["attack"]["poison"]["name"] == "dba"
    assert not {"num_attackers", "attacker_ids", "schedule", "local_epochs", "lr"} & set(dumped["attack"]["poison"])
    assert validate_scenario(dumped) == sc
    own = {k: f for k, f in ChameleonParams.model_fields.items() if k not in ("num_attackers", "attacker_ids", "schedule")}
    assert all(f.description for f in own.values())


def test_poison_fields_of_chameleon_itself_are_accepted_at_their_default():
    # a resolved scenario written with them (at the poison's defaults) loads; any other value is refused above
    sc = validate_scenario({"attack": {"name": "chameleon", "poison": TRIGGER}})
    full = {**sc.attack.poison.model_dump(mode="json"), "num_attackers": 1, "attacker_ids": None,
            "schedule": {"name": "fixed_frequency", "every": 10}, "local_epochs": None, "lr": None}
    assert validate_scenario({"attack": {"name": "chameleon", "poison": full}}) == sc


def test_fedsim_validate_output_loads_back_unchanged(tmp_path, capsys):
    raw = {"name": "cham", "data": {"dataset": "digits"}, "model": {"name": "mlp", "hidden": [32]},
           "federation": {"num_clients": 4, "clients_per_round": 2, "rounds": 2},
           "attack": chameleon(attacker_ids=[ATTACKER], schedule={"name": "every_round"}, local_epochs=2, lr=0.05)}
    given = tmp_path / "given.yaml"
    given.write_text(yaml.safe_dump(raw))
    assert main(["validate", str(given)]) == 0
    printed = capsys.readouterr().out
    dumped = yaml.safe_load(printed)["attack"]["poison"]
    assert dumped["name"] == "trigger" and not set(OUTER_FIELDS) & set(dumped)
    resolved = tmp_path / "resolved.yaml"
    resolved.write_text(printed)
    assert load_scenario(resolved) == load_scenario(given)


def test_source_class_is_the_nested_edge_sets():
    # the server reports the global model's clean accuracy on this class beside the backdoor's success
    edge = {**EDGE, "edge_set": {**SMALL_TAIL, "source_class": 3, "target_class": 8}}
    rt = Runtime(scenario({"name": "chameleon", "poison": edge}))
    assert rt.attack.source_class() == 3 == rt.attack.poison.source_class()
    assert Runtime(scenario(chameleon())).attack.source_class() is None  # a trigger turns every class


def test_untargeted_poison_is_refused_before_any_round():
    rt = Runtime(scenario({"name": "chameleon", "poison": {"name": "label_flip", "mode": "all"}}))
    with pytest.raises(ValueError, match="one target class"):
        rt.attack.backdoor_test_set(rt)
    rt = Runtime(scenario({"name": "chameleon", "poison": {"name": "label_flip", "mode": "targeted"}}))
    assert rt.attack.target_class(rt) == 1


def test_a_model_without_hidden_layers_is_refused():
    rt = Runtime(scenario(chameleon(), hidden=()))
    with pytest.raises(ValueError, match="hidden layer"):
        rt.attack.local_train(job_for(rt))


# --------------------------------------------------------------------------- a whole run
def test_short_run_on_digits(tmp_path):
    attack = chameleon(contrastive_epochs=3, schedule={"name": "every_round"})
    scen = scenario(attack)
    run_dir = RunFolder.create(scen, tmp_path).path
    summary = run_server(LocalGrid(make_client_app(scen), scen.federation.num_clients), scen, run_dir)
    rounds = read_rounds(run_dir)
    assert [r["round"] for r in rounds] == [1, 2, 3]
    assert all(r["attackers"] == [ATTACKER] for r in rounds)
    assert all(0.0 <= r["backdoor_success"] <= 1.0 for r in rounds)
    assert summary["attack"]["poison"] == "trigger" and summary["attack"]["target_class"] == 9
    assert rounds[-1]["backdoor_success"] > 0.5  # planted (a model that never saw the trigger: < 0.01 here)
