"""FedAvg (aggregators/fedavg.py) against a hand computation."""

from __future__ import annotations

import pytest
import torch

from fedsim.aggregators import AggregationError
from fedsim.aggregators.fedavg import fedavg


def test_fedavg_hand_computation():
    updates = torch.tensor([[1.0, 0.0, 2.0], [3.0, 4.0, -2.0]])
    weights = torch.tensor([1.0, 3.0])
    # (1*[1,0,2] + 3*[3,4,-2]) / 4 = [10, 12, -4] / 4
    assert torch.allclose(fedavg(updates, weights), torch.tensor([2.5, 3.0, -1.0]))


def test_fedavg_rejects_zero_weight():
    with pytest.raises(AggregationError):
        fedavg(torch.ones(2, 3), torch.zeros(2))
