"""The server optimizer (fedsim/server/optimizer.py) against Flower 1.41's own FedAvgM, FedAdam,
FedYogi and FedAdagrad on the same inputs, FedAvg bit for bit at the defaults, and in real rounds."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import strategy as flwr_strategy

from fedsim.client.app import make_client_app
from fedsim.flower.compat import act_as_superlink
from fedsim.flower.local_grid import LocalGrid
from fedsim.runs.folder import RunFolder
from fedsim.runs.results import read_rounds
from fedsim.scenario import ScenarioError, load_scenario
from fedsim.server.app import run_server
from fedsim.server.optimizer import ServerOptimizer

ROOT = Path(__file__).resolve().parents[1]


def spec(**kw):
    return load_scenario(str(ROOT / "scenarios/quickstart.yaml"), [f"server.{k}={v}" for k, v in kw.items()]).server


def flower_step(strategy, x: np.ndarray, target: np.ndarray, rnd: int) -> np.ndarray:
    """Flower's strategy moving x given one reply whose model is `target` (so its FedAvg is target: Δ = target − x)."""
    act_as_superlink(1)
    x = x.astype(np.float32)  # what each strategy keeps from configure_train: FedOpt numpy arrays, FedAvgM a record
    is_fedavgm = isinstance(strategy, flwr_strategy.FedAvgM)
    strategy.current_arrays = ArrayRecord({"w": torch.from_numpy(x)}) if is_fedavgm else {"w": x}
    sent = Message(RecordDict({"config": ConfigRecord({})}), dst_node_id=5, message_type=MessageType.TRAIN)
    reply = Message(RecordDict({"arrays": ArrayRecord({"w": torch.from_numpy(target.astype(np.float32))}),
                                "metrics": MetricRecord({"num-examples": 10})}), reply_to=sent)
    arrays, _ = strategy.aggregate_train(rnd, [reply])
    return arrays["w"].numpy()


@pytest.mark.parametrize("ours,theirs", [
    ({"optimizer": "adam", "lr": 0.05, "beta_1": 0.9, "beta_2": 0.99, "tau": 1e-3},
     lambda: flwr_strategy.FedAdam(eta=0.05, beta_1=0.9, beta_2=0.99, tau=1e-3)),
    ({"optimizer": "yogi", "lr": 0.05, "beta_1": 0.9, "beta_2": 0.99, "tau": 1e-3},
     lambda: flwr_strategy.FedYogi(eta=0.05, beta_1=0.9, beta_2=0.99, tau=1e-3)),
    ({"optimizer": "adagrad", "lr": 0.05, "beta_1": 0.0, "tau": 1e-3},  # Flower's FedAdagrad fixes β1 = 0
     lambda: flwr_strategy.FedAdagrad(eta=0.05, tau=1e-3)),
    ({"optimizer": "sgd", "lr": 0.7, "momentum": 0.9},
     lambda: flwr_strategy.FedAvgM(server_learning_rate=0.7, server_momentum=0.9)),
], ids=["adam", "yogi", "adagrad", "sgd-momentum"])
def test_the_server_optimizers_match_flower_over_several_rounds(ours, theirs):
    mine, flowers = ServerOptimizer(spec(**ours)), theirs()
    rng = np.random.default_rng(0)
    x_ours = x_theirs = rng.normal(size=20).astype(np.float32)
    for rnd in range(1, 6):
        delta = rng.normal(scale=0.1, size=20).astype(np.float32)
        x_theirs = flower_step(flowers, x_theirs, x_theirs + delta, rnd)
        x_ours = mine.step(torch.from_numpy(x_ours), torch.from_numpy(delta), rnd).numpy()
        np.testing.assert_allclose(x_ours, x_theirs, rtol=1e-5, atol=1e-6)


def test_the_defaults_are_fedavg_bit_for_bit_and_keep_no_state():
    opt = ServerOptimizer(spec())
    x, d = torch.randn(50), torch.randn(50)
    assert torch.equal(opt.step(x, d, 1), x + d) and opt.state_dict() == {"m": None, "v": None}


def test_real_rounds_with_adam_resume_identically(tmp_path):
    sc = load_scenario(str(ROOT / "scenarios/quickstart.yaml"), [
        "federation.rounds=4", "federation.num_clients=8", "federation.clients_per_round=5",
        "server.optimizer=adam", "server.lr=0.05"])
    full = RunFolder.create(sc, tmp_path / "full")
    run_server(LocalGrid(make_client_app(sc), 8), sc, full, checkpoints=True)

    class Killed(Exception):
        pass

    def kill(record):
        if record["round"] == 2:
            raise Killed

    cut = RunFolder.create(sc, tmp_path / "cut")
    with pytest.raises(Killed):
        run_server(LocalGrid(make_client_app(sc), 8), sc, cut, kill, checkpoints=True)
    run_server(LocalGrid(make_client_app(sc), 8), sc, cut, checkpoints=True)
    from fedsim.server.record import without_times

    assert without_times(read_rounds(cut)) == without_times(read_rounds(full))  # the moments were checkpointed
    plain = RunFolder.create(sc, tmp_path / "plain")
    fedavg = load_scenario(str(ROOT / "scenarios/quickstart.yaml"), [
        "federation.rounds=4", "federation.num_clients=8", "federation.clients_per_round=5"])
    run_server(LocalGrid(make_client_app(fedavg), 8), fedavg, plain)
    assert read_rounds(plain)[-1]["global_norm"] != read_rounds(full)[-1]["global_norm"]


def test_fedma_refuses_a_server_optimizer():
    with pytest.raises(ScenarioError, match="server.optimizer=adam"):
        load_scenario(str(ROOT / "scenarios/fedma/digits_mlp.yaml"), ["server.optimizer=adam"])
