"""What the files decide is checked before any process starts (#16 item 2): a missing dataset or
edge set, a model that does not fit the data, a partition that cannot be made. `fedsim run`
then fails in seconds, names the field, and leaves no run folder."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedsim.preflight import preflight
from fedsim.scenario import ScenarioError, load_scenario

REPO = Path(__file__).resolve().parents[1]
QUICK = str(REPO / "scenarios/quickstart.yaml")


def problems(overrides) -> dict[str, str]:
    with pytest.raises(ScenarioError) as info:
        preflight(load_scenario(QUICK, overrides))
    return {path: msg for path, msg, _ in info.value.problems}


def test_the_quickstart_passes():
    preflight(load_scenario(QUICK))


def test_missing_dataset_names_the_field_and_the_files(tmp_path):
    got = problems(["data.dataset=mnist", f"data.dir={tmp_path}", "attack=null"])
    assert "mnist.npz" in got["data.dataset"]


@pytest.mark.parametrize("model", ["vgg9"])  # lenet adapts its first FC to any image size
def test_a_model_that_does_not_fit_the_data(model):
    got = problems([f"model={model}", "attack=null"])
    assert "model" in got and "digits" in got["model"] and "[1, 8, 8]" in got["model"]


def test_missing_edge_set_files(tmp_path):
    got = problems(["attack.edge_set=ardis", f"data.dir={tmp_path}"])
    assert "attack.edge_set" in got and "ardis" in got["attack.edge_set"]


def test_a_partition_that_cannot_be_made():
    got = problems(["federation.num_clients=1000", "federation.clients_per_round=10", "attack=null",
                    "data.partition={name: dirichlet, alpha: 0.5, min_partition_size: 10}"])
    assert "data.partition" in got


def test_fedsim_run_fails_before_ray_and_leaves_no_run_folder(tmp_path):
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "fedsim.cli", "run", QUICK, "--set", "data.dataset=mnist",
                          "--set", f"data.dir={tmp_path / 'nothing'}", "--set", "attack=null",
                          "--output", str(tmp_path / "results")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "data.dataset" in out.stderr and "Traceback" not in out.stderr
    assert time.monotonic() - t0 < 30 and "Ray" not in out.stdout
    assert not (tmp_path / "results").exists()
