"""The networks the papers use, registered by YAML name.

Every builder has the signature `build(input_shape, num_classes, params) -> nn.Module`.
"""

from __future__ import annotations

from math import prod

import torch
from pydantic import Field
from torch import nn

from fedsim.registry import MODELS, Params


class MlpParams(Params):
    hidden: list[int] = Field(default_factory=lambda: [64], description="hidden layer widths")


def _mlp_with(input_shape, num_classes, params, widths: tuple[int, ...]) -> nn.Module:
    return mlp(input_shape, num_classes, params.model_copy(update={"hidden": list(widths)}))


@MODELS.register("mlp", MlpParams, resize=_mlp_with)
def mlp(input_shape: tuple[int, ...], num_classes: int, params: MlpParams) -> nn.Module:
    """Fully connected ReLU network (for digits and tabular data)."""
    layers: list[nn.Module] = [nn.Flatten()]
    width = prod(input_shape)
    for h in params.hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        width = h
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


class LeNetParams(Params):
    dropout: bool = Field(True, description="the example net's dropout 0.25 / 0.5")


class LeNet(nn.Module):
    """The PyTorch MNIST example network that Attack of the Tails calls "LeNet" (§1.3).

    conv 1→32 3x3, ReLU; conv 32→64 3x3, ReLU; max-pool 2; dropout 0.25; FC →128, ReLU; dropout 0.5;
    FC 128→classes. On 28x28 inputs the first FC is 9216→128, as in `fl_trainer.Net`.
    """

    def __init__(
        self, input_shape: tuple[int, ...], num_classes: int, dropout: bool = True,
        widths: tuple[int, int, int] = (32, 64, 128),
    ) -> None:
        super().__init__()
        c, h, w = input_shape
        c1, c2, hidden = widths  # other widths only for FedMA's matched (grown) models
        self.conv1 = nn.Conv2d(c, c1, 3, 1)
        self.conv2 = nn.Conv2d(c1, c2, 3, 1)
        self.dropout1 = nn.Dropout(0.25 if dropout else 0.0)
        self.dropout2 = nn.Dropout(0.5 if dropout else 0.0)
        self.fc1 = nn.Linear(c2 * ((h - 4) // 2) * ((w - 4) // 2), hidden)
        self.fc2 = nn.Linear(hidden, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """The penultimate-layer embedding: what `fc2` receives (dropout included in train mode)."""
        x = torch.relu(self.conv1(x))
        x = torch.relu(self.conv2(x))
        x = self.dropout1(torch.flatten(torch.max_pool2d(x, 2), 1))
        return self.dropout2(torch.relu(self.fc1(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.features(x))


def _lenet_with(input_shape, num_classes, params, widths: tuple[int, ...]) -> nn.Module:
    if len(widths) != 3:
        raise ValueError(f"lenet has 3 hidden layers (conv1, conv2, fc1), got widths {widths}")
    return LeNet(input_shape, num_classes, params.dropout, widths)


@MODELS.register("lenet", LeNetParams, resize=_lenet_with)
def lenet(input_shape: tuple[int, ...], num_classes: int, params: LeNetParams) -> nn.Module:
    """PyTorch MNIST example CNN used as "LeNet" by Attack of the Tails (9216→128→10 on 28x28)."""
    if len(input_shape) != 3:
        raise ValueError(f"lenet needs image inputs [C, H, W], got {input_shape}")
    return LeNet(input_shape, num_classes, params.dropout)


class Vgg9Params(Params):
    pass


VGG9_CFG = (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M")


def _vgg9_with(input_shape, num_classes, params, widths: tuple[int, ...]) -> nn.Module:
    if len(widths) != 8:
        raise ValueError(f"vgg9 has 8 conv layers, got widths {widths}")
    return vgg9(input_shape, num_classes, params, widths)


@MODELS.register("vgg9", Vgg9Params, resize=_vgg9_with)
def vgg9(
    input_shape: tuple[int, ...], num_classes: int, params: Vgg9Params, widths: tuple[int, ...] | None = None
) -> nn.Module:
    """Attack of the Tails' VGG-9 for CIFAR-10: 8 3x3 convs, no BatchNorm, one FC 512→classes."""
    if len(input_shape) != 3 or input_shape[1] != 32 or input_shape[2] != 32:
        raise ValueError(f"vgg9 expects 32x32 images [C, 32, 32], got {input_shape}")
    convs = iter(widths or [v for v in VGG9_CFG if v != "M"])  # other widths only for FedMA
    layers: list[nn.Module] = []
    channels = input_shape[0]
    for v in VGG9_CFG:
        if v == "M":
            layers.append(nn.MaxPool2d(2, 2))
        else:
            width = next(convs)
            layers += [nn.Conv2d(channels, width, 3, padding=1), nn.ReLU(inplace=True)]
            channels = width
    layers += [nn.AvgPool2d(1, 1), nn.Flatten(), nn.Linear(channels, num_classes)]
    return nn.Sequential(*layers)


def head(model: nn.Module) -> nn.Module:
    """The classification layer of a registered net (mlp, lenet, vgg9 factorized or not; resnets, LSTMs): the
    last layer, which maps the penultimate embedding to the logits."""
    if isinstance(model, LeNet):
        return model.fc2
    if isinstance(model, nn.Sequential):
        return model[-1]
    if _has_classifier(model):  # resnet18/20, lstm, char_lstm
        return model.classifier
    raise TypeError(f"{type(model).__name__} is not one of the registered nets: no known head")


def features(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The penultimate-layer embedding of a registered net: the head's input, so that
    `model(x) == head(model)(features(model, x))`. Splits the forward pass without changing the
    models' parameters, their order or their state-dict keys."""
    if isinstance(model, LeNet) or _has_classifier(model):
        return model.features(x)
    if isinstance(model, nn.Sequential):
        return model[:-1](x)
    raise TypeError(f"{type(model).__name__} is not one of the registered nets: no known embedding")


def _has_classifier(model: nn.Module) -> bool:
    """The convention of the nets in resnet.py and recurrent.py: `features(x)` feeds `classifier`."""
    return isinstance(getattr(model, "classifier", None), nn.Linear) and callable(getattr(model, "features", None))


def resized(name: str, input_shape: tuple[int, ...], num_classes: int, params, widths: tuple[int, ...]) -> nn.Module:
    """The registered net `name` with other hidden widths (FedMA's matched layers may grow), by the
    `resize` its registration declares. `widths` are the output sizes of every layer but the last,
    in forward order."""
    resize = MODELS.get(name).traits.resize
    if resize is None:
        raise ValueError(f"model {name!r} cannot be resized; resizable: {resizable()}")
    return resize(input_shape, num_classes, params, tuple(int(w) for w in widths))


def resizable() -> list[str]:
    """The registered nets that declare a `resize` (FedMA can grow them)."""
    return [e.name for e in MODELS.entries() if e.traits.resize is not None]
