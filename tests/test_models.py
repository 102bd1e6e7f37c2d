"""The models and the flat layout (fedsim/models/layout.py): a model flattens to one vector and loads
back bit for bit, and each model takes its dataset's inputs. The ResNets, LSTMs and BatchNorm buffers
are in test_models_bn.py."""

from __future__ import annotations

import torch

from fedsim.models.layout import ModelLayout
from fedsim.registry import MODELS


def test_layout_round_trip():
    model = MODELS.get("lenet").obj((1, 28, 28), 10, MODELS.get("lenet").params())
    layout = ModelLayout.of(model)
    vec = layout.flatten_model(model)
    assert vec.shape == (1_199_882,) and layout.dim == 1_199_882  # the PyTorch MNIST example net
    model2 = MODELS.get("lenet").obj((1, 28, 28), 10, MODELS.get("lenet").params())
    layout.load_into(model2, vec)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), model2.state_dict().values()))
    assert torch.equal(layout.unflatten(vec)["fc2.bias"], model.fc2.bias.detach())


def test_models_forward_on_their_inputs():
    for name, shape in [("mlp", (1, 8, 8)), ("lenet", (1, 28, 28)), ("vgg9", (3, 32, 32))]:
        entry = MODELS.get(name)
        out = entry.obj(shape, 10, entry.params())(torch.zeros(2, *shape))
        assert out.shape == (2, 10)
