"""The server's central evaluation against a naive oracle: one forward per set, plain layout."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedsim.server.evaluation import CentralEvaluator
from fedsim.models.nets import LeNet
from fedsim.scenario import load_scenario


class _Runtime:
    """Just what CentralEvaluator reads: test data, and an attack with its backdoor set."""

    def __init__(self, scenario, x, y, backdoor):
        self.scenario = scenario
        self.data = type("Data", (), {"x_test": x, "y_test": y})()
        source = getattr(getattr(scenario.attack, "edge_set", None), "source_class", None)
        self.attack = type("Attack", (), {"backdoor_test_set": lambda _self, _rt: backdoor,
                                          "source_class": lambda _self: source})()


def _naive(model, x, y, x_bd, t_bd, source):
    model.eval()
    with torch.no_grad():
        logits = model(torch.from_numpy(x))
        bd = model(torch.from_numpy(x_bd)).argmax(1).numpy()
    pred = logits.argmax(1).numpy()
    return {
        "main_accuracy": float((pred == y).mean()),
        "main_loss": float(torch.nn.functional.cross_entropy(logits, torch.from_numpy(y))),
        "backdoor_success": float((bd == t_bd).mean()),
        "source_class_accuracy": float((pred[y == source] == source).mean()),
    }


@pytest.mark.parametrize("batch_size", [7, 256])
def test_conv_model_metrics_match_a_naive_evaluation(batch_size):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(300, 1, 28, 28)).astype(np.float32)
    y = rng.integers(0, 10, 300).astype(np.int64)
    x_bd = rng.normal(size=(40, 1, 28, 28)).astype(np.float32)
    t_bd = np.full(40, 1, dtype=np.int64)
    torch.manual_seed(0)
    model = LeNet((1, 28, 28), 10)
    scenario = load_scenario("scenarios/quickstart.yaml", [f"evaluation.batch_size={batch_size}"])
    y[:50] = 7  # enough source-class rows (quickstart's edge set maps 7 -> 1)
    evaluator = CentralEvaluator(_Runtime(scenario, x, y, (x_bd, t_bd)))
    got = evaluator(model)
    want = _naive(model, x, y, x_bd, t_bd, 7)
    for key in ("main_accuracy", "backdoor_success", "source_class_accuracy"):
        assert got[key] == want[key], key
    assert got["main_loss"] == pytest.approx(want["main_loss"], rel=1e-4)
    assert model.conv1.weight.is_contiguous()  # the caller's model keeps its own layout


def test_backdoor_success_beyond_what_the_clean_model_already_does():
    """Inputs the clean reference model already sends to the target are left out of the second rate."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(30, 1, 28, 28)).astype(np.float32)
    y = rng.integers(0, 10, 30).astype(np.int64)
    x_bd = rng.normal(size=(50, 1, 28, 28)).astype(np.float32)
    torch.manual_seed(1)
    clean, attacked = LeNet((1, 28, 28), 10).eval(), LeNet((1, 28, 28), 10).eval()
    with torch.no_grad():
        clean_pred = clean(torch.from_numpy(x_bd)).argmax(1).numpy()
        now = attacked(torch.from_numpy(x_bd)).argmax(1).numpy()
    target = int(np.bincount(clean_pred).argmax())  # a target the clean model already hits for some inputs
    t_bd = np.full(50, target, dtype=np.int64)
    scenario = load_scenario("scenarios/quickstart.yaml", [])
    got = CentralEvaluator(_Runtime(scenario, x, y, (x_bd, t_bd)), reference=clean)(attacked)
    fresh = clean_pred != target
    assert 0 < fresh.sum() < 50
    assert got["backdoor_success"] == float((now == target).mean())
    assert got["backdoor_success_beyond_clean"] == float((now[fresh] == target).mean())


def test_inputs_a_deployed_model_refuses_are_counted_and_never_correct():
    """FLIP's rejection (top softmax below τ) against a naive count: τ at the median confidence
    rejects about half of each set; a rejected input is never a hit."""
    rng = np.random.default_rng(2)
    x = rng.normal(size=(200, 1, 28, 28)).astype(np.float32)
    x_bd = rng.normal(size=(60, 1, 28, 28)).astype(np.float32)
    torch.manual_seed(2)
    model = LeNet((1, 28, 28), 10).eval()
    with torch.no_grad():
        probs, probs_bd = (torch.softmax(model(torch.from_numpy(a)), dim=1) for a in (x, x_bd))
    tau = float(probs.amax(dim=1).median())
    y = probs.argmax(1).numpy().copy()
    y[::3] = (y[::3] + 1) % 10  # a third wrong, the rest right
    t_bd = probs_bd.argmax(1).numpy()
    scenario = load_scenario("scenarios/quickstart.yaml", [f"defenses=[{{name: flip, confidence_threshold: {tau}}}]"])
    got = CentralEvaluator(_Runtime(scenario, x, y, (x_bd, t_bd)))(model)
    answered, answered_bd = (probs.amax(dim=1) >= tau).numpy(), (probs_bd.amax(dim=1) >= tau).numpy()
    assert 0.3 < answered.mean() < 0.7
    assert got["inputs_rejected"] == {"main": float((~answered).mean()), "backdoor": float((~answered_bd).mean())}
    assert got["main_accuracy"] == float(((probs.argmax(1).numpy() == y) & answered).mean())
    assert got["backdoor_success"] == float(answered_bd.mean())  # every backdoor input is sent to its "target"
