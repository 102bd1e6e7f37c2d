"""What the server measures on the global model each round: main-task accuracy and loss on the
(optionally subsampled) test set, the attack's success rate on its own test set, and clean
accuracy on the edge set's source class."""

from __future__ import annotations

import numpy as np
import torch

from fedsim.seeding import SERVER, numpy_rng
from fedsim.training import evaluate, target_rate


class CentralEvaluator:
    def __init__(self, runtime) -> None:
        scenario = runtime.scenario
        self.batch_size = scenario.evaluation.batch_size
        self.x, self.y = runtime.data.x_test, runtime.data.y_test
        subset = scenario.evaluation.test_subset
        if subset is not None and subset < len(self.y):  # a fixed seeded subset, the same every round
            keep = np.sort(numpy_rng(scenario.seed, SERVER, 0).choice(len(self.y), subset, replace=False))
            self.x, self.y = self.x[keep], self.y[keep]
        self.backdoor = runtime.attack.backdoor_test_set(runtime) if runtime.attack is not None else None
        self.source = getattr(getattr(scenario.attack, "edge_set", None), "source_class", None)

    def __call__(self, model: torch.nn.Module) -> dict:
        main = evaluate(model, self.x, self.y, self.batch_size)
        out = {"main_accuracy": main["accuracy"], "main_loss": main["loss"], "backdoor_success": None}
        if self.backdoor is not None:
            x_bd, targets = self.backdoor
            out["backdoor_success"] = target_rate(model, x_bd, targets, self.batch_size)
        if self.source is not None:
            mask = self.y == self.source
            out["source_class_accuracy"] = evaluate(model, self.x[mask], self.y[mask], self.batch_size)["accuracy"]
        return out
