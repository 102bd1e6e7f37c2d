"""Attacks: client-side (run in the ClientApp) and server-side omniscient model poisoning."""

from fedsim.attacks.base import AttackParams, ClientAttack, ServerAttack
from fedsim.attacks import edge_case  # noqa: F401  (registers)
from fedsim.attacks import byzantine  # noqa: F401  (registers)
from fedsim.attacks import trigger  # noqa: F401  (registers)
from fedsim.attacks import label_flip  # noqa: F401  (registers)

__all__ = ["AttackParams", "ClientAttack", "ServerAttack"]
