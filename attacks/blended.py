"""Blended-injection backdoor (Chen et al., 2017, "Targeted Backdoor Attacks on Deep Learning
Systems Using Data Poisoning", §4.2, pattern-key attack with the blended injection strategy).

The key is a whole-image pattern k, blended into an input as Π(x) = (1 − α)·x + α·k and labelled
with the target class (the paper's Π^blend_α(k, x) = α·k + (1 − α)·x). The paper blends with a
small α while poisoning (α_train = 0.2) and may present the key more visibly at test time
(α_test), so the two are separate parameters; α_test also defaults to 0.2, as in BackFed's
`Blended` poison, whose one blend weight 0.2 serves both.

Follows the paper for the key: its random pattern draws every pixel uniformly over the pixel range
([0, 255]); here the range is each channel's [min, max] over the training set, the same range
after fedsim's normalisation, drawn once from the scenario seed. The Hello Kitty image is not
shipped; `pattern_file` loads any key as a `.npy` array in the model's input space instead.

The federated setting follows `trigger` (fedsim/attacks/trigger.py): the attacker poisons a
fixed, seeded share of its own partition (`poison_fraction`), may scale its update, and success
is measured on every non-target test image blended with α_test, counted as a hit when the global
model predicts the target.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from pydantic import Field

from fedsim.attacks.trigger import PartitionPoisoner, PoisonParams, check_class, choose_poisoned, image_hw
from fedsim.data.base import DataFileError, resolve_data_dir
from fedsim.registry import ATTACKS

PATTERN_STREAM = 0xB1E0D  # seed stream of the random-noise key


def blend(x: np.ndarray, pattern: np.ndarray, alpha: float) -> np.ndarray:
    """(1 − α)·x + α·pattern for images `x` ([N, C, H, W] or [C, H, W]) and a [C, H, W] pattern,
    in x's dtype; α = 0 returns x's values and α = 1 the pattern's, exactly."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"the blend ratio must lie in [0, 1], got {alpha}")
    return (x * (1.0 - alpha) + pattern * alpha).astype(x.dtype, copy=False)


def noise_pattern(x_train: np.ndarray, seed: int) -> np.ndarray:
    """A [C, H, W] key drawn uniformly over each channel's training-set range (the paper's random key)."""
    lo = x_train.min(axis=(0, 2, 3))[:, None, None]
    hi = x_train.max(axis=(0, 2, 3))[:, None, None]
    u = np.random.default_rng([seed, PATTERN_STREAM]).random(x_train.shape[1:])
    return (lo + u * (hi - lo)).astype(x_train.dtype)


def load_pattern(path: str, data_dir: str | None, shape: tuple[int, int, int]) -> np.ndarray:
    """A key from a `.npy` file ([H, W], [1, H, W] or [C, H, W], broadcast over the channels) as a
    float32 [C, H, W] array; a relative path is read from the data directory."""
    file = Path(path).expanduser()
    if not file.is_absolute():
        file = resolve_data_dir(data_dir) / file
    if not file.is_file():
        raise DataFileError(f"attack.pattern_file: no file {file} (a .npy array of shape [H, W] or [C, H, W])")
    try:
        pattern = np.load(file, allow_pickle=False)
    except (ValueError, OSError) as err:
        raise DataFileError(f"attack.pattern_file: {file} is not a .npy array: {err}") from None
    c, h, w = shape
    stored = list(pattern.shape)
    if pattern.ndim == 2:
        pattern = pattern[None]
    if pattern.ndim != 3 or pattern.shape[1:] != (h, w) or pattern.shape[0] not in (1, c):
        fits = [[h, w], [1, h, w]] + ([[c, h, w]] if c > 1 else [])
        raise ValueError(f"attack.pattern_file: {file} holds an array of shape {stored}; "
                         f"the images take {' or '.join(map(str, fits))}")
    if not np.issubdtype(pattern.dtype, np.number) or not np.isfinite(pattern).all():
        raise ValueError(f"attack.pattern_file: {file} must hold finite numbers")
    return np.ascontiguousarray(np.broadcast_to(pattern.astype(np.float32), shape))


class BlendedParams(PoisonParams):
    target_class: int = Field(0, ge=0, description="label the blended inputs are given")
    alpha_train: float = Field(0.2, gt=0, le=1, description="blend ratio α of the poisoned training inputs (paper: 0.2)")
    alpha_test: float = Field(0.2, gt=0, le=1, description="blend ratio α of the backdoor test inputs (BackFed: 0.2)")
    pattern_file: str | None = Field(
        None, description=".npy key [H, W] or [C, H, W] in the model's input space, relative to the data directory; "
                          "default: seeded uniform noise over each channel's range (the paper's random key)",
    )
    poison_fraction: float = Field(
        0.5, gt=0, le=1, description="share of the attacker's partition blended and relabelled (chosen once)"
    )


@ATTACKS.register("blended", BlendedParams)
class BlendedBackdoor(PartitionPoisoner):
    """Blended injection (Chen et al. 2017): a whole-image key blended into inputs relabelled to a target."""

    def pattern(self, runtime) -> np.ndarray:
        """The [C, H, W] key, built once per process."""
        def build() -> np.ndarray:
            h, w = image_hw(runtime)
            shape = (runtime.data.x_train.shape[1], h, w)
            if self.params.pattern_file is not None:
                return load_pattern(self.params.pattern_file, runtime.scenario.data.dir, shape)
            return noise_pattern(runtime.data.x_train, runtime.scenario.seed)

        return runtime.cached(("blended", "pattern", self.params.pattern_file, runtime.scenario.seed), build)

    def poisoned_rows(self, runtime, partition_id: int) -> np.ndarray:
        """Indices into the attacker's partition of the samples it blends and relabels."""
        n = len(runtime.partitions[partition_id])
        return choose_poisoned(n, self.params.poison_fraction, runtime.scenario.seed, partition_id)

    def poison(self, runtime, partition_id, x, y):
        check_class(self.params.target_class, runtime)
        rows = self.poisoned_rows(runtime, partition_id)
        x, y = x.copy(), y.copy()
        x[rows] = blend(x[rows], self.pattern(runtime), self.params.alpha_train)
        y[rows] = self.params.target_class
        return x, y

    def backdoor_test_set(self, runtime, shared=None) -> tuple[np.ndarray, np.ndarray]:
        """Every test image whose label is not the target, blended with α_test, labelled the target."""
        target = self.params.target_class
        check_class(target, runtime)
        keep = runtime.data.y_test != target
        x = blend(runtime.data.x_test[keep], self.pattern(runtime), self.params.alpha_test)
        return x, np.full(len(x), target, dtype=np.int64)

    def report(self, runtime) -> dict:
        p = self.params
        return {
            "target_class": p.target_class,
            "alpha_train": p.alpha_train,
            "alpha_test": p.alpha_test,
            "pattern": p.pattern_file or "random noise (scenario seed)",
            "poisoned_per_attacker": {pid: len(self.poisoned_rows(runtime, pid)) for pid in runtime.attackers},
        }
