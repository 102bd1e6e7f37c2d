"""One-shot FedMA matching vs one-shot coordinate averaging (the FedMA paper's claim (a)).

J clients train the scenario's MLP from their *own* random initialisations on a Dirichlet split;
then, with no further communication, the server combines them once:
  * coordinate averaging: the example-weighted mean of every weight (what FedAvg would do);
  * matched averaging: BBP-MAP on the hidden layer(s), each client's next layer re-indexed to the
    global order, output layer averaged per class (no retraining in between).
Prints the test accuracy of both and the mean accuracy of the local models.

Run: `.venv/bin/python benchmarks/fedma_oneshot.py [--scenario scenarios/fedma/digits_mlp.yaml]`
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]

from fedsim.fedma.matching import average_last_layer, bbp_map_match  # noqa: E402
from fedsim.fedma.arch import state_of  # noqa: E402
from fedsim.fedma.client import arch_for, class_counts  # noqa: E402
from fedsim.runtime import runtime_for  # noqa: E402
from fedsim.scenario import load_scenario  # noqa: E402
from fedsim.seeding import INIT, TRAIN, derive_seed  # noqa: E402
from fedsim.training import TrainConfig, evaluate, train  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", default=str(REPO / "scenarios/fedma/digits_mlp.yaml"))
    parser.add_argument("--set", action="append", default=[], help="scenario overrides KEY=VALUE")
    args = parser.parse_args()
    scenario = load_scenario(args.scenario, args.set)
    rt = runtime_for(scenario)
    arch, fed, params = arch_for(rt), scenario.federation, scenario.aggregator
    torch.set_num_threads(1)
    states, counts, sizes, local_acc = [], [], [], []
    for pid in range(fed.num_clients):
        torch.manual_seed(derive_seed(scenario.seed, INIT, pid))
        model = rt.build_model()
        x, y = rt.client_data(pid)
        cfg = TrainConfig(fed.local_epochs, fed.batch_size, fed.lr, fed.momentum, fed.weight_decay)
        train(model, x, y, cfg, derive_seed(scenario.seed, TRAIN, 1, pid, 0))
        states.append(state_of(model))
        counts.append(class_counts(y, rt.data.num_classes))
        sizes.append(len(y))
        local_acc.append(evaluate(model, rt.data.x_test, rt.data.y_test)["accuracy"])
    share = np.asarray(sizes, dtype=np.float64) / sum(sizes)
    averaged = {k: sum(w * s[k] for w, s in zip(share, states)).astype(np.float32) for k in states[0]}

    matched = [dict(s) for s in states]
    glob = dict(states[0])
    for l in range(arch.num_matched):
        result = bbp_map_match([arch.neurons(s, l) for s in matched], **params.match_kwargs(), seed=scenario.seed)
        layer = arch.layers[l]
        glob[layer.weight] = matched[0][layer.weight]  # inputs already in the global order of layer l-1
        arch.set_neurons(glob, l, result.theta)
        for s, assignment in zip(matched, result.assignments):
            s[layer.weight], s[layer.bias] = glob[layer.weight], glob[layer.bias]
            arch.permute_into_global(s, l, assignment, result.global_size)
    out = arch.layers[-1]
    w, b = average_last_layer([s[out.weight] for s in matched], [s[out.bias] for s in matched], counts)
    glob[out.weight], glob[out.bias] = w.astype(np.float32), b.astype(np.float32)
    acc_avg = evaluate(arch.model(averaged), rt.data.x_test, rt.data.y_test)["accuracy"]
    acc_match = evaluate(arch.model(glob), rt.data.x_test, rt.data.y_test)["accuracy"]
    print(f"scenario {scenario.name}: {fed.num_clients} clients, {fed.local_epochs} local epochs, model {scenario.model.name}")
    print("| combination (one shot) | test accuracy | hidden widths |")
    print("|---|---:|---|")
    print(f"| local models (mean) | {np.mean(local_acc):.4f} | {list(arch.widths(states[0]))} |")
    print(f"| coordinate averaging | {acc_avg:.4f} | {list(arch.widths(averaged))} |")
    print(f"| matched averaging (BBP-MAP) | {acc_match:.4f} | {list(arch.widths(glob))} |")


if __name__ == "__main__":
    main()
