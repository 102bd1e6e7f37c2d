"""Models and the flat parameter layout; importing this registers the networks."""

from fedsim.models import nets, recurrent, resnet  # noqa: F401  (registers)
from fedsim.models.layout import ModelLayout

__all__ = ["ModelLayout"]
from fedsim.models import imprint  # noqa: E402,F401  (registers Robbing the Fed's malicious model, issue #36)
