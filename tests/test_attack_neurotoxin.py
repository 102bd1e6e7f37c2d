"""Neurotoxin (#20; Zhang et al. 2022): the bottom-k mask against sorting, the frozen coordinates
during masked training, the nested poison's validation, an attacker round through the ClientApp's
local update, and short runs on digits (with a trigger, blended or edge-case poison)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import yaml
from conftest import run_local

from fedsim.attacks.base import AttackerRound, attacker_train_config
from fedsim.attacks.nested import OUTER_FIELDS
from fedsim.attacks.neurotoxin import MEMORY_KEY, bottom_k, bottom_k_masks
from fedsim.cli import main
from fedsim.client.steps import local_update
from fedsim.runtime import Runtime
from fedsim.scenario import ScenarioError, load_scenario, validate_scenario
from fedsim.training import TrainConfig


def scenario(attack, seed=0, data_dir=None, **federation):
    fed = {"num_clients": 6, "clients_per_round": 3, "rounds": 2, "local_epochs": 1, "batch_size": 32, "lr": 0.1,
           "momentum": 0.0, "weight_decay": 0.0}
    data = {"dataset": "digits", **({"dir": str(data_dir)} if data_dir else {})}
    return validate_scenario({"name": "nt", "seed": seed, "data": data, "model": {"name": "mlp", "hidden": [16]},
                              "federation": {**fed, **federation}, "attack": attack})


def job_for(rt, pid=1, momentum=0.0, memory=None, rnd=1):
    """An attacker round as local_update builds it, with the global model of a seeded init."""
    model = rt.build_model()
    global_vec = rt.initial_weights()
    rt.layout.load_into(model, global_vec)
    cfg = attacker_train_config(rt.attack.params, TrainConfig(1, 32, 0.1, momentum=momentum), 1.0)
    return AttackerRound(rt, pid, rnd, model, global_vec, rt.layout, cfg, seed=7, config={"server-round": rnd},
                         memory={} if memory is None else memory)


def flat(masks: dict[str, torch.Tensor]) -> np.ndarray:
    return torch.cat([m.reshape(-1) for m in masks.values()]).numpy()


# --------------------------------------------------------------------------- the mask
@pytest.mark.parametrize("ratio", [0.95, 0.5, 0.1, 1.0])
def test_bottom_k_is_the_k_smallest_by_sorting(ratio):
    score = torch.from_numpy(np.random.default_rng(1).integers(0, 20, size=(7, 11)).astype(np.float32))  # many ties
    mask = bottom_k(score, ratio)
    k = int(77 * ratio)
    order = np.argsort(score.numpy().reshape(-1), kind="stable")  # brute force: sort, take the first k
    expected = np.zeros(77, dtype=bool)
    expected[order[:k]] = True
    assert mask.shape == (7, 11) and mask.sum() == k
    np.testing.assert_array_equal(mask.numpy().reshape(-1), expected)


def test_model_scope_ranks_all_layers_together_and_layer_scope_each_layer():
    rng = np.random.default_rng(2)
    scores = {"a": torch.from_numpy(10 + rng.random((4, 5)).astype(np.float32)),  # a's coordinates are all larger
              "b": torch.from_numpy(rng.random(30).astype(np.float32))}
    whole = bottom_k_masks(scores, 0.6, "model")
    allv = np.concatenate([scores["a"].numpy().reshape(-1), scores["b"].numpy()])
    expected = np.zeros(50, dtype=bool)
    expected[np.argsort(allv, kind="stable")[:30]] = True
    np.testing.assert_array_equal(flat(whole), expected)
    assert whole["b"].all() and whole["a"].shape == (4, 5)  # the 30 small ones are all of b
    per_layer = bottom_k_masks(scores, 0.6, "layer")
    assert per_layer["a"].sum() == 12 and per_layer["b"].sum() == 18
    kth = np.sort(scores["a"].numpy().reshape(-1))[11]
    assert (scores["a"].numpy()[per_layer["a"].numpy()] <= kth).all()


def test_clean_gradient_mask_is_the_bottom_k_of_the_gradient_on_the_clean_partition():
    rt = Runtime(scenario({"name": "neurotoxin", "attacker_ids": [1], "mask_ratio": 0.9}))
    job = job_for(rt)
    before = rt.layout.flatten_model(job.model).clone()
    mask = flat(rt.attack.gradient_mask(job))
    assert torch.equal(rt.layout.flatten_model(job.model), before)  # the global model is untouched
    # oracle: the same sum of per-batch mean losses, as one weighted loss over the whole partition
    idx = rt.partitions[1]
    x, y = torch.from_numpy(rt.data.x_train[idx]), torch.from_numpy(rt.data.y_train[idx])
    weights = torch.cat([torch.full((len(b),), 1.0 / len(b)) for b in torch.arange(len(y)).split(32)])
    losses = torch.nn.functional.cross_entropy(job.model(x), y, reduction="none")
    grads = torch.autograd.grad((weights * losses).sum(), list(job.model.parameters()))
    score = torch.cat([g.abs().reshape(-1) for g in grads]).double().numpy()
    k = int(len(score) * 0.9)
    assert mask.sum() == k
    kth = np.sort(score)[k - 1]
    tol = 1e-5 * max(kth, 1e-8)  # the two sums round differently: only near-ties at the boundary may differ
    assert mask[score < kth - tol].all() and not mask[score > kth + tol].any()
    assert (score[~mask] > 0).all()  # coordinates no clean input moves stay free for the backdoor


def test_global_update_mask_is_the_bottom_k_of_the_previous_global_update():
    attack = {"name": "neurotoxin", "attacker_ids": [1], "mask_ratio": 0.8, "mask_source": "global_update"}
    rt = Runtime(scenario(attack))
    first = job_for(rt)
    fallback = flat(rt.attack.gradient_mask(first))  # nothing remembered yet: the clean gradient
    rt_clean = Runtime(scenario({**attack, "mask_source": "clean_gradient"}))
    np.testing.assert_array_equal(fallback, flat(rt_clean.attack.gradient_mask(job_for(rt_clean))))
    rt.attack.local_train(first)
    np.testing.assert_array_equal(first.memory[MEMORY_KEY], first.global_vec.numpy())  # remembered for next time
    update = torch.from_numpy(np.random.default_rng(3).normal(size=rt.layout.dim).astype(np.float32))
    job = job_for(rt, memory={MEMORY_KEY: (first.global_vec - update).numpy()}, rnd=5)
    mask = flat(rt.attack.gradient_mask(job))
    magnitude = np.abs(job.global_vec.numpy() - (first.global_vec - update).numpy())  # brute force: sort |Δθ|
    expected = np.zeros(rt.layout.dim, dtype=bool)
    expected[np.argsort(magnitude, kind="stable")[: int(rt.layout.dim * 0.8)]] = True
    np.testing.assert_array_equal(mask, expected)


# --------------------------------------------------------------------------- masked training
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_coordinates_outside_the_mask_never_move(momentum):
    rt = Runtime(scenario({"name": "neurotoxin", "attacker_ids": [1], "mask_ratio": 0.7,
                           "poison": {"name": "trigger", "size": 2}}))
    job = job_for(rt, momentum=momentum)
    mask = torch.from_numpy(flat(rt.attack.gradient_mask(job)))
    n, stats, info = rt.attack.local_train(job)
    delta = rt.layout.flatten_model(job.model) - job.global_vec
    assert n == len(rt.attack.training_set(rt, 1)[0]) == info["num_examples"] and stats["steps"] > 0
    assert (delta[~mask] == 0).all()  # bit for bit: no weight decay, momentum carries masked gradients only
    assert (delta[mask] != 0).float().mean() > 0.5
    # the hooks are gone: a later backward pass gives the masked coordinates their gradient again
    x, y = rt.attack.training_set(rt, 1)
    job.model.zero_grad()
    torch.nn.functional.cross_entropy(job.model(torch.from_numpy(x)), torch.from_numpy(y)).backward()
    grad = torch.cat([p.grad.reshape(-1) for p in job.model.parameters()])
    assert (grad[~mask] != 0).any()


def test_mask_ratio_one_is_the_unmasked_baseline():
    base = {"name": "neurotoxin", "attacker_ids": [1], "poison": {"name": "trigger", "size": 2}}
    rt = Runtime(scenario({**base, "mask_ratio": 1.0}))
    job = job_for(rt)
    assert rt.attack.gradient_mask(job) is None
    rt.attack.local_train(job)
    plain = job_for(rt)  # the same round trained by the plain trigger attacker's default loop
    rt.attack.poison.local_train(plain)
    assert torch.equal(rt.layout.flatten_model(job.model), rt.layout.flatten_model(plain.model))


def test_pgd_keeps_the_update_in_the_ball():
    base = {"name": "neurotoxin", "attacker_ids": [1], "poison": {"name": "trigger", "size": 2}, "lr": 0.5}
    rt_free = Runtime(scenario(base))
    free = job_for(rt_free)
    rt_free.attack.local_train(free)
    free_norm = torch.linalg.vector_norm(rt_free.layout.flatten_model(free.model) - free.global_vec)
    rt = Runtime(scenario({**base, "pgd_eps": 0.05}))
    job = job_for(rt)
    rt.attack.local_train(job)
    norm = torch.linalg.vector_norm(rt.layout.flatten_model(job.model) - job.global_vec)
    assert free_norm > 0.2 and norm <= 0.05 * (1 + 1e-5)


# --------------------------------------------------------------------------- nesting
def test_the_poison_supplies_data_and_test_set():
    rt = Runtime(scenario({"name": "neurotoxin", "attacker_ids": [2], "poison": "blended"}))  # a bare name
    from fedsim.attacks.blended import BlendedBackdoor

    assert isinstance(rt.attack.poison, BlendedBackdoor)
    own = BlendedBackdoor(rt.scenario.attack.poison)
    for a, b in zip(rt.attack.training_set(rt, 2), own.training_set(rt, 2)):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(rt.attack.backdoor_test_set(rt), own.backdoor_test_set(rt)):
        np.testing.assert_array_equal(a, b)
    assert rt.client_size(2, attacking=True) == len(own.training_set(rt, 2)[1])
    report = rt.attack.report(rt)
    assert report["poison"] == "blended" and report["mask_ratio"] == 0.95 and "alpha_train" in report
    assert not rt.attack.poisons_data_only()  # FedMA's layer-wise protocol refuses it


@pytest.mark.parametrize(
    "poison,needle",
    [
        ("neurotoxin", "cannot be neurotoxin itself"),
        ({"name": "alie"}, "alie is a server-side attack"),
        ("nosuch", "unknown attack.poison 'nosuch'"),
        ({"name": "trigger", "scale": "auto"}, "scale='auto'"),
        ({"name": "dba"}, "scale='auto'"),  # DBA scales by default: neurotoxin would drop it
        ({"name": "edge_case", "mode": "pgd"}, "mode='pgd'"),
        ({"name": "trigger", "num_attackers": 3}, "attack.poison.num_attackers is neurotoxin's own setting"),
        ({"name": "trigger", "schedule": {"name": "every_round"}}, "attack.poison.schedule"),
        ({"name": "trigger", "lr": 0.5, "local_epochs": 2}, "attack.poison.local_epochs, attack.poison.lr are"),
        ({"name": "trigger", "size": 0}, "size"),  # the nested spec is validated like any attack
        (3, "attack name or a mapping"),
    ],
)
def test_bad_poisons_are_refused_with_a_reason(poison, needle):
    with pytest.raises(ScenarioError, match="attack.neurotoxin.poison") as err:
        scenario({"name": "neurotoxin", "poison": poison})
    assert needle in str(err.value)


def test_neurotoxin_spec_round_trips_through_its_dump():
    spec = scenario({"name": "neurotoxin", "num_attackers": 2, "mask_scope": "layer",
                     "poison": {"name": "dba", "scale": 1, "bar_cols": [[0, 1], [4, 5]]}}).attack
    again = scenario(spec.model_dump(mode="json")).attack
    assert again == spec and again.poison.name == "dba" and again.poison.num_attackers == 4
    from fedsim.attacks.blended import BlendedParams
    from fedsim.attacks.neurotoxin import NeurotoxinParams

    assert NeurotoxinParams(poison=BlendedParams(alpha_train=0.3)).poison.name == "blended"  # a bare parameter model


def test_fedsim_validate_output_loads_back_unchanged(tmp_path, capsys):
    raw = {"name": "nt", "data": {"dataset": "digits"}, "model": {"name": "mlp", "hidden": [16]},
           "federation": {"num_clients": 6, "clients_per_round": 3, "rounds": 2},
           "attack": {"name": "neurotoxin", "num_attackers": 2, "schedule": {"name": "every_round"}, "lr": 0.05,
                      "poison": {"name": "trigger", "size": 2, "target_class": 3}}}
    given = tmp_path / "given.yaml"
    given.write_text(yaml.safe_dump(raw))
    assert main(["validate", str(given)]) == 0
    printed = capsys.readouterr().out
    dumped = yaml.safe_load(printed)["attack"]["poison"]
    assert dumped["name"] == "trigger" and not set(OUTER_FIELDS) & set(dumped)  # the poison's unused fields left out
    resolved = tmp_path / "resolved.yaml"
    resolved.write_text(printed)
    assert load_scenario(resolved) == load_scenario(given)


def test_poison_fields_of_the_attack_itself_are_accepted_at_their_default():
    # a resolved scenario from before they were left out of the dump names them, at their defaults
    spec = scenario({"name": "neurotoxin", "poison": {"name": "dba", "scale": 1}}).attack
    full = {**spec.poison.model_dump(mode="json"), "num_attackers": 4, "attacker_ids": None,
            "schedule": {"name": "fixed_frequency"}, "local_epochs": None, "lr": None}
    assert scenario({"name": "neurotoxin", "poison": full}).attack == spec


@pytest.mark.parametrize("field,value", [("mask_ratio", 0), ("mask_ratio", 1.5), ("pgd_eps", 0), ("mask_source", "x")])
def test_neurotoxin_bad_parameters_are_named(field, value):
    with pytest.raises(ScenarioError, match=f"attack.neurotoxin.{field}"):
        scenario({"name": "neurotoxin", field: value})


# --------------------------------------------------------------------------- through the ClientApp and the simulation
def test_an_attacker_round_through_local_update_moves_only_masked_coordinates():
    attack = {"name": "neurotoxin", "attacker_ids": [1], "mask_ratio": 0.6, "poison": {"name": "trigger", "size": 2}}
    rt = Runtime(scenario(attack, local_epochs=2))
    global_vec = rt.initial_weights()
    out = local_update(rt, 1, global_vec, 1, {"server-round": 1})
    delta, n = out[0], out[1]
    mask = torch.from_numpy(flat(rt.attack.gradient_mask(job_for(rt))))  # the same global model: the same mask
    assert n == len(rt.attack.training_set(rt, 1)[1])
    assert (delta[~mask] == 0).all() and (delta[mask] != 0).any()
    honest = local_update(rt, 0, global_vec, 1, {"server-round": 1})[0]
    assert (honest[~mask] != 0).any()  # an honest client is not masked


def run(tmp_path, attack):
    done = run_local(scenario(attack, num_clients=5, clients_per_round=3), tmp_path)
    return done.rounds, done.summary


EVERY = {"name": "every_round"}


@pytest.mark.parametrize(
    "attack",
    [
        {"name": "neurotoxin", "schedule": EVERY, "poison": {"name": "trigger", "size": 2}},
        {"name": "neurotoxin", "schedule": EVERY, "mask_source": "global_update", "pgd_eps": 1.0, "poison": "blended"},
    ],
    ids=["neurotoxin_trigger", "neurotoxin_blended_pgd"],
)
def test_short_run_on_digits(tmp_path, attack):
    rounds, summary = run(tmp_path, attack)
    assert [r["round"] for r in rounds] == [1, 2]
    assert all(len(r["attackers"]) == 1 for r in rounds)
    assert all(0.0 <= r["backdoor_success"] <= 1.0 for r in rounds)
    assert summary["attack"]


@pytest.mark.slow  # building the digits edge-case set (its density check) takes ~20 s on a loaded 2-core machine
def test_short_run_with_an_edge_case_poison(tmp_path):
    attack = {"name": "neurotoxin", "schedule": EVERY, "poison": {"name": "edge_case", "num_edge": 20, "num_clean": 20}}
    rounds, summary = run(tmp_path, attack)
    assert [r["round"] for r in rounds] == [1, 2] and all(len(r["attackers"]) == 1 for r in rounds)
    assert all(0.0 <= r["backdoor_success"] <= 1.0 for r in rounds)
    assert summary["attack"]["poison"] == "edge_case" and summary["attack"]["edge_test"] > 0
