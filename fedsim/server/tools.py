"""What the server can do for a rule or defense besides handing it the updates: build the current
global model and train it on data the server itself holds (FLTrust's root dataset).

Given to rules and defenses as `RoundContext.tools` (None where no server runtime exists, e.g. when
a rule is called on bare tensors in a test).
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from fedsim.seeding import SERVER, derive_seed, numpy_rng
from fedsim.training import TrainConfig, train

ROOT_DATA = 0xF17  # seed stream of the server's own data sample
ROOT_TRAIN = 0xF18  # seed stream of the server's own training


def server_sample(runtime, size: int, source: str) -> np.ndarray:
    """Indices of the `size` examples the server holds, drawn once per scenario and seed from the
    training split (`train`) or the test split (`test`; central evaluation then leaves them out)."""
    data = runtime.data
    pool = len(data.y_train) if source == "train" else len(data.y_test)
    if size > pool:
        raise ValueError(f"the server's sample of {size} examples is larger than the {source} split ({pool})")
    return np.sort(numpy_rng(runtime.scenario.seed, SERVER, ROOT_DATA).choice(pool, size, replace=False))


class ServerTools:
    def __init__(self, runtime, model_of: Callable[[torch.Tensor], torch.nn.Module]) -> None:
        self.rt = runtime
        self.model_of = model_of  # flat global weights -> a fresh module of the current architecture
        self._data: dict = {}

    @property
    def input_shape(self) -> tuple[int, ...]:
        """One input's shape (e.g. (1, 28, 28)), for rules that probe models with inputs of their own."""
        return tuple(self.rt.data.input_shape)

    @property
    def num_classes(self) -> int:
        return int(self.rt.data.num_classes)

    def server_data(self, size: int, source: str) -> tuple[np.ndarray, np.ndarray]:
        """The server's own examples (see `server_sample`), cached."""
        key = (size, source)
        if key not in self._data:
            idx = server_sample(self.rt, size, source)
            d = self.rt.data
            x, y = (d.x_train, d.y_train) if source == "train" else (d.x_test, d.y_test)
            self._data[key] = (np.asarray(x[idx]), np.asarray(y[idx]))
        return self._data[key]

    def train_update(self, global_weights: torch.Tensor, layout, x: np.ndarray, y: np.ndarray, rnd: int) -> torch.Tensor:
        """The update the server gets by training the global model on (x, y) exactly as a client
        trains in round `rnd` (the scenario's local epochs, batch size, learning rate, momentum,
        weight decay), seeded by the round. It trains on CPU, as the clients' reference does, and the
        update is returned on the device of `global_weights` (server.device)."""
        fed = self.rt.scenario.federation
        on_host = global_weights.cpu()
        model = self.model_of(on_host)
        cfg = TrainConfig(fed.local_epochs, fed.batch_size, self.rt.lr(rnd), fed.momentum, fed.weight_decay)
        train(model, x, y, cfg, derive_seed(self.rt.scenario.seed, SERVER, ROOT_TRAIN, rnd))
        return (layout.flatten_model(model) - on_host).to(global_weights.device)


class GivenServerUpdate:
    """ServerTools' stand-in where the server's own update is known in advance (a benchmark timing
    FLTrust without its training, a test calling a rule on bare tensors): no data, no training."""

    def __init__(self, update: torch.Tensor) -> None:
        self.update = update

    def server_data(self, size: int, source: str) -> tuple[None, None]:
        return None, None

    def train_update(self, global_weights, layout, x, y, rnd: int) -> torch.Tensor:
        return self.update
