"""Attacks: client-side (run in the ClientApp) and server-side omniscient model poisoning."""

from attacks.base import AttackParams, ClientAttack, ServerAttack
from attacks import edge_case  # noqa: F401  (registers)
from attacks import byzantine  # noqa: F401  (registers)
from attacks import trigger  # noqa: F401  (registers)
from attacks import label_flip  # noqa: F401  (registers)

__all__ = ["AttackParams", "ClientAttack", "ServerAttack"]
