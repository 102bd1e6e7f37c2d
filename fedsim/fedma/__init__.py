"""FedMA (Wang et al., ICLR 2020) as one protocol: BBP-MAP matching (matching.py), the layer-wise
strategy of K + 1 exchanges per round (strategy.py), the client's step (client.py) and the chain
of matchable layers (arch.py). Importing it registers the `fedma` aggregator."""

from fedsim.fedma import matching  # noqa: F401  (registers)
