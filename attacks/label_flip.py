"""Label flipping (Tolpegin et al., ESORICS 2020; the NDSS'21 baselines), §5.2 of the reference.

The attacker trains on its own partition with flipped labels, a pure data-poisoning attack:

* `all` (untargeted): every label y becomes C - 1 - y.
* `targeted`: only `source_class` samples become `target_class` (Tolpegin et al. flip one class
  into another; 7 -> 1 here, the confusable digit pair also used by the edge-case attack).

Success is measured like a backdoor: for `all`, the share of test images predicted as their
flipped label (with an odd class count the middle class maps to itself and is left out); for
`targeted`, the share of source-class test images predicted as the target.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import Field, model_validator

from fedsim.attacks.trigger import PartitionPoisoner, PoisonParams, check_class
from fedsim.registry import ATTACKS


class LabelFlipParams(PoisonParams):
    mode: Literal["all", "targeted"] = Field("all", description="all: y -> C-1-y; targeted: source_class -> target_class only")
    source_class: int = Field(7, ge=0, description="class relabelled in targeted mode")
    target_class: int = Field(1, ge=0, description="label source_class samples get in targeted mode")

    @model_validator(mode="after")
    def _distinct(self) -> "LabelFlipParams":
        if self.mode == "targeted" and self.source_class == self.target_class:
            raise ValueError(f"attack.source_class and attack.target_class must differ (both {self.source_class})")
        return self


def flip_labels(y: np.ndarray, num_classes: int, mode: str, source: int, target: int) -> np.ndarray:
    """The flipped copy of labels `y`."""
    if mode == "all":
        return (num_classes - 1 - y).astype(y.dtype)
    return np.where(y == source, target, y).astype(y.dtype)


@ATTACKS.register("label_flip", LabelFlipParams)
class LabelFlip(PartitionPoisoner):
    """Label flipping: the attacker trains on its partition with labels flipped (all or source->target)."""

    def check(self, runtime) -> None:
        if self.params.mode == "targeted":
            check_class(self.params.source_class, runtime, "attack.source_class")
            check_class(self.params.target_class, runtime, "attack.target_class")

    def flip(self, runtime, y: np.ndarray) -> np.ndarray:
        p = self.params
        return flip_labels(y, runtime.data.num_classes, p.mode, p.source_class, p.target_class)

    def poison(self, runtime, partition_id, x, y):
        self.check(runtime)
        return x, self.flip(runtime, y)

    def backdoor_test_set(self, runtime):
        self.check(runtime)
        y = runtime.data.y_test
        flipped = self.flip(runtime, y)
        keep = flipped != y  # targeted: the source class; all: every class but an odd C's middle one
        return runtime.data.x_test[keep], flipped[keep]

    def report(self, runtime) -> dict:
        flipped = {}
        for pid in runtime.attackers:
            y = runtime.data.y_train[runtime.partitions[pid]]
            flipped[pid] = int((self.flip(runtime, y) != y).sum())
        return {"mode": self.params.mode, "flipped_per_attacker": flipped}
