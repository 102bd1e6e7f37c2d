"""FedMA's layer-wise protocol end to end (the matching core has its own tests in test_fedma.py).

Oracles: networks whose function must not change under the client-side re-indexing and the
server-side slicing; a single client with a flat prior, whose "matched" model must be exactly its
own locally trained network; Flower-level properties (bytes add up, the same seed gives the same
metrics, bad or missing replies are dropped with a reason and the round goes on); a resumed run
equal to an uninterrupted one; and the refusals at validation.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord

from conftest import run_local
from fedsim.server.record import without_times
from fedsim.fedma.arch import ChainArch, state_of
from fedsim.registry import MODELS
from fedsim.runs.folder import RunFolder
from fedsim.runs.results import read_rounds
from fedsim.runtime import runtime_for
from fedsim.scenario import ScenarioError, load_scenario
from fedsim.seeding import INIT, TRAIN, derive_seed
from fedsim.training import TrainConfig, train

SCENARIO = "scenarios/fedma/digits_mlp.yaml"
SMALL = [
    "federation.num_clients=4", "federation.clients_per_round=4", "federation.rounds=2",
    "federation.local_epochs=4", "aggregator.retrain_epochs=3", "federation.round_timeout=60",
]


def run(scenario, parent, checkpoints=False, **grid_kwargs):
    result = run_local(scenario, parent, checkpoints=checkpoints, **grid_kwargs)
    return result.rounds if not checkpoints else result.path


def arch_of(name: str, input_shape, params) -> ChainArch:
    return ChainArch.of(name, input_shape, 10, MODELS.get(name).params.model_validate(params))


ARCHS = [
    ("mlp", (64,), {"hidden": [6, 5]}, (6, 5), (9, 8)),
    ("lenet", (1, 8, 8), {"dropout": False}, (3, 4, 5), (6, 7, 9)),
    ("vgg9", (3, 32, 32), {}, (4, 4, 5, 5, 6, 6, 7, 7), (6, 5, 7, 8, 8, 9, 9, 8)),
]


def embed(arch: ChainArch, client: dict, global_widths, rng) -> tuple[dict, list[np.ndarray]]:
    """A wider 'global' network holding the client's neurons at random positions (others random)."""
    local_widths = arch.widths(client)
    assignments = [np.sort(rng.choice(g, size=w, replace=False)) for w, g in zip(local_widths, global_widths)]
    glob = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in state_of(arch.build(global_widths)).items()}
    for l, layer in enumerate(arch.layers):
        rows = assignments[l] if l < arch.num_matched else np.arange(10)
        w = client[layer.weight]
        if l == 0:
            glob[layer.weight][rows] = w
        else:
            kind, spatial = arch.links[l - 1]
            cols = assignments[l - 1]
            gw = glob[layer.weight]
            if kind == "conv_to_fc":
                view = gw.reshape(gw.shape[0], global_widths[l - 1], spatial)
                view[np.ix_(rows, cols)] = w.reshape(w.shape[0], -1, spatial)
            else:
                gw[np.ix_(rows, cols)] = w
        glob[layer.bias][rows] = client[layer.bias]
    return glob, assignments


@pytest.mark.parametrize("name,input_shape,params,local,wide", ARCHS)
def test_slicing_the_global_model_gives_back_the_client_network(name, input_shape, params, local, wide):
    arch = arch_of(name, input_shape, params)
    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    client = state_of(arch.build(local))
    glob, assignments = embed(arch, client, wide, rng)
    sliced = arch.slice_for_client(glob, assignments)
    assert all(np.array_equal(sliced[k], client[k]) for k in client)


@pytest.mark.parametrize("name,input_shape,params,local,wide", ARCHS)
def test_installing_matched_layers_keeps_the_client_function(name, input_shape, params, local, wide):
    """Client side of each exchange: the matched layer (own neurons at their assigned rows, other
    rows arbitrary) plus the re-indexed next layer compute exactly what the client computed."""
    arch = arch_of(name, input_shape, params)
    rng = np.random.default_rng(1)
    torch.manual_seed(1)
    client = state_of(arch.build(local))
    glob, assignments = embed(arch, client, wide, rng)
    x = torch.from_numpy(rng.standard_normal((7, *input_shape)).astype(np.float32))
    with torch.no_grad():
        want = arch.model(client).eval()(x)
    state = dict(client)
    for l in range(arch.num_matched):
        layer = arch.layers[l]
        rows = assignments[l]
        matched_w = state[layer.weight].copy()
        # the broadcast layer l: global rows, inputs already in the global order of layer l-1
        full = np.zeros((wide[l], *matched_w.shape[1:]), dtype=np.float32) + rng.standard_normal(1).astype(np.float32)
        full[rows] = matched_w
        bias = rng.standard_normal(wide[l]).astype(np.float32)
        bias[rows] = state[layer.bias]
        state[layer.weight], state[layer.bias] = full, bias
        arch.permute_into_global(state, l, rows, wide[l])
        with torch.no_grad():
            got = arch.model(state).eval()(x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_single_client_with_flat_prior_keeps_its_own_network(tmp_path):
    """J = 1, σ0 → ∞ and no retraining: every neuron is the client's own, the posterior mean is its
    weight and the per-class average of one client is itself, so the global model after round 1 is
    the client's locally trained network — computed here independently of the protocol."""
    scenario = load_scenario(SCENARIO, [
        "federation.num_clients=1", "federation.clients_per_round=1", "federation.rounds=1",
        "federation.local_epochs=2", "aggregator.retrain_epochs=0", "aggregator.sigma0=1e6",
        "model.hidden=[16, 12]", "data.partition=iid",
    ])
    run_dir = run(scenario, tmp_path / "run", checkpoints=True)
    rt = runtime_for(scenario)
    torch.manual_seed(derive_seed(scenario.seed, INIT, 0))
    local = rt.build_model()
    x, y = rt.client_data(0)
    fed = scenario.federation
    train(local, x, y, TrainConfig(fed.local_epochs, fed.batch_size, fed.lr, fed.momentum, fed.weight_decay),
          derive_seed(scenario.seed, TRAIN, 1, 0, 0))
    from fedsim.runs.checkpoint import load_server
    from fedsim.fedma.client import arch_for

    saved = load_server(run_dir, at_most=1)
    arch = arch_for(rt)
    assert saved["extra"]["fedma"]["widths"] == [16, 12]
    assert [list(a) for a in saved["extra"]["fedma"]["assignments"]["0"]] == [list(range(16)), list(range(12))]
    layout = rt.layout  # same widths as the default model
    glob = {k: v.numpy() for k, v in layout.unflatten(saved["global"]).items()}
    for k, v in state_of(local).items():
        np.testing.assert_allclose(glob[k], v, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        xt = torch.from_numpy(rt.data.x_test)
        assert torch.equal(arch.model(glob).eval()(xt).argmax(1), local.eval()(xt).argmax(1))


def test_rounds_record_widths_bytes_and_are_reproducible(tmp_path):
    scenario = load_scenario(SCENARIO, SMALL)
    first = run(scenario, tmp_path / "a")
    second = run(scenario, tmp_path / "b")
    assert without_times(first) == without_times(second)
    for r in first:
        assert r["exchanges"] == 2  # one hidden layer: local training + one retraining exchange
        assert r["rejected"] == {} and r["aggregated"] == [0, 1, 2, 3]
        assert r["global_widths"][0] >= 64  # at least one client's width; unmatched neurons add more
        assert r["bytes_up"] == sum(r["bytes_up_per_client"].values()) > 0
        assert r["bytes_down"] == sum(r["bytes_down_per_client"].values()) > 0
        assert r["model_growth"] == pytest.approx(r["model_params"] / (64 * 65 + 65 * 10))
    assert first[0]["main_accuracy"] > 0.6 and first[-1]["main_accuracy"] > 0.8


def test_lenet_rounds(tmp_path):
    scenario = load_scenario(SCENARIO, SMALL + ["model=lenet", "federation.rounds=1", "federation.local_epochs=5",
                                                "aggregator.retrain_epochs=2"])
    (r,) = run(scenario, tmp_path / "run")
    assert r["exchanges"] == 4  # conv1, conv2, fc1 matched, then the output layer
    widths = r["global_widths"]
    assert len(widths) == 3 and all(g >= d for g, d in zip(widths, (32, 64, 128)))
    assert r["main_accuracy"] > 0.3  # chance is 0.1


def test_a_bad_reply_mid_round_drops_that_client_only(tmp_path):
    scenario = load_scenario(SCENARIO, SMALL + ["federation.rounds=1", "model.hidden=[16, 12]"])

    def tamper(pid, reply):
        layer = reply.content.array_records.get("layer") if not reply.has_error() else None
        if pid == 2 and layer is not None and "class-counts" not in layer:  # a retraining exchange
            bad = layer["weight"].numpy().copy()
            bad[0, 0] = np.nan
            reply.content["layer"] = ArrayRecord({"weight": Array(bad), "bias": layer["bias"]})
        return reply

    (r,) = run(scenario, tmp_path / "run", tamper=tamper, fail={3})
    assert r["aggregated"] == [0, 1]
    assert "layer 1" in r["rejected"]["2"] and "NaN" in r["rejected"]["2"]
    assert "layer 0" in r["rejected"]["3"] and "out of memory" in r["rejected"]["3"]
    assert r["exchanges"] == 3 and r["main_accuracy"] is not None


def test_wrong_width_upload_rejected(tmp_path):
    scenario = load_scenario(SCENARIO, SMALL + ["federation.rounds=1"])

    def tamper(pid, reply):
        if pid == 1 and not reply.has_error() and "class-counts" not in reply.content["layer"]:
            layer = reply.content["layer"]
            w = layer["weight"].numpy()
            reply.content["layer"] = ArrayRecord({"weight": Array(w[:, :-1].copy()), "bias": layer["bias"]})
        return reply

    (r,) = run(scenario, tmp_path / "run", tamper=tamper)
    assert r["aggregated"] == [0, 2, 3] and "expected" in r["rejected"]["1"]


def test_resumed_fedma_run_matches_uninterrupted(tmp_path):
    scenario = load_scenario(SCENARIO, SMALL + ["federation.rounds=3", "federation.local_epochs=2",
                                                "aggregator.retrain_epochs=1"])

    class Killed(Exception):
        pass

    def go(run_dir, kill_after=None):
        def progress(record):
            if kill_after is not None and record["round"] == kill_after:
                raise Killed
        return run_local(scenario, RunFolder(run_dir), progress=progress, checkpoints=True).summary

    full, cut = RunFolder.create(scenario, tmp_path / "full").path, RunFolder.create(scenario, tmp_path / "cut").path
    go(full)
    with pytest.raises(Killed):
        go(cut, kill_after=1)
    go(cut)
    assert without_times(read_rounds(cut)) == without_times(read_rounds(full))


def test_data_poisoning_attacker_takes_part(tmp_path):
    scenario = load_scenario(SCENARIO, SMALL + [
        "federation.rounds=1",
        "attack={name: trigger, attacker_ids: [1], schedule: {name: every_round}, target_class: 0}",
    ])
    (r,) = run(scenario, tmp_path / "run")
    assert r["attackers"] == [1] and 1 in r["aggregated"]
    assert r["backdoor_success"] is not None


@pytest.mark.parametrize("override,names", [
    ("lowrank={name: pufferfish}", ("aggregator.name=fedma", "lowrank.name=pufferfish")),
    ("compression={name: topk}", ("aggregator.name=fedma", "compression.name=topk")),
    ("defenses=[norm_clipping]", ("aggregator.name=fedma", "norm_clipping")),
    ("attack={name: edge_case, mode: pgd}", ("aggregator.name=fedma", "attack.name=edge_case (mode pgd)")),
    ("attack={name: alie}", ("aggregator.name=fedma", "attack.name=alie")),
    ("attack={name: trigger, scale: auto}", ("aggregator.name=fedma", "attack.name=trigger")),
    ("init.pretrain_epochs=1", ("aggregator.local_init=true", "init.pretrain_epochs")),
])
def test_impossible_combinations_refused_naming_both(override, names):
    with pytest.raises(ScenarioError) as err:
        load_scenario(SCENARIO, [override])
    assert all(n in str(err.value) for n in names)


@pytest.mark.simulation
@pytest.mark.slow  # its own Ray start-up; kept out of the default run's single process
def test_on_ray_equals_in_process(tmp_path):
    """Through Flower's simulation engine (Ray actors, node state kept by Flower between the
    exchanges) the rounds are the same as with the in-process grid."""
    from fedsim.engine.simulate import simulate

    # a generous timeout: Ray's actors start (and import torch) inside the first exchange
    scenario = load_scenario(SCENARIO, SMALL + ["model.hidden=[16, 12]", "federation.round_timeout=600"])
    ray_rounds = read_rounds(simulate(scenario, run_dir=tmp_path / "ray"))
    local_rounds = run(scenario, tmp_path / "local")
    assert without_times(ray_rounds) == without_times(local_rounds)
    assert all(r["exchanges"] == 3 and len(r["aggregated"]) == 4 for r in ray_rounds)
