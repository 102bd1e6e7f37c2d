"""Models and the flat parameter layout; importing this registers the networks."""

from fedsim.models import nets  # noqa: F401  (registers)
from fedsim.models.layout import ModelLayout

__all__ = ["ModelLayout"]
