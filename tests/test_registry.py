"""FedAvg against a hand computation, the flat layout, and the registry."""

from __future__ import annotations

import pytest
import torch

from fedsim.aggregators import AggregationError
from fedsim.aggregators.fedavg import fedavg
from fedsim.models.layout import ModelLayout
from fedsim.registry import ALL, MODELS, Params, Registry
from fedsim.scenario import validate_scenario


def test_fedavg_hand_computation():
    updates = torch.tensor([[1.0, 0.0, 2.0], [3.0, 4.0, -2.0]])
    weights = torch.tensor([1.0, 3.0])
    # (1*[1,0,2] + 3*[3,4,-2]) / 4 = [10, 12, -4] / 4
    assert torch.allclose(fedavg(updates, weights), torch.tensor([2.5, 3.0, -1.0]))


def test_fedavg_rejects_zero_weight():
    with pytest.raises(AggregationError):
        fedavg(torch.ones(2, 3), torch.zeros(2))


def test_layout_round_trip():
    model = MODELS.get("lenet").obj((1, 28, 28), 10, MODELS.get("lenet").params())
    layout = ModelLayout.of(model)
    vec = layout.flatten_model(model)
    assert vec.shape == (1_199_882,) and layout.dim == 1_199_882  # the PyTorch MNIST example net
    model2 = MODELS.get("lenet").obj((1, 28, 28), 10, MODELS.get("lenet").params())
    layout.load_into(model2, vec)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), model2.state_dict().values()))
    assert torch.equal(layout.unflatten(vec)["fc2.bias"], model.fc2.bias.detach())


def test_registry_rejects_duplicates_and_bad_params():
    reg = Registry("thing")
    reg.register("a")(object)
    with pytest.raises(ValueError):
        reg.register("a")(object)
    with pytest.raises(TypeError):
        reg.register("b", params=dict)(object)


@pytest.mark.parametrize("kind", sorted(ALL))
def test_every_registered_component_validates_in_a_scenario(kind):
    """Nothing can be registered and unusable: each name, with default parameters, is a valid scenario section."""
    section = {
        "aggregator": "aggregator", "defense": "defenses", "attack": "attack", "compressor": "compression",
        "model": "model", "dataset": None, "partitioner": None,
    }[kind]
    for entry in ALL[kind].entries():
        assert issubclass(entry.params, Params)
        entry.params()  # defaults are valid
        if section == "defenses":
            raw = {"defenses": [entry.name]}
        elif section is not None:
            raw = {section: entry.name}
        elif kind == "dataset":
            raw = {"data": {"dataset": entry.name}}
        else:
            raw = {"data": {"partition": entry.name}}
        if kind == "aggregator":  # DETOX's defaults (groups of 3, Multi-Krum f=1 inside) need 15 clients a round
            raw["federation"] = {"clients_per_round": 15}
        validate_scenario(raw)


def test_models_forward_on_their_inputs():
    for name, shape in [("mlp", (1, 8, 8)), ("lenet", (1, 28, 28)), ("vgg9", (3, 32, 32))]:
        entry = MODELS.get(name)
        out = entry.obj(shape, 10, entry.params())(torch.zeros(2, *shape))
        assert out.shape == (2, 10)


def test_readme_component_table_is_generated_from_the_registries():
    from pathlib import Path

    from fedsim.cli import component_table_markdown

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    table = readme.split("<!-- components:start -->\n")[1].split("<!-- components:end -->")[0]
    assert table == component_table_markdown(), "run `fedsim list --write-readme README.md`"


def test_readme_scenario_list_matches_the_scenarios_folder():
    from pathlib import Path

    from fedsim.cli import scenario_list_markdown

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    listed = readme.split("<!-- scenarios:start -->\n")[1].split("<!-- scenarios:end -->")[0]
    assert listed == scenario_list_markdown(), "run `fedsim list --write-readme README.md`"


def test_model_record_sized_once_adds_up_to_the_whole_message():
    import numpy as np
    from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

    from fedsim.wire import records_bytes

    arrays = ArrayRecord(array_dict={"w": Array(np.random.rand(777).astype(np.float32))})
    config = ConfigRecord({"server-round": 3, "lr": 0.1, "data-partition": 4})
    whole = records_bytes({"arrays": arrays, "config": config})
    assert whole == records_bytes({"arrays": arrays}) + records_bytes({"config": config}) > 4 * 777
