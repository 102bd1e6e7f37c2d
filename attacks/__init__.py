"""Attacks: client-side (run in the ClientApp) and server-side omniscient model poisoning."""

from fedsim.attacks.base import AttackParams, ClientAttack, Crafted, ServerAttack
from fedsim.attacks import edge_case  # noqa: F401  (registers)
from fedsim.attacks import byzantine  # noqa: F401  (registers)
from fedsim.attacks import trigger  # noqa: F401  (registers)
from fedsim.attacks import label_flip  # noqa: F401  (registers)
from fedsim.attacks import iba  # noqa: F401  (registers)
from fedsim.attacks import chameleon  # noqa: F401  (registers)
from fedsim.attacks import fang  # noqa: F401  (registers)
from fedsim.attacks import mimic  # noqa: F401  (registers)
from fedsim.attacks import blended  # noqa: F401  (registers)
from fedsim.attacks import neurotoxin  # noqa: F401  (registers)
from fedsim.attacks import a3fl  # noqa: F401  (registers)
from fedsim.attacks import alie_colluding  # noqa: F401  (registers)
from fedsim.attacks import edge_backdoor  # noqa: F401  (registers)
from fedsim.attacks import critical_layers  # noqa: F401  (registers)
from fedsim.attacks import poisonedfl  # noqa: F401  (registers)
from fedsim.attacks import threedfed  # noqa: F401  (registers)
from fedsim.attacks import f3ba  # noqa: F401  (registers)
from fedsim.attacks import darkfed  # noqa: F401  (registers)

__all__ = ["AttackParams", "ClientAttack", "Crafted", "ServerAttack"]
