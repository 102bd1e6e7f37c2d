"""Pixel-pattern backdoors: BadNets-style `trigger` and the distributed backdoor `dba`.

Both attackers train on their own partition (never the extra data honest clients may get) with a
fixed, seeded share of it stamped with a trigger and relabelled to the target class, then may scale
the update up (model replacement, Bagdasaryan et al.). Success is measured on every non-target
test image stamped with the trigger, counted as a hit when the global model predicts the target.

* `trigger` (Gu et al., BadNets): one small pattern (square, plus or bars) in a corner.
* `dba` (Xie et al., ICLR 2020, §5.2 of the reference): the global trigger is a set of bars split
  into `num_pieces` local triggers; attacker k (its index among the sorted attackers) stamps only
  piece k mod num_pieces, and the test set carries the full global trigger (the union of pieces).

Stamping is one vectorised `np.where` over a boolean [H, W] mask; the stamped value defaults to
the largest value each channel takes in the training set, a white pixel after normalisation.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Annotated, Literal, Union

import numpy as np
import torch
from pydantic import Field, model_validator

from fedsim.attacks.base import AttackParams, ClientAttack
from fedsim.attacks.edge_case import replacement_factor
from fedsim.registry import ATTACKS, Params

Scale = Union[Annotated[float, Field(gt=0)], Literal["auto"]]


class PoisonParams(AttackParams):
    """What every partition-poisoning attacker has: its own training settings and an update scale."""

    scale: Scale = Field(
        1.0, description='factor on the attacker\'s update; "auto" = round examples / own examples (inverse FedAvg weight)'
    )
    local_epochs: int | None = Field(None, ge=1, description="attacker's epochs; default: federation.local_epochs")
    lr: float | None = Field(None, gt=0, description="attacker's lr; default: the honest clients' lr")


class PartitionPoisoner(ClientAttack):
    """An attacker that trains on its own partition, transformed by `poison`, and scales its update."""

    def training_set(self, runtime, partition_id: int) -> tuple[np.ndarray, np.ndarray]:
        def build() -> tuple[np.ndarray, np.ndarray]:
            idx = runtime.partitions[partition_id]
            return self.poison(runtime, partition_id, runtime.data.x_train[idx], runtime.data.y_train[idx])

        # the same every round: poisoned samples are chosen once
        return runtime.cached((type(self).__name__, "train", partition_id), build)

    @abstractmethod
    def poison(self, runtime, partition_id: int, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The attacker's training set made from its clean partition (x, y)."""

    def finish_update(self, delta: torch.Tensor, info: dict) -> torch.Tensor:
        return delta * update_scale(self.params.scale, info)

    def poisons_data_only(self) -> bool:
        return self.params.scale == 1.0


def update_scale(scale, info: dict) -> float:
    """The factor on the attacker's update: a number, or Γ = round total / own examples for "auto"."""
    if scale == "auto":
        return replacement_factor(info["round_total_examples"], info["num_examples"])
    return float(scale)


# --------------------------------------------------------------------------- masks and stamping
def trigger_mask(shape: tuple[int, int], pattern: str, size: int, location: str) -> np.ndarray:
    """Boolean [H, W] mask of a `size` x `size` pattern in a corner of an H x W image.

    square: the whole box; plus: its middle row and column (odd sizes); bars: every other column
    of the box, starting with its first.
    """
    h, w = shape
    if size > h or size > w:
        raise ValueError(f"a trigger of size {size} does not fit {h}x{w} images: lower attack.size to at most {min(h, w)}")
    r, c = np.ogrid[:size, :size]
    if pattern == "square":
        box = np.ones((size, size), dtype=bool)
    elif pattern == "plus":
        if size % 2 == 0:
            raise ValueError(f"the plus pattern needs an odd size, got {size}")
        box = (r == size // 2) | (c == size // 2)
    elif pattern == "bars":
        box = np.broadcast_to(c % 2 == 0, (size, size))
    else:
        raise ValueError(f"unknown trigger pattern {pattern!r}")
    if location not in ("bottom_right", "top_left"):
        raise ValueError(f"unknown trigger location {location!r}")
    r0, c0 = (0, 0) if location == "top_left" else (h - size, w - size)
    mask = np.zeros((h, w), dtype=bool)
    mask[r0 : r0 + size, c0 : c0 + size] = box
    return mask


def stamp(x: np.ndarray, mask: np.ndarray, value) -> np.ndarray:
    """A copy of images `x` ([N, C, H, W] or [C, H, W]) with the `mask` pixels set to `value`
    (a scalar, or one value per channel) in every channel; other pixels are untouched."""
    v = np.asarray(value, dtype=x.dtype)
    if v.ndim == 1:
        v = v[:, None, None]
    return np.where(mask, v, x)


def dba_pieces(shape: tuple[int, int], bar_rows, bar_cols, offset, num_pieces: int) -> np.ndarray:
    """Boolean [num_pieces, H, W] local triggers of DBA: horizontal bars at each row of `bar_rows`
    spanning each inclusive column range of `bar_cols`, shifted by `offset` (row, col).

    Bars are numbered row by row, (row0, cols0), (row0, cols1), (row1, cols0), ...; bar b belongs
    to piece b mod num_pieces, so with one bar per piece piece k is bar k.
    """
    h, w = shape
    dr, dc = offset
    rows = np.repeat(np.asarray(bar_rows) + dr, len(bar_cols))
    cols = np.tile(np.asarray(bar_cols).reshape(-1, 2) + dc, (len(bar_rows), 1))
    if rows.min() < 0 or rows.max() >= h:
        raise ValueError(
            f"DBA bar rows {sorted(set(rows.tolist()))} (attack.bar_rows + attack.offset[0]) do not fit "
            f"{h}-pixel-high images (rows 0..{h - 1}): change attack.bar_rows or attack.offset"
        )
    if cols.min() < 0 or cols.max() >= w:
        raise ValueError(
            f"DBA bar columns {cols.tolist()} (attack.bar_cols + attack.offset[1]) do not fit {w}-pixel-wide "
            f"images (columns 0..{w - 1}): change attack.bar_cols (e.g. [[0, 1], [4, 5]] for 8x8 digits) or attack.offset"
        )
    grid_r, grid_c = np.arange(h)[None, :, None], np.arange(w)[None, None, :]
    bars = (grid_r == rows[:, None, None]) & (grid_c >= cols[:, :1, None]) & (grid_c <= cols[:, 1:, None])
    owner = np.arange(len(bars)) % num_pieces
    return np.stack([bars[owner == k].any(axis=0) for k in range(num_pieces)])


def image_hw(runtime) -> tuple[int, int]:
    shape = runtime.data.x_train.shape
    if len(shape) != 4:
        raise ValueError(f"pixel triggers need image data [N, C, H, W]; {runtime.data.name} has inputs of shape {shape[1:]}")
    return shape[2], shape[3]


def trigger_value(runtime, value: float | None):
    """The stamped value: `value`, or each channel's largest training value (white after normalisation)."""
    if value is not None:
        return value
    return runtime.cached(("trigger", "pixel_max"), lambda: runtime.data.x_train.max(axis=(0, 2, 3)))


def choose_poisoned(n: int, fraction: float, seed: int, partition_id: int) -> np.ndarray:
    """Sorted indices of the round(fraction * n) samples an attacker poisons, drawn once per seed and client."""
    rng = np.random.default_rng([seed, 0xBAD, partition_id])
    return np.sort(rng.choice(n, size=int(round(fraction * n)), replace=False))


def check_class(target: int, runtime, field: str = "attack.target_class") -> None:
    if target >= runtime.data.num_classes:
        raise ValueError(f"{field}={target} is not a class of {runtime.data.name} (0..{runtime.data.num_classes - 1})")


def stamped_test_set(runtime, mask: np.ndarray, value, target: int) -> tuple[np.ndarray, np.ndarray]:
    """Every test image whose true label is not `target`, stamped, labelled `target`."""
    check_class(target, runtime)
    keep = runtime.data.y_test != target
    x = stamp(runtime.data.x_test[keep], mask, value)
    return x, np.full(len(x), target, dtype=np.int64)


class _PixelBackdoor(PartitionPoisoner):
    """Shared by `trigger` and `dba`: stamp a seeded share of the partition with this attacker's mask."""

    def fraction(self) -> float:
        return self.params.poison_fraction

    @abstractmethod
    def mask_for(self, runtime, partition_id: int) -> np.ndarray:
        """The [H, W] trigger mask this attacker stamps while training."""

    @abstractmethod
    def test_mask(self, runtime) -> np.ndarray:
        """The [H, W] trigger mask stamped on the backdoor test set."""

    def poisoned_rows(self, runtime, partition_id: int) -> np.ndarray:
        """Indices into the attacker's partition of the samples it stamps and relabels."""
        return choose_poisoned(len(runtime.partitions[partition_id]), self.fraction(), runtime.scenario.seed, partition_id)

    def poison(self, runtime, partition_id, x, y):
        check_class(self.params.target_class, runtime)
        rows = self.poisoned_rows(runtime, partition_id)
        value = trigger_value(runtime, self.params.value)
        x, y = x.copy(), y.copy()
        x[rows] = stamp(x[rows], self.mask_for(runtime, partition_id), value)
        y[rows] = self.params.target_class
        return x, y

    def backdoor_test_set(self, runtime):
        value = trigger_value(runtime, self.params.value)
        return stamped_test_set(runtime, self.test_mask(runtime), value, self.params.target_class)

    def report(self, runtime) -> dict:
        return {
            "target_class": self.params.target_class,
            "trigger_pixels": int(self.test_mask(runtime).sum()),
            "poisoned_per_attacker": {pid: len(self.poisoned_rows(runtime, pid)) for pid in runtime.attackers},
        }


# --------------------------------------------------------------------------- BadNets trigger
class PixelTrigger(Params):
    """The pixel pattern an attack stamps (`trigger_mask`): BadNets' and every attack that reuses its trigger."""

    pattern: Literal["square", "plus", "bars"] = Field("square", description="shape of the pixel pattern")
    size: int = Field(3, ge=1, description="side of the pattern's box in pixels (2 suits 8x8 digits)")
    location: Literal["bottom_right", "top_left"] = Field("bottom_right", description="corner of the pattern")
    value: float | None = Field(None, description="stamped pixel value; default: the training set's max per channel (white)")

    @model_validator(mode="after")
    def _odd_plus(self):
        if self.pattern == "plus" and self.size % 2 == 0:
            raise ValueError(f"the plus pattern needs an odd attack.size, got {self.size}")
        return self


class TriggerParams(PixelTrigger, PoisonParams):
    target_class: int = Field(0, ge=0, description="label the stamped inputs are given")
    poison_fraction: float = Field(
        0.5, gt=0, le=1, description="share of the attacker's partition stamped and relabelled (chosen once)"
    )


@ATTACKS.register("trigger", TriggerParams)
class TriggerBackdoor(_PixelBackdoor):
    """BadNets pixel-pattern backdoor: stamped inputs relabelled to a target class."""

    def test_mask(self, runtime) -> np.ndarray:
        p = self.params
        return trigger_mask(image_hw(runtime), p.pattern, p.size, p.location)

    def mask_for(self, runtime, partition_id: int) -> np.ndarray:
        return self.test_mask(runtime)


# --------------------------------------------------------------------------- DBA
class DBAParams(PoisonParams):
    num_attackers: int = Field(4, ge=1, description="DBA: one attacker per local trigger")
    target_class: int = Field(2, ge=0, description="label the stamped inputs are given (DBA: 2)")
    num_pieces: int = Field(4, ge=1, description="local triggers the global trigger is split into (1 = centralised attack)")
    bar_rows: list[int] = Field([0, 3], min_length=1, description="rows of the trigger bars (DBA MNIST: 0, 3; CIFAR: 0, 4)")
    bar_cols: list[tuple[int, int]] = Field(
        [(0, 3), (6, 9)], min_length=1, description="inclusive column ranges of the bars (DBA MNIST: 0-3, 6-9; CIFAR: 0-5, 9-14)"
    )
    offset: tuple[int, int] = Field((0, 0), description="(row, col) shift of the whole trigger")
    value: float | None = Field(None, description="stamped pixel value; default: the training set's max per channel (white)")
    poison_per_batch: float = Field(
        0.3125, gt=0, le=1,
        description="share of the partition stamped and relabelled (chosen once), so of each batch on average (DBA MNIST: 20/64)",
    )
    scale: Scale = Field(
        "auto", description='update factor; "auto" = inverse FedAvg weight (DBA: 100 = n/eta with 10 clients, server lr 0.1)'
    )

    @model_validator(mode="after")
    def _geometry(self) -> "DBAParams":
        if len(set(self.bar_rows)) != len(self.bar_rows):
            raise ValueError(f"attack.bar_rows has duplicates: {self.bar_rows}")
        spans = sorted(self.bar_cols)
        if any(lo > hi for lo, hi in spans):
            raise ValueError(f"attack.bar_cols ranges must be [first, last] with first <= last: {self.bar_cols}")
        if any(a[1] >= b[0] for a, b in zip(spans, spans[1:])):
            raise ValueError(f"attack.bar_cols ranges overlap: {self.bar_cols}")
        bars = len(self.bar_rows) * len(self.bar_cols)
        if self.num_pieces > bars:
            raise ValueError(f"attack.num_pieces={self.num_pieces} exceeds the {bars} bars of the trigger (bar_rows x bar_cols)")
        return self


@ATTACKS.register("dba", DBAParams)
class DistributedBackdoor(_PixelBackdoor):
    """DBA: each attacker stamps one piece of a bar trigger; the test uses the whole trigger."""

    def fraction(self) -> float:
        return self.params.poison_per_batch

    def pieces(self, runtime) -> np.ndarray:
        p = self.params
        return runtime.cached(("dba", "pieces"),
                              lambda: dba_pieces(image_hw(runtime), p.bar_rows, p.bar_cols, p.offset, p.num_pieces))

    def piece_of(self, runtime, partition_id: int) -> int:
        if partition_id not in runtime.attackers:
            raise ValueError(f"client {partition_id} is not a DBA attacker ({runtime.attackers})")
        return runtime.attackers.index(partition_id) % self.params.num_pieces

    def mask_for(self, runtime, partition_id: int) -> np.ndarray:
        return self.pieces(runtime)[self.piece_of(runtime, partition_id)]

    def test_mask(self, runtime) -> np.ndarray:
        return self.pieces(runtime).any(axis=0)

    def report(self, runtime) -> dict:
        pieces = {pid: self.piece_of(runtime, pid) for pid in runtime.attackers}
        return {**super().report(runtime), "piece_of_attacker": pieces}
