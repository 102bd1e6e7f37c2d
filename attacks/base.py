"""Attack interfaces, kept in two kinds.

* Client-side attacks (`side = "client"`) change what an attacker client trains on and how
  (edge-case data, triggers, PGD, model replacement). They run inside the ClientApp.
* Server-side omniscient model poisoning (`side = "server"`, simulation only) replaces the
  malicious clients' updates after seeing the honest ones, just before the defenses run:
  `craft(honest [h, d], num_malicious, ctx) -> malicious [m, d]`.

Every attack's parameter model extends `AttackParams`, which says who the attackers are and when
they take part.
"""

from __future__ import annotations

import torch

from fedsim.updates import RoundContext


class ServerAttack:
    """Base of the omniscient model-poisoning attacks run by the simulated server (simulation only)."""

    side = "server"

    def __init__(self, params) -> None:
        self.params = params

    def craft(self, honest: torch.Tensor, num_malicious: int, ctx: RoundContext) -> torch.Tensor:
        raise NotImplementedError
