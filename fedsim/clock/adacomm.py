"""AdaComm (Wang & Joshi, "Adaptive Communication Strategies to Achieve the Best Error-Runtime
Trade-off in Local-Update SGD", MLSys 2019): the local period τ chosen for wall-clock time.

Local-update SGD averages every τ local steps. A large τ saves communication early, when the loss
is high and falls fast in time; a small τ lowers the error floor later. AdaComm starts at τ0 and
re-evaluates τ once every T0 seconds of (here simulated) time:

    τ_l = ⌈ sqrt(F(x_l) / F(x_0)) · τ0 ⌉          (or sqrt(η_0 F(x_l) / (η_l F(x_0))) · τ0 with the lr folded in)

where F(x_l) is the training loss at the start of interval l, and intervals start at multiples of
T0. With a decaying learning rate the period grows back: the error that local steps add scales
with η² τ, so a smaller η affords a larger τ.

The server has no training data. Each client reports the loss of its first batch, computed at the
round's global model before its first step (`start-loss`): their mean is F at that model on the
round's clients' data. F(x_0) is round 1's (the initial model); a round's τ is set from the last
round's measurement, one round behind the model it will start from.

The rule as written here is the paper's as recalled in shared/reference/algorithms.md §6.1; the
paper's text and official code were not found to check it against, and PaddlePaddle's
`AdaptiveLocalSGD`, which cites the paper, folds the learning rate in the same direction (η_0 / η_l)
but puts τ0 inside the root (docs/adacomm.md).
"""

from __future__ import annotations

import math


class AdaCommPeriod:
    def __init__(self, params) -> None:
        self.params = params
        self.tau = params.tau0
        self.f0: float | None = None
        self.lr0: float | None = None
        self.interval_start = 0.0  # simulated time the current interval began

    def period(self, now: float, loss: float | None, lr: float) -> int:
        """The local period for a round starting at simulated time `now`; `loss`: the last round's
        mean reported training loss (None before the first)."""
        if self.lr0 is None:
            self.lr0 = lr
        if self.f0 is None and loss is not None:
            self.f0 = loss
        if self.f0 and loss is not None and now - self.interval_start >= self.params.interval:
            ratio = loss / self.f0
            if self.params.lr_coupled:
                ratio *= self.lr0 / lr
            self.tau = max(1, math.ceil(math.sqrt(max(ratio, 0.0)) * self.params.tau0 - 1e-9))
            elapsed = now - self.interval_start  # the interval this round falls in starts at a multiple of T0
            self.interval_start += elapsed - math.fmod(elapsed, self.params.interval)
        return self.tau

    def state_dict(self) -> dict:
        return {"tau": self.tau, "f0": self.f0, "lr0": self.lr0, "interval_start": self.interval_start}

    def load_state_dict(self, state: dict) -> None:
        self.tau, self.f0 = int(state["tau"]), state["f0"]
        self.lr0, self.interval_start = state["lr0"], float(state["interval_start"])
