"""Upload codecs; importing this registers them."""

from fedsim.compression import none  # noqa: F401  (registers)
from fedsim.compression import accordion, powersgd, quantize, sparse, ternary  # noqa: F401  (registers)
from fedsim.compression.base import Codec, PayloadError

__all__ = ["Codec", "PayloadError"]
