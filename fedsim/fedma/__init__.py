"""FedMA (Wang et al., ICLR 2020) as one round protocol: BBP-MAP matching (matching.py), the
server's K + 1 message exchanges per round (exchange.py), the client's step (client.py) and the
chain of matchable layers (arch.py). Importing it registers the `fedma` protocol."""

from fedsim.fedma import matching  # noqa: F401  (registers)
