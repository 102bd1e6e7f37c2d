"""Aggregation rules: pure functions of stacked client updates.

Contract: `rule(updates: Tensor[n, d] float32, weights: Tensor[n] float32, **params) -> Tensor[d]`.
`weights` are the clients' example counts (not normalised). Rules are vectorized torch with no
Flower import; each registers itself in `fedsim.registry.AGGREGATORS` with its parameter model.
A rule that cannot run on the given n (e.g. Krum needs n >= 2f + 3) raises `AggregationError`.
"""

from fedsim.aggregators.base import AggregationError
from fedsim.aggregators import fedavg  # noqa: F401  (registers)
from fedsim.aggregators import krum, coordinate, bulyan, rfa  # noqa: F401  (register)
from fedsim.aggregators import fltrust  # noqa: F401  (registers)
from fedsim.aggregators import dnc, signguard  # noqa: F401  (register)
from fedsim.aggregators import detox  # noqa: F401  (registers; nests the rules above)
from fedsim.aggregators import centered_clipping, mixing  # noqa: F401  (register; bucketing and nnm wrap an inner rule)
from fedsim.aggregators import mda, smea, caf, meamed, monna  # noqa: F401  (register; ByzFL's robust rules)
from fedsim.aggregators import arc  # noqa: F401  (registers; adaptive clipping wraps an inner rule)

__all__ = ["AggregationError"]
