"""DarkFed (issue #37): the compression walk against a brute-force walk, Brown's forecast on a
linear trend, the cos² mimicry term, the data-free property, and a short digits run whose
backdoor success beats the clean model's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import attacked_and_clean, quick_scenario

from fedsim.attacks.base import AttackerRound
from fedsim.attacks.darkfed import (
    brown_forecast, compress, cosine_lrs, mimicry_loss, output_layer, smooth, target_vector,
)
from fedsim.runtime import Runtime
from fedsim.scenario import ScenarioError
from fedsim.training import TrainConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")
MLP = {"name": "mlp", "hidden": [32]}
FED = {"num_clients": 6, "clients_per_round": 6, "rounds": 3, "local_epochs": 1, "batch_size": 32, "lr": 0.1, "momentum": 0.9}


def runtime(**attack) -> Runtime:
    return Runtime(quick_scenario(model=MLP, attack={"name": "darkfed", "attacker_ids": [1, 3], "shadow_size": 400,
                                                      "target_class": 0, **attack}))


def job(rt, pid=3, memory=None, rnd=1):
    model = rt.build_model()
    vec = rt.initial_weights()  # the same seeded global model every time
    rt.layout.load_into(model, vec)
    return AttackerRound(rt, pid, rnd, model, vec, rt.layout, TrainConfig(1, 32, 0.1), 7, {}, {} if memory is None else memory)


def test_compression_is_the_official_greedy_walk():
    rng = np.random.default_rng(0)
    x, z = rng.normal(size=(10, 1, 2, 2)).astype(np.float32), rng.normal(size=(10, 3)).astype(np.float32)
    got = compress(x, z, batch_size=5, ratio=0.6, seed=4)
    starts = np.random.default_rng(4)
    expected = []
    for b in range(2):  # brute force: loops over rows, as select_img
        xb = x[5 * b : 5 * b + 5].reshape(5, -1)
        zb = z[5 * b : 5 * b + 5]
        co = np.array([[(xb[i] @ xb[j]) / np.linalg.norm(xb[i]) / np.linalg.norm(xb[j])
                        * (zb[i] @ zb[j]) / np.linalg.norm(zb[i]) / np.linalg.norm(zb[j]) for j in range(5)] for i in range(5)])
        i = int(starts.integers(5))
        for _ in range(3):
            i = int(np.argmin(co[i]))
            expected.append(5 * b + i)
            co[:, i] = 1.0
    assert got.tolist() == expected and len(set(got.tolist())) == 6


def test_brown_forecast_is_exact_on_a_linear_trend_in_steady_state():
    a, b, alpha = torch.tensor([1.0, -2.0]), torch.tensor([0.5, 0.25]), 0.8
    lag = (1 - alpha) / alpha
    s1, s2 = a - b * lag, a - 2 * b * lag  # the smoothed levels of θ_t = a + b·t at t = 0
    for t in range(1, 4):  # the official update keeps them in steady state
        s1, s2 = smooth(s1, s2, a + b * t, alpha)
        assert torch.allclose(brown_forecast(s1, s2, alpha), a + b * (t + 1), atol=1e-5)


def test_target_vector_and_lr_schedule():
    z = target_vector(10, 8, 10.0)
    assert z[8] == 10 and torch.allclose(z[torch.arange(10) != 8], torch.tensor(-1.0))
    lrs = cosine_lrs(0.005, 2)
    assert lrs[0] == pytest.approx(0.005) and lrs[1] == pytest.approx(0.0025, rel=1e-6)


def test_mimicry_term_makes_the_update_orthogonal_to_the_others():
    """With the plain update itself as the 'other' update (cos² = 1), the cos² term turns the update away from it."""
    from fedsim.attacks.darkfed import train_fake_client

    rt = runtime(collude=False)
    names = output_layer(rt.build_model())

    def update(weight, others):
        k = job(rt)
        p = rt.attack.params.model_copy(update={"cosine_weight": weight, "poison_epochs": 4, "lr": 0.05})
        x, logits = rt.attack.shadow(k)
        train_fake_client(k.model, x, logits, k.global_vec, k.layout, rt.attack.mask(rt), 1.0, target_vector(10, 0, 10.0),
                          others, p, 32, 5)
        upd = k.layout.unflatten(k.layout.flatten_model(k.model) - k.global_vec)
        return torch.cat([upd[n].reshape(-1) for n in names]).detach()

    plain = update(0.0, [])
    assert float(mimicry_loss(update(0.0, [plain]), [plain])) == pytest.approx(1.0)  # weight 0: the same training
    assert float(mimicry_loss(update(50.0, [plain]), [plain])) < 0.5


def test_data_free_the_partition_is_never_read():
    rt, other = runtime(), runtime()
    idx = other.partitions[3]
    other.data.x_train[idx] = np.random.default_rng(0).random(other.data.x_train[idx].shape).astype(np.float32)
    a, b = job(rt), job(other)
    rt.attack.local_train(a)
    other.attack.local_train(b)
    assert torch.equal(rt.layout.flatten_model(a.model), other.layout.flatten_model(b.model))
    assert set(a.memory) == {"shadow_index", "shadow_logits", "s1"}


def test_the_second_round_uses_the_smoothed_forecast_and_keeps_the_shadow_set():
    rt = runtime()
    first = job(rt)
    rt.attack.local_train(first)
    memory = dict(first.memory)
    second = job(rt, memory=memory, rnd=2)
    second.global_vec = second.global_vec + 0.01
    rt.layout.load_into(second.model, second.global_vec)
    rt.attack.local_train(second)
    assert {"s1", "s2"} <= set(memory)
    np.testing.assert_array_equal(memory["shadow_index"], first.memory["shadow_index"])


@pytest.mark.parametrize("bad", [{"compress_ratio": 0}, {"smoothing": 1.0}, {"poison_prob": 1.5}])
def test_bad_parameters_are_named(bad):
    with pytest.raises(ScenarioError, match=f"attack.darkfed.{next(iter(bad))}"):
        quick_scenario(attack={"name": "darkfed", **bad})


def test_short_run_plants_a_backdoor_the_clean_model_lacks(tmp_path):
    attack = {"name": "darkfed", "attacker_ids": [1, 3], "shadow_size": 1500, "target_class": 0, "lr": 0.05,
              "poison_prob": 0.3, "schedule": {"name": "every_round"}}
    done, clean_asr = attacked_and_clean(tmp_path, attack, model=MLP, federation=FED)
    assert all(r["attackers"] for r in done.rounds), [r["attackers"] for r in done.rounds]
    assert min(r["backdoor_success"] for r in done.rounds) > clean_asr + 0.2
