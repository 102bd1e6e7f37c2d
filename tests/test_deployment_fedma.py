"""FedMA on Flower's deployment engine: a real SuperLink and 3 SuperNodes on loopback.

The layer-wise protocol needs several exchanges per round and the client's model kept between
them in its Flower context; on a SuperNode each message still runs in its own ClientApp process,
so this checks that the state really travels through Flower, and that the metrics equal the
in-process run. Slow: run with `pytest -m slow`.
"""

from __future__ import annotations

import pytest

from fedsim.server.record import without_times
from fedsim.deploy import commands as deploy
from fedsim.runs.results import read_rounds
from test_deployment import REPO, cluster, wait_summary  # noqa: F401  (cluster: the shared fixture)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SCENARIO = REPO / "scenarios/fedma/digits_mlp.yaml"
OVERRIDES = [
    "federation.num_clients=3", "federation.clients_per_round=3", "federation.rounds=2",
    "federation.local_epochs=2", "aggregator.retrain_epochs=1", "model.hidden=[16, 12]",
    "federation.round_timeout=300",
]


def test_fedma_runs_on_superlink_like_in_process(cluster):
    cluster.superlink()
    for i in range(3):
        cluster.supernode(i, 3)
    deploy.write_connection(cluster.tmp / "flwr_home", "test", cluster.address)
    run = cluster.start(deploy.run_cmd("test", SCENARIO, OVERRIDES, cluster.tmp / "results"), "flwr_run")
    summary = wait_summary(cluster, 800, run)
    rounds = read_rounds(cluster.run_dir())
    assert summary["rounds_completed"] == 2
    assert all(r["exchanges"] == 3 and r["aggregated"] == [0, 1, 2] and not r["rejected"] for r in rounds)

    from fedsim.client.app import make_client_app
    from fedsim.runs.folder import RunFolder
    from fedsim.scenario import load_scenario
    from fedsim.server.app import run_server
    from fedsim.flower.local_grid import LocalGrid

    scenario = load_scenario(SCENARIO, OVERRIDES)
    local_dir = RunFolder.create(scenario, cluster.tmp / "local").path
    run_server(LocalGrid(make_client_app(scenario), 3), scenario, local_dir)
    assert without_times(read_rounds(local_dir)) == without_times(rounds)
