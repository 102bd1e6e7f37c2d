"""3DFed (issue #37): the feedback reading and the adaptive tuning on hand-made cases, the noise
masks cancelling in their group's sum, the indicators planted and read back, the state kept
across rounds and through state_dict, and a short digits run whose backdoor success beats the
clean model's."""

from __future__ import annotations

import pytest
import torch
from conftest import attacked_and_clean, quick_scenario, round_context

from fedsim.attacks.threedfed import ThreeDFedParams, adaptive_tuning, group_masks, pick_indicators, read_feedback
from fedsim.runtime import Runtime
from fedsim.scenario import ScenarioError
from fedsim.server.tools import ServerTools

pytestmark = pytest.mark.usefixtures("one_torch_thread")
MLP = {"name": "mlp", "hidden": [32]}
FED = {"num_clients": 6, "clients_per_round": 6, "rounds": 3, "local_epochs": 1, "batch_size": 32, "lr": 0.1, "momentum": 0.9}


def test_feedback_reads_rejected_clipped_accepted_and_weak_dp():
    g = torch.tensor([0.0, 0.05, 0.1, 0.0])
    idx, val = torch.tensor([0, 1, 2]), torch.tensor([1.0, 1.0, 1.0])
    assert read_feedback(g, idx, val, 1e-4, 0.8) == (["r", "c", "a"], False)
    assert read_feedback(torch.tensor([0.0, 2.0, 0.1]), idx, val, 1e-4, 0.8)[1] is True  # above 1: noise
    assert read_feedback(torch.tensor([0.0, -0.5, 0.1]), idx, val, 1e-4, 0.8)[1] is True  # negative: noise


def test_adaptive_tuning_follows_the_official_rules():
    fixed = iter([0.3, 0.6, 0.7, 0.8])
    draw = lambda a, b: next(fixed)  # noqa: E731
    # nothing accepted, no decoy accepted: one more decoy; two groups, none accepted: redrawn
    alpha, k = adaptive_tuning(["r", "r", "r", "r"], [0.5, 0.5], 0, False, 4, 2, 0.0, draw)
    assert k == 1 and alpha == [0.3, 0.6]
    # an accepted decoy is spent; group 0 accepted: the others drawn near its alpha (here the fixed draws)
    asked = []
    alpha, k = adaptive_tuning(["a", "a", "r", "r", "a"], [0.2, 0.9], 2, False, 4, 2, 0.0,
                               lambda a, b: asked.append((a, b)) or (a + b) / 2)
    assert k == 1 and asked == [(0.2, pytest.approx(0.3))] * 2 and alpha == [pytest.approx(0.25)] * 2
    alpha, k = adaptive_tuning([], [0.4, 0.5], 3, True, 4, 2, 0.0, draw)
    assert alpha == [0.1, 0.1] and k == 3  # weak DP: α fixed, tuning off


def test_indicators_are_flat_low_update_coordinates():
    analog = torch.tensor([5.0, 0.1, 0.2, 0.3, 0.05, 9.0])
    curv = torch.tensor([0.0, 3.0, 0.0, 1.0, 2.0, 0.0])
    # the 2·2 = 4 smallest analog: 4, 1, 2, 3; of those the smallest |curvature|: 2 (0.0), then 3 (1.0)
    assert pick_indicators(analog, curv, 2, 2).tolist() == [2, 3]


def test_noise_masks_cancel_in_the_group_and_raise_low_update_neurons():
    p = ThreeDFedParams(group_size=3)
    g = torch.Generator().manual_seed(0)
    w, b = torch.zeros(10, 6), torch.zeros(10)
    neurons = torch.tensor([1, 4, 7])
    masks, lam = group_masks(w, b, neurons, 0.9, 3, p, 0.05, g)
    total = torch.stack(masks).sum(0)[neurons]
    single = torch.stack([m[neurons].norm() for m in masks])
    assert total.norm() < 0.25 * single.min() and lam > 1.0  # the Lagrangian pulls the group sum towards zero
    assert all(m[neurons].abs().sum(1).min() > 0 for m in masks)


def tools_for(rt):
    def model_of(vec):
        m = rt.build_model()
        rt.layout.load_into(m, vec)
        return m
    return ServerTools(rt, model_of)


def test_rounds_plant_indicators_and_read_them_back_and_the_state_survives_a_checkpoint():
    rt = Runtime(quick_scenario(model=MLP, attack={"name": "threedfed", "attacker_ids": [1, 2, 4], "size": 2,
                                                   "target_class": 0, "poison_epochs": 2}))
    attack, tools = rt.attack, tools_for(rt)
    vec = rt.initial_weights()
    honest = torch.zeros(3, rt.layout.dim)
    out = attack.craft(honest, 3, round_context(global_weights=vec, layout=rt.layout, rnd=1, tools=tools))
    assert out.rows.shape == (3, rt.layout.dim)
    for i in range(3):  # each row carries its planted indicator value
        assert float(out.rows[i, attack.index[i]]) == pytest.approx(float(attack.value[i]))
    ids = attack.index.tolist()
    assert len(set(ids)) == 3
    # a server that keeps only row 0 (a choosing rule): row 0 reads accepted, the others rejected
    new = vec + out.rows[0] / 3
    saved = attack.state_dict()
    again = type(attack)(attack.params)
    again.load_state_dict(saved)
    out2 = again.craft(honest, 3, round_context(global_weights=new, layout=rt.layout, rnd=2, tools=tools))
    assert out2.log["acceptance"][0] == "a" and out2.log["acceptance"][1:] == "rr"
    # nothing accepted: a decoy row appears the round after
    out3 = again.craft(honest, 3, round_context(global_weights=new.clone(), layout=rt.layout, rnd=3, tools=tools))
    assert out3.log["acceptance"] == "rrr" and again.k == 1 and out3.log["decoys"] == 1


@pytest.mark.parametrize("bad", [{"group_size": 0}, {"clip_ratio": 1.0}, {"max_scale": 0.5}])
def test_bad_parameters_are_named(bad):
    with pytest.raises(ScenarioError, match=f"attack.threedfed.{next(iter(bad))}"):
        quick_scenario(attack={"name": "threedfed", **bad})


def test_short_run_plants_a_backdoor_the_clean_model_lacks(tmp_path):
    attack = {"name": "threedfed", "attacker_ids": [1, 3], "target_class": 0, "size": 2, "poison_epochs": 5,
              "schedule": {"name": "every_round"}}
    done, clean_asr = attacked_and_clean(tmp_path, attack, checkpoints=True, model=MLP, federation=FED)
    assert all(r["attackers"] for r in done.rounds)
    assert min(r["backdoor_success"] for r in done.rounds) > clean_asr + 0.2
    assert "acceptance" in done.rounds[1]["attack"]  # the feedback was read in round 2
