"""Defenses applied around aggregation; each registers itself in `fedsim.registry.DEFENSES`."""

from fedsim.defenses.base import Defense, RoundContext, UpdateBatch
from fedsim.defenses import clipping, flame, foolsgold  # noqa: F401  (registers)
from fedsim.defenses import fldetector  # noqa: F401  (registers)
from fedsim.defenses import freqfed, rlr  # noqa: F401  (registers)
from fedsim.defenses import crfl  # noqa: F401  (registers)
from fedsim.defenses import deepsight  # noqa: F401  (registers)
from fedsim.defenses import dp_fedavg  # noqa: F401  (registers)
from fedsim.defenses import alignins  # noqa: F401  (registers)
from fedsim.defenses import fedgame  # noqa: F401  (registers)
from fedsim.defenses import backdoor_indicator  # noqa: F401  (registers)
from fedsim.defenses import crowdguard  # noqa: F401  (registers)
from fedsim.defenses import fedredefense, flshield, mars, snowball  # noqa: F401  (registers)
from fedsim.defenses import flip, lockdown  # noqa: F401  (registers)

__all__ = ["Defense", "RoundContext", "UpdateBatch"]
