"""pfl-research's side of benchmarks/peers.py: pfl's simulated FedAvg on the problem peers.py wrote.

Run by the Python of pfl's own virtual environment (it imports only pfl, torch, numpy and the
standard library; nothing of fedsim), as `PFL_PYTHON benchmarks/pfl_driver.py --problem DIR --out
FILE`; peers.py starts it, one fresh process per run. DIR holds what fedsim's side uses, written by
peers.py from fedsim's own runtime:

* `x_train.npy`, `y_train.npy`: the training set, already normalised by fedsim's loader (float32
  NCHW, int64 labels); `partitions.npy` + `sizes.npy`: fedsim's partitions (row indices of each
  user, concatenated, and how many each user has), so user u here is fedsim's client u;
* `x_test.npy`, `y_test.npy`: the test set for the central evaluation at the end;
* `init.pt`: the initial model's state dict (fedsim's `runtime.initial_weights()`);
* `schedule.npy` [rounds, cohort]: the users fedsim samples in each round, replayed here through
  pfl's user sampler so both train the same users in the same rounds;
* `config.json`: model ("lenet" or "mlp" with its hidden widths), lr, batch size, local epochs,
  rounds, cohort size, evaluation batch size, seed.

The model is a torch module with the same layers, shapes and state-dict keys as fedsim's `lenet`
(fedsim/models/nets.py LeNet: the PyTorch MNIST example net, which is also pfl's own benchmark
`simple_cnn`) or `mlp`, plus the `loss` and `metrics` methods pfl's PyTorchModel asks for. The
algorithm is pfl's `FederatedAveraging` on a `SimulatedBackend` with `WeightByDatapoints` (fedsim's
FedAvg weighs by example count): each user trains with a fresh `torch.optim.SGD` at the local lr
(pfl's batches follow the user's data order, no shuffle; fedsim shuffles each epoch), and the
server applies the averaged model difference with SGD at lr 1.0, which is FedAvg (pfl's own
benchmark configuration, benchmarks/image_classification/configs/baseline.yaml in pfl-research).

Writes JSON to FILE: seconds of each round (a callback after every central iteration), the
seconds before the first round (imports, data, model) and after the last one (the central
evaluation), the final test accuracy and loss, pfl's and torch's versions and torch's threads.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

T_START = time.perf_counter()

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402


def classifier_methods(cls):
    """Add pfl's `loss(x, y, eval=False)` and `metrics(x, y, eval=True)` to a module class."""
    from pfl.metrics import Weighted

    def loss(self, x, y, eval=False):
        self.eval() if eval else self.train()
        return nn.functional.cross_entropy(self(x), y)

    @torch.no_grad()
    def metrics(self, x, y, eval=True):
        self.eval() if eval else self.train()
        logits = self(x)
        n = len(x)
        return {
            "loss": Weighted(nn.functional.cross_entropy(logits, y, reduction="sum").item(), n),
            "accuracy": Weighted((logits.argmax(1) == y).sum().item(), n),
        }

    cls.loss, cls.metrics = loss, metrics
    return cls


def build_model(cfg: dict) -> nn.Module:
    c, h, w = cfg["input_shape"]
    classes = cfg["num_classes"]
    if cfg["model"] == "lenet":
        @classifier_methods
        class LeNet(nn.Module):  # fedsim's lenet: same layers, shapes and state-dict keys
            def __init__(self) -> None:
                super().__init__()
                self.conv1 = nn.Conv2d(c, 32, 3, 1)
                self.conv2 = nn.Conv2d(32, 64, 3, 1)
                self.dropout1 = nn.Dropout(0.25 if cfg["dropout"] else 0.0)
                self.dropout2 = nn.Dropout(0.5 if cfg["dropout"] else 0.0)
                self.fc1 = nn.Linear(64 * ((h - 4) // 2) * ((w - 4) // 2), 128)
                self.fc2 = nn.Linear(128, classes)

            def forward(self, x):
                x = torch.relu(self.conv1(x))
                x = torch.relu(self.conv2(x))
                x = self.dropout1(torch.flatten(torch.max_pool2d(x, 2), 1))
                return self.fc2(self.dropout2(torch.relu(self.fc1(x))))

        return LeNet()
    if cfg["model"] == "mlp":
        @classifier_methods
        class Mlp(nn.Sequential):  # fedsim's mlp: Flatten, (Linear, ReLU) per hidden width, Linear
            pass

        layers, width = [nn.Flatten()], c * h * w
        for hidden in cfg["hidden"]:
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        return Mlp(*layers, nn.Linear(width, classes))
    raise SystemExit(f"unknown model {cfg['model']!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problem", type=Path, required=True, help="the folder benchmarks/peers.py wrote")
    parser.add_argument("--out", type=Path, required=True, help="where to write the JSON result")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()

    import pfl
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.aggregate.weighting import WeightByDatapoints
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.callback.base import TrainingProcessCallback
    from pfl.data.dataset import Dataset
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
    from pfl.metrics import Metrics
    from pfl.model.pytorch import PyTorchModel

    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = json.loads((args.problem / "config.json").read_text())
    torch.manual_seed(cfg["seed"])
    np.random.seed(cfg["seed"])

    def load(name):
        return torch.from_numpy(np.load(args.problem / f"{name}.npy"))

    x_train, y_train, x_test, y_test = load("x_train"), load("y_train"), load("x_test"), load("y_test")
    indices, sizes = np.load(args.problem / "partitions.npy"), np.load(args.problem / "sizes.npy")
    starts = np.concatenate([[0], np.cumsum(sizes)])
    users = {u: (x_train[torch.from_numpy(indices[starts[u]:starts[u + 1]])],
                 y_train[torch.from_numpy(indices[starts[u]:starts[u + 1]])]) for u in range(len(sizes))}
    schedule = iter(np.load(args.problem / "schedule.npy").reshape(-1).tolist())

    def replay():  # pfl's user sampler: fedsim's clients of each round, in order
        return next(schedule)

    training = FederatedDataset.from_slices(users, replay)
    unused_val = FederatedDataset.from_slices(users, lambda: 0)  # no validation cohort is asked for (size 0)

    module = build_model(cfg)
    module.load_state_dict(torch.load(args.problem / "init.pt", weights_only=True))
    model = PyTorchModel(model=module, local_optimizer_create=torch.optim.SGD,
                         central_optimizer=torch.optim.SGD(module.parameters(), lr=1.0))
    backend = SimulatedBackend(training_data=training, val_data=unused_val, postprocessors=[WeightByDatapoints()])

    class RoundTimer(TrainingProcessCallback):
        def __init__(self) -> None:
            self.walls: list[float] = []
            self.started = self.last = None

        def on_train_begin(self, *, model):
            self.started = self.last = time.perf_counter()
            return Metrics()

        def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
            now = time.perf_counter()
            self.walls.append(now - self.last)
            self.last = now
            return False, Metrics()

    timer = RoundTimer()
    eval_params = NNEvalHyperParams(local_batch_size=cfg["eval_batch_size"])
    rounds = cfg["rounds"]
    FederatedAveraging().run(
        algorithm_params=NNAlgorithmParams(central_num_iterations=rounds, evaluation_frequency=rounds + 1,
                                           train_cohort_size=cfg["cohort"], val_cohort_size=0),
        backend=backend,
        model=model,
        model_train_params=NNTrainHyperParams(local_learning_rate=cfg["lr"], local_num_epochs=cfg["local_epochs"],
                                              local_batch_size=cfg["batch_size"]),
        model_eval_params=eval_params,
        callbacks=[timer],
    )
    t_eval = time.perf_counter()
    final = model.evaluate(Dataset(raw_data=[x_test, y_test]), eval_params=eval_params)
    values = {str(name): value.overall_value for name, value in final}
    end = time.perf_counter()
    args.out.write_text(json.dumps({
        "round_wall": timer.walls,
        "before_rounds": timer.started - T_START,
        "after_rounds": end - timer.last,
        "evaluate": end - t_eval,
        "in_process": end - T_START,
        "metrics": {"main_accuracy": values.get("accuracy"), "main_loss": values.get("loss")},
        "versions": {"pfl": getattr(pfl, "__version__", "?"), "torch": torch.__version__},
        "threads": torch.get_num_threads(),
    }))


if __name__ == "__main__":
    main()
