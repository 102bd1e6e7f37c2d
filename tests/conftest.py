"""Shared fixtures and helpers: where the real datasets are, a quick scenario builder, an in-process
run, a round context and an update batch."""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import pytest

if TYPE_CHECKING:
    from fedsim.runs.folder import RunFolder

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


def data_dir() -> Path | None:
    """FEDSIM_DATA_DIR if set, else ../shared/data when it exists."""
    env = os.environ.get("FEDSIM_DATA_DIR")
    if env and Path(env).is_dir():
        return Path(env)
    return SHARED_DATA if SHARED_DATA.is_dir() else None


@pytest.fixture
def one_torch_thread():
    """One torch intra-op thread for a test, as a simulated client runs (client_cpus 1): small ops on
    a busy 2-core machine run several times slower on two threads fighting over the cores, LAPACK's
    threaded SVD crawls (VGG-9's 512x4608 layers: ~20 s vs ~0.4 s), and bit-identity checks need it.
    A module uses it with `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def real_data_dir() -> Path:
    path = data_dir()
    if path is None:
        pytest.skip("../shared/data not found; set FEDSIM_DATA_DIR to a folder with the datasets")
    return path


# ------------------------------------------------------------------ shared test helpers
# Plain functions, not fixtures: module-level helpers and parametrize lists call them too. Import
# them as `from conftest import quick_scenario, run_local, round_context, update_batch`.

QUICKSTART = REPO / "scenarios" / "quickstart.yaml"
# a digits-sized edge-case attacker in every round: rotated 7s -> 1, from the tail set (no data directory needed)
TAIL_ATTACK = {"name": "edge_case", "num_attackers": 1, "schedule": {"name": "fixed_frequency", "every": 1, "first": 1},
               "edge_set": {"name": "tail", "source_class": 7, "target_class": 1, "transform": "rotate", "angle_range": [30, 90]},
               "num_edge": 20, "num_clean": 20}
QUICK: dict[str, Any] = {  # a small digits run: 6 clients, 3 a round, 2 rounds of 1 epoch, no attack
    "data": {"dataset": "digits"},
    "model": {"name": "mlp", "hidden": [16]},
    "federation": {"num_clients": 6, "clients_per_round": 3, "rounds": 2, "local_epochs": 1},
}


def quick_scenario(*overrides: str, base: str | Path | Mapping[str, Any] | None = None, **sections: Any):
    """A validated scenario (fedsim.scenario.validate_scenario), built in three steps:

    base:      QUICK when None, else a mapping or a scenario file (QUICKSTART, or a ready scenario's name);
    sections:  each keyword replaces that top-level key whole (`attack=None`, `federation={...}`);
    overrides: then `key.path=value` strings, as `fedsim run --set` applies them ("federation.rounds=1").

    With a file and overrides only, it is `load_scenario(base, overrides)`.
    """
    from fedsim.scenario import apply_overrides, read_yaml, validate_scenario

    if base is None or isinstance(base, Mapping):
        raw, source = copy.deepcopy(dict(QUICK if base is None else base)), "<quick scenario>"
    else:
        raw, source = read_yaml(base), str(base)
    if not isinstance(raw, dict):  # a file that is not a mapping: let validation name the problem
        return validate_scenario(raw, source)
    raw.update(copy.deepcopy(sections))
    return validate_scenario(apply_overrides(raw, list(overrides)), source)


class LocalRun(NamedTuple):
    rounds: list[dict]  # the lines of rounds.jsonl
    summary: dict  # what run_server returned (summary.json)
    path: Path  # the run folder


def run_local(scenario, where: str | Path | RunFolder, *, grid=None, nodes: int | None = None, progress=None,
              checkpoints: bool = False, client_states: bool = False, **grid_options: Any) -> LocalRun:
    """Run `scenario` in this process, without Ray: the real strategy (fedsim.server.app.run_server)
    drives a fedsim.flower.local_grid.LocalGrid whose nodes call the real ClientApp.

    where:         the parent of a fresh run folder, or a RunFolder used as it is (a run to resume);
    grid:          a grid of the test's own instead of the LocalGrid;
    nodes:         the LocalGrid's node count (default: federation.num_clients);
    client_states: clients keep their memory in the run folder's checkpoint/clients (as `fedsim run` does);
    grid_options:  LocalGrid's tamper / fail / offline / cohorts.
    A `progress` callback that raises stops the run there (the exception propagates).
    """
    from fedsim.client.app import make_client_app
    from fedsim.flower.local_grid import LocalGrid
    from fedsim.runs.folder import RunFolder
    from fedsim.runs.results import read_rounds
    from fedsim.server.app import run_server

    folder = where if isinstance(where, RunFolder) else RunFolder.create(scenario, where)
    if grid is None:
        app = make_client_app(scenario, folder.client_states if client_states else None)
        grid = LocalGrid(app, scenario.federation.num_clients if nodes is None else nodes, **grid_options)
    elif nodes is not None or grid_options:
        raise TypeError("nodes and LocalGrid options go with the LocalGrid, not with a grid of your own")
    summary = run_server(grid, scenario, folder.path, progress, checkpoints=checkpoints)
    return LocalRun(read_rounds(folder), summary, folder.path)


def attacked_and_clean(where: Path, attack: dict, *, checkpoints: bool = False, **sections: Any) -> tuple[LocalRun, float]:
    """A quick run with `attack` and the same run without it: (the attacked run, the backdoor success
    the clean run's final model already has on the attack's test set), the floor an attack must beat."""
    from fedsim.runs.checkpoint import load_server
    from fedsim.runtime import Runtime
    from fedsim.training import predict

    done = run_local(quick_scenario(attack=attack, **sections), where / "attacked", checkpoints=checkpoints)
    clean = run_local(quick_scenario(attack=None, **sections), where / "clean", checkpoints=True)
    rt = Runtime(quick_scenario(attack=attack, **sections))
    net = rt.build_model()
    rt.layout.load_into(net, load_server(clean.path, clean.rounds[-1]["round"])["global"])
    x, y = rt.attack.backdoor_test_set(rt)
    return done, float((predict(net, x)[0] == y).mean())


def round_context(d: int | None = None, rnd: int = 1, seed: int = 0, *, global_weights=None, layout=None,
                  bias: bool = False, previous=None, tools=None):
    """A fedsim.updates.RoundContext for round `rnd` of a flat model of `d` weights, its generator
    seeded with `seed`. Global weights zeros unless given (then `d` defaults to their size); the
    layout one tensor "w" of d values, or with `bias` "w" of d - 1 and "b" of 1, unless given."""
    import torch

    from fedsim.models.layout import ModelLayout
    from fedsim.updates import RoundContext

    if global_weights is None:
        if d is None:
            raise TypeError("round_context needs d or global_weights")
        global_weights = torch.zeros(d)
    d = global_weights.numel() if d is None else d
    if layout is None:
        layout = (ModelLayout(names=("w", "b"), shapes=((d - 1,), (1,))) if bias
                  else ModelLayout(names=("w",), shapes=((d,),)))
    return RoundContext(rnd, global_weights, layout, torch.Generator().manual_seed(seed),
                        previous_aggregate=previous, tools=tools)


def update_batch(rows=None, ids=None, weights=None, *, weight: float = 1.0, n: int | None = None,
                 d: int | None = None, seed: int = 0):
    """A fedsim.updates.UpdateBatch of `rows` ([n, d]: a tensor, an array or nested lists; as float32),
    or, with rows None, of `n` random rows of `d` values (update_samples.make_updates with `seed`, its
    example counts as the weights). Client ids 0..n-1 and every weight `weight` unless given."""
    import numpy as np
    import torch

    from fedsim.updates import UpdateBatch

    if rows is None:
        from update_samples import make_updates

        if n is None or d is None:
            raise TypeError("update_batch needs rows, or n and d")
        rows, counts = make_updates(n, d, seed)
        weights = counts if weights is None else weights
    rows = torch.as_tensor(rows if isinstance(rows, torch.Tensor) else np.asarray(rows), dtype=torch.float32)
    count = rows.shape[0]
    weights = torch.full((count,), float(weight)) if weights is None else torch.as_tensor(weights, dtype=torch.float32)
    return UpdateBatch(rows, weights, tuple(range(count)) if ids is None else tuple(ids))
