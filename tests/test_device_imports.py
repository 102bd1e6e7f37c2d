"""What the ClientApp imports on a device (issue #21).

An edge device installs only deploy/device-requirements.txt: no Ray, flwr-datasets, scikit-learn,
scipy, pandas or matplotlib. Each message runs in a fresh ClientApp process, so the check runs a
fresh interpreter too: a first one computes the digits partition into a cache folder (as the
device's first message, or a copied cache, would), a second one imports the ClientApp and answers
one honest train message from that cache and reports `sys.modules`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import packages_distributions, requires
from pathlib import Path

import numpy as np
import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from fedsim.data.partition import MISSING_FLWR_DATASETS, ShardParams
from fedsim.registry import PARTITIONERS

REPO = Path(__file__).resolve().parents[1]
DEVICE_REQUIREMENTS = REPO / "deploy" / "device-requirements.txt"

# Modules a device install does not have: importing one on the client path breaks the device.
FORBIDDEN = ("ray", "matplotlib", "pandas", "pyarrow", "sklearn", "scipy", "datasets", "huggingface_hub", "PIL",
             "flwr_datasets")
# torch imports these when they are installed (torch.utils.data: dill; torch.hub: tqdm; torch.backends:
# opt_einsum, its optional extra) and runs without them.
OPTIONAL = {"dill", "tqdm", "opt_einsum"}
# shard: a partitioner that still needs flwr-datasets (iid, dirichlet and natural are numpy only), so a
# device that recomputed the partition instead of reading the cache would import it
RUN_CONFIG = {"scenario": str(REPO / "scenarios" / "quickstart.yaml"),
              "overrides": "attack=null;data.partition={name: shard}"}

PREPARE = """
import json, sys
from flwr.app import Context, RecordDict
from fedsim.deploy.run_config import scenario_from_context
from fedsim.runtime import runtime_for
ctx = Context(run_id=1, node_id=1000, node_config={}, state=RecordDict(), run_config=json.loads(sys.argv[1]))
runtime_for(scenario_from_context(ctx)).partitions
print(json.dumps(sorted({m.partition(".")[0] for m in sys.modules})))
"""

TRAIN = """
import json, sys
from fedsim.client.app import app
imported = sorted({m.partition(".")[0] for m in sys.modules})
from flwr.app import ConfigRecord, Context, Message, RecordDict
from fedsim.deploy.run_config import scenario_from_context
from fedsim.flower.compat import act_as_superlink, stamp_message_id
from fedsim.runtime import runtime_for
from fedsim.wire import pack_model
act_as_superlink(run_id=1)
ctx = Context(run_id=1, node_id=1000, node_config={"partition-id": 3, "num-partitions": 20}, state=RecordDict(),
              run_config=json.loads(sys.argv[1]))
rt = runtime_for(scenario_from_context(ctx))  # the server's part: the global model the message carries
msg = Message(RecordDict({"arrays": pack_model(rt.initial_weights(), rt.layout),
                          "config": ConfigRecord({"server-round": 1})}), dst_node_id=1000, message_type="train",
              group_id="1")
stamp_message_id(msg, "train-1")
reply = app(msg, ctx)
print(json.dumps({"imported": imported, "trained": sorted({m.partition(".")[0] for m in sys.modules}),
                  "error": reply.error.reason if reply.has_error() else None,
                  "num_examples": None if reply.has_error() else reply.content["metrics"]["num-examples"]}))
"""


def fresh_python(code: str, cache: Path) -> dict | list:
    env = {**os.environ, "FEDSIM_CACHE": "1", "FEDSIM_CACHE_DIR": str(cache), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code, json.dumps(RUN_CONFIG)], capture_output=True, text=True,
                         env=env, cwd=cache, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def device_run(tmp_path_factory) -> dict:
    cache = tmp_path_factory.mktemp("device-cache")
    prepared = fresh_python(PREPARE, cache)
    assert "flwr_datasets" in prepared, "the first process did not compute the partition"
    return fresh_python(TRAIN, cache)


def test_importing_the_client_app_imports_nothing_a_device_lacks(device_run):
    heavy = [m for m in FORBIDDEN if m in device_run["imported"]]
    assert not heavy, f"`import fedsim.client.app` imported {heavy}; all top-level modules: {device_run['imported']}"


def test_an_honest_train_from_a_cached_partition_imports_nothing_a_device_lacks(device_run):
    assert device_run["error"] is None and device_run["num_examples"] > 0
    heavy = [m for m in FORBIDDEN if m in device_run["trained"]]
    new = sorted(set(device_run["trained"]) - set(device_run["imported"]))
    assert not heavy, f"an honest train imported {heavy}; imported by the train: {new}"


def device_closure() -> set[str]:
    """Every distribution that installing deploy/device-requirements.txt installs (by installed metadata)."""
    todo = [Requirement(line).name for line in DEVICE_REQUIREMENTS.read_text().splitlines()
            if line.strip() and not line.lstrip().startswith("#")]
    seen: set[str] = set()
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        for text in requires(name) or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen


def test_the_device_requirements_install_every_module_the_train_imported(device_run):
    owners = packages_distributions()
    allowed = device_closure() | {"fedsim", "pip", "setuptools"}  # fedsim itself; what a new venv holds
    missing = {m: owners[m] for m in device_run["trained"]
               if m in owners and m not in OPTIONAL
               and not any(canonicalize_name(d) in allowed for d in owners[m])}
    assert not missing, f"imported on the client path but not installed by {DEVICE_REQUIREMENTS.name}: {missing}"


def test_a_central_partition_without_flwr_datasets_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "flwr_datasets", None)  # import fails as if not installed
    labels = np.repeat(np.arange(4), 5)
    with pytest.raises(ModuleNotFoundError, match="central partitions need flwr-datasets") as err:
        PARTITIONERS.get("shard").obj(labels, 2, 0, ShardParams())
    assert MISSING_FLWR_DATASETS in str(err.value) and err.value.name == "flwr_datasets"


def test_digits_without_scikit_learn_says_what_to_install(monkeypatch):
    """A device install has no scikit-learn: the digits dataset must say so, not fail with a bare import error."""
    import builtins

    from fedsim.data.digits import DigitsParams, load_digits

    real_import = builtins.__import__

    def no_sklearn(name, *args, **kwargs):
        if name == "sklearn" or name.startswith("sklearn."):
            raise ModuleNotFoundError(f"No module named '{name}'", name=name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_sklearn)
    with pytest.raises(ModuleNotFoundError, match="ships with scikit-learn.*local-data"):
        load_digits(None, DigitsParams())
