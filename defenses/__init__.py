"""Defenses applied around aggregation; each registers itself in `fedsim.registry.DEFENSES`."""

from defenses.base import Defense, RoundContext, UpdateBatch

__all__ = ["Defense", "RoundContext", "UpdateBatch"]
