"""F3BA (issue #37): candidate selection by brute force, the focused flip's sign property, the
trigger search raising the activation gap, memory across rounds, and a short digits run whose
backdoor success beats the clean model's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import attacked_and_clean, quick_scenario

from fedsim.attacks.base import AttackerRound
from fedsim.attacks.f3ba import candidate_mask, first_activation, flip_filters, flip_neurons
from fedsim.runtime import Runtime
from fedsim.scenario import ScenarioError
from fedsim.training import TrainConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")
FED = {"num_clients": 6, "clients_per_round": 6, "rounds": 3, "local_epochs": 1, "batch_size": 32, "lr": 0.1, "momentum": 0.9}


def runtime(model=None, **attack) -> Runtime:
    return Runtime(quick_scenario(model=model or {"name": "mlp", "hidden": [32]},
                                  attack={"name": "f3ba", "attacker_ids": [1], "target_class": 0, "size": 2, **attack}))


def job(rt, memory=None, rnd=1):
    model = rt.build_model()
    vec = rt.initial_weights()
    rt.layout.load_into(model, vec)
    return AttackerRound(rt, 1, rnd, model, vec, rt.layout, TrainConfig(1, 32, 0.1), 7, {}, {} if memory is None else memory)


def test_candidates_are_the_smallest_movement_times_weight():
    g = torch.Generator().manual_seed(0)
    w, prev = torch.randn(20, 5, generator=g), torch.randn(20, 5, generator=g)
    c = candidate_mask(w, prev, 0.1)
    s = ((w - prev) * w).reshape(-1).numpy()
    expected = s < np.sort(s)[10]  # brute force: below the value at sorted position int(100·0.1)
    np.testing.assert_array_equal(c.reshape(-1).numpy().astype(bool), expected)
    assert c.sum() == 10


def test_focused_flip_gives_candidates_the_pattern_sign_and_keeps_magnitudes():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(4, 2, 3, 3, generator=g)
    mask = (torch.rand(4, 2, 3, 3, generator=g) < 0.5).float()
    pattern = torch.randn(2, 3, 3, generator=g)  # already kernel-sized: the resize keeps it
    out = flip_filters(w, mask, pattern, 1.0)
    assert torch.equal(out[mask == 0], w[mask == 0]) and torch.allclose(out.abs(), w.abs())
    p = (pattern - pattern.min()) / (pattern.max() - pattern.min())
    scaled = p * (w.amax(dim=(1, 2, 3), keepdim=True) - w.amin(dim=(1, 2, 3), keepdim=True)) + w.amin(dim=(1, 2, 3), keepdim=True)
    assert torch.equal(torch.sign(out)[mask == 1], torch.sign(scaled)[mask == 1])
    lin = flip_neurons(w[:, 0, 0], mask[:, 0, 0], pattern[0, 0])
    assert torch.allclose(lin[mask[:, 0, 0] == 1].abs(), w[:, 0, 0][mask[:, 0, 0] == 1].abs())


@pytest.mark.parametrize("model", [{"name": "mlp", "hidden": [32]}, {"name": "lenet"}])
def test_the_trigger_search_widens_the_first_layer_gap_and_stays_in_range(model):
    rt = runtime(model, trigger_epochs=2)
    j = job(rt, memory={"previous_global": (rt.initial_weights() * 0.9).numpy()})
    start = rt.attack.initial_trigger(rt)
    rt.attack.local_train(j)
    t = j.memory["trigger"]
    mask = rt.attack.mask(rt)
    assert (t[:, ~mask] == start[:, ~mask]).all() and (t >= 0).all() and (t <= 1).all() and (t != start).any()
    fresh = rt.build_model()
    rt.layout.load_into(fresh, rt.initial_weights())
    x = torch.from_numpy(rt.data.x_train[rt.partitions[1]])
    gap = lambda trig: float(((first_activation(fresh, torch.where(torch.from_numpy(mask), torch.from_numpy(trig), x))  # noqa: E731
                               - first_activation(fresh, x)) ** 2).sum())
    assert j.memory["handcraft_rounds"].tolist() == [1]
    np.testing.assert_array_equal(j.memory["previous_global"], j.global_vec.numpy())
    assert gap(t) > gap(start)  # the ascent widened the activation gap the trigger makes


def test_handcrafting_changes_only_candidate_weights_of_the_hidden_layers():
    rt = runtime(trigger_epochs=0, local_epochs=1)
    previous = (rt.initial_weights() + 0.05 * torch.randn(rt.layout.dim, generator=torch.Generator().manual_seed(3)))
    j = job(rt, memory={"previous_global": previous.numpy()})
    model = j.model
    cand = rt.attack.candidates(model, rt.layout.unflatten(previous))
    rt.attack._box = rt.attack.box(rt)
    before = {n: q.detach().clone() for n, q in model.named_parameters()}
    x = torch.from_numpy(rt.data.x_train[rt.partitions[1]])
    rt.attack.handcraft(model, cand, torch.from_numpy(rt.attack.initial_trigger(rt)), x, torch.from_numpy(rt.attack.mask(rt)), True)
    after = dict(model.named_parameters())
    names = [n for n in before if n.endswith("weight")]
    for n in names[:-1]:
        layer = n.rsplit(".", 1)[0]
        changed = before[n] != after[n]
        assert not changed[cand[layer] == 0].any()
    assert torch.equal(before[names[-1]], after[names[-1]])  # the output layer is left alone


def test_bad_parameters_are_named():
    for bad in ({"conv_rate": 1.0}, {"handcraft_share": 0}, {"neuron_every": 0}):
        with pytest.raises(ScenarioError, match=f"attack.f3ba.{next(iter(bad))}"):
            quick_scenario(attack={"name": "f3ba", **bad})


def test_short_run_plants_a_backdoor_the_clean_model_lacks(tmp_path):
    attack = {"name": "f3ba", "attacker_ids": [1, 3], "target_class": 0, "size": 2, "schedule": {"name": "every_round"}}
    model = {"name": "mlp", "hidden": [32]}
    done, clean_asr = attacked_and_clean(tmp_path, attack, model=model, federation=FED)
    assert all(r["attackers"] for r in done.rounds)
    assert max(r["backdoor_success"] for r in done.rounds) > clean_asr + 0.05, [r["backdoor_success"] for r in done.rounds]
