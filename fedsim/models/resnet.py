"""CIFAR ResNets with BatchNorm, registered by YAML name.

- `resnet18`: the CIFAR variant of BackFed and FLPoison (kuangliu/pytorch-cifar): a 3x3 stride-1
  conv stem with no max-pool, BasicBlocks [2, 2, 2, 2] at 64/128/256/512 channels, 1x1-conv +
  BN projection shortcuts where the shape changes, global average pool, FC 512→classes.
  11,173,962 parameters on CIFAR-10.
- `resnet20`: He et al. 2016 §4.2's CIFAR ResNet (6n+2 layers, n = 3): 16/32/64 channels, 3 stages
  of 3 BasicBlocks, with the paper's parameter-free option-A shortcut (stride-2 subsampling and zero
  padding of the new channels): 269,722 parameters on CIFAR-10. `shortcut: B` uses 1x1 conv + BN
  projections at the two stage changes instead: 272,474 (the count often quoted). Chosen over ResNet-9 because it is
  the paper's own model, has an exact published parameter count to test against, and is small
  enough (0.27M) for CPU simulations.

Their BatchNorm running statistics travel with the update; see docs/models.md and layout.py.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from torch import nn
from torch.nn import functional as F

from fedsim.registry import MODELS, Params


class BasicBlock(nn.Module):
    """Two 3x3 conv + BN layers with a residual connection; `shortcut` is "B" (1x1 conv + BN where
    the shape changes, ResNet-18) or "A" (subsample and zero-pad, no parameters, ResNet-20)."""

    def __init__(self, c_in: int, c_out: int, stride: int, shortcut: str) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.pad = 0
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            if shortcut == "B":
                self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))
            else:  # option A: x[:, :, ::2, ::2] with the extra channels zero, split evenly on both sides
                if stride != 2 or (c_out - c_in) % 2:
                    raise ValueError(f"option-A shortcut needs stride 2 and an even channel increase, got {c_in}->{c_out}")
                self.pad = (c_out - c_in) // 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.pad:
            skip = F.pad(x[:, :, ::2, ::2], (0, 0, 0, 0, self.pad, self.pad))
        else:
            skip = self.shortcut(x)
        return F.relu(out + skip)


class CifarResNet(nn.Module):
    """Conv stem → stages of BasicBlocks (the first block of every stage but the first has stride 2)
    → global average pool → `classifier`. `features(x)` is the classifier's input."""

    def __init__(self, in_channels: int, num_classes: int, widths: tuple[int, ...], blocks: tuple[int, ...],
                 shortcut: str) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, widths[0], 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        stages, c = [], widths[0]
        for i, (w, n) in enumerate(zip(widths, blocks)):
            layers = []
            for j in range(n):
                layers.append(BasicBlock(c, w, 2 if (i > 0 and j == 0) else 1, shortcut))
                c = w
            stages.append(nn.Sequential(*layers))
        self.stages = nn.Sequential(*stages)
        self.classifier = nn.Linear(c, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(F.relu(self.bn1(self.conv1(x))))
        return torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def _image_channels(name: str, input_shape: tuple[int, ...]) -> int:
    if len(input_shape) != 3:
        raise ValueError(f"{name} needs image inputs [C, H, W], got {input_shape}")
    return int(input_shape[0])


class ResNetParams(Params):
    pass


class ResNet20Params(Params):
    shortcut: Literal["A", "B"] = Field("A", description="A: the paper's parameter-free shortcut (269,722 params); "
                                        "B: 1x1 conv + BN projection (272,474)")


@MODELS.register("resnet18", ResNetParams)
def resnet18(input_shape: tuple[int, ...], num_classes: int, params: ResNetParams) -> nn.Module:
    """CIFAR ResNet-18 of BackFed/FLPoison: 3x3 stem, no max-pool, [2, 2, 2, 2] BasicBlocks, BatchNorm."""
    return CifarResNet(_image_channels("resnet18", input_shape), num_classes, (64, 128, 256, 512), (2, 2, 2, 2), "B")


@MODELS.register("resnet20", ResNet20Params)
def resnet20(input_shape: tuple[int, ...], num_classes: int, params: ResNet20Params) -> nn.Module:
    """He et al.'s CIFAR ResNet-20: 3 stages of 3 BasicBlocks at 16/32/64 channels, BatchNorm, option-A shortcuts."""
    return CifarResNet(_image_channels("resnet20", input_shape), num_classes, (16, 32, 64), (3, 3, 3), params.shortcut)
