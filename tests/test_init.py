"""Where the global model starts: seeded random init, central pre-training (cached), a checkpoint."""

from __future__ import annotations

import torch

from fedsim.runtime import Runtime
from fedsim.scenario import validate_scenario
from fedsim.training import evaluate


def accuracy(rt: Runtime, vec: torch.Tensor) -> float:
    model = rt.build_model()
    rt.layout.load_into(model, vec)
    return evaluate(model, rt.data.x_test, rt.data.y_test)["accuracy"]


def test_pretraining_helps_and_is_cached_exactly(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDSIM_CACHE_DIR", str(tmp_path))
    plain = Runtime(validate_scenario({}))
    pre = Runtime(validate_scenario({"init": {"pretrain_epochs": 2}}))
    w_plain, w_pre = plain.initial_weights(), pre.initial_weights()
    assert accuracy(pre, w_pre) > accuracy(plain, w_plain) + 0.3
    assert len(list(tmp_path.glob("pretrained-*.pt"))) == 1
    again = Runtime(validate_scenario({"init": {"pretrain_epochs": 2}})).initial_weights()
    assert torch.equal(again, w_pre)
    other_seed = Runtime(validate_scenario({"seed": 1, "init": {"pretrain_epochs": 2}})).initial_weights()
    assert not torch.equal(other_seed, w_pre) and len(list(tmp_path.glob("pretrained-*.pt"))) == 2


def test_checkpoint_is_loaded_as_weights_only(tmp_path):
    rt = Runtime(validate_scenario({"seed": 3}))
    model = rt.build_model()
    torch.nn.init.constant_(model[1].bias, 0.25)
    path = tmp_path / "model.pt"
    torch.save(model.state_dict(), path)
    loaded = Runtime(validate_scenario({"init": {"checkpoint": str(path)}})).initial_weights()
    assert torch.equal(loaded, rt.layout.flatten_model(model))
