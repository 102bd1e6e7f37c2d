"""Models and the flat parameter layout; importing this registers the networks."""

from fedsim.models import nets, recurrent, resnet  # noqa: F401  (registers)
from fedsim.models.layout import ModelLayout

__all__ = ["ModelLayout"]
