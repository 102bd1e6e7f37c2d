"""A client's memory between rounds (error-feedback residuals) lives in its own Flower Context and,
for restarts, in its own state folder; no server path travels in any message."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from flwr.app import Context, RecordDict

from fedsim.client.app import make_client_app, state_folder
from fedsim.flower.local_grid import LocalGrid
from fedsim.runs.checkpoint import load_client, save_client
from fedsim.runs.folder import RunFolder
from fedsim.runs.results import read_rounds
from fedsim.scenario import load_scenario
from fedsim.server.app import run_server

ROOT = Path(__file__).resolve().parents[1]
TOPK = ["federation.rounds=3", "federation.num_clients=6", "federation.clients_per_round=4", "attack=null",
        "compression={name: topk, fraction: 0.05}"]


def test_messages_carry_no_path_and_clients_write_only_their_own_folder(tmp_path):
    scenario = load_scenario(str(ROOT / "scenarios/quickstart.yaml"), TOPK)
    run = RunFolder.create(scenario, tmp_path / "server")
    device_disk = tmp_path / "device"
    app = make_client_app(scenario, device_disk)
    seen = []

    def spy(message, context):
        seen.append(message.content["config"])
        return app(message, context)

    run_server(LocalGrid(spy, 6), scenario, run, checkpoints=True)
    assert len(read_rounds(run)) == 3 and seen
    texts = [str(v) for config in seen for v in config.values()]
    assert not any(str(tmp_path) in t for t in texts), "a path travelled in a TRAIN message"
    assert sorted(p.name for p in device_disk.glob("*.npz")), "no client state saved on the client's disk"
    assert not run.client_states.exists(), "client state written into the server's run folder"
    assert sorted(p.name for p in run.checkpoints.glob("round-*.pt")) == ["round-2.pt", "round-3.pt"]


def test_a_node_config_state_dir_overrides_the_apps_default(tmp_path):
    ctx = Context(run_id=1, node_id=7, node_config={"partition-id": 0, "state-dir": str(tmp_path / "own")},
                  state=RecordDict(), run_config={})
    assert state_folder(ctx, "/elsewhere") == str(tmp_path / "own")
    bare = Context(run_id=1, node_id=7, node_config={"partition-id": 0}, state=RecordDict(), run_config={})
    assert state_folder(bare, "/elsewhere") == "/elsewhere" and state_folder(bare, None) is None


def test_a_fresh_client_drops_its_files_from_rounds_the_server_is_redoing(tmp_path):
    for rnd in (2, 4):  # the run was killed during round 4 after the server kept round 3
        save_client(tmp_path, 3, rnd, {"residual": np.full(2, float(rnd))})
    save_client(tmp_path, 8, 5, {"residual": np.zeros(2)})  # another client's file is not touched
    state = load_client(tmp_path, 3, before_round=4)
    assert state["residual"].tolist() == [2.0, 2.0]
    assert sorted(p.name for p in tmp_path.glob("*.npz")) == ["3-r2.npz", "8-r5.npz"]


def test_a_damaged_state_file_is_skipped_for_the_older_one(tmp_path, caplog):
    save_client(tmp_path, 3, 1, {"residual": np.ones(4, dtype=np.float32)})
    save_client(tmp_path, 3, 2, {"residual": np.full(4, 2.0, dtype=np.float32)})
    newest = tmp_path / "3-r2.npz"
    newest.write_bytes(newest.read_bytes()[:20])  # damaged
    with caplog.at_level("WARNING", logger="fedsim"):
        state = load_client(tmp_path, 3, before_round=3)
    assert state["residual"].tolist() == [1.0] * 4
    assert any("3-r2.npz is unreadable" in r.getMessage() for r in caplog.records)
