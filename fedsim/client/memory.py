"""What a client remembers between rounds (GRACE's "memory" role): its codec's residual (error
feedback) and, for an attacker, its attack's own arrays (a trigger it keeps optimising); for an
honest client under a defense with a client part, that defense's arrays (FLIP's triggers, Lockdown's mask).

Kept in Flower's `context.state`, so it lasts across rounds in simulation and on a device alike;
with a state folder (`state_dir`, or a SuperNode's `--node-config 'state-dir="..."'`) it is also
saved there each round on the client's own disk, so a resumed run or a restarted device continues
with it (fedsim/runs/checkpoint.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from fedsim.runs.checkpoint import load_client, save_client
from fedsim.wire import pack_payload

CLIENT_STATE = "client-state"  # the context.state record holding the codec's and the attacker's arrays
ATTACK_MEMORY = "attack."  # prefix of an attacker's own arrays in the client's saved state
DEFENSE_MEMORY = "defense."  # prefix of a client-side defense's arrays in an honest client's saved state
LAYOUT_DIM = "layout-dim"  # the model size the codec's residual was made for


@dataclass
class ClientMemory:
    codec: dict[str, np.ndarray] = field(default_factory=dict)  # the codec's state (error-feedback residual)
    attack: dict[str, np.ndarray] = field(default_factory=dict)  # the attack's own arrays, updated in place
    defense: dict[str, np.ndarray] = field(default_factory=dict)  # a client-side defense's arrays, updated in place

    @classmethod
    def recall(cls, context, pid: int, rnd: int, state_dir: str | None) -> "ClientMemory":
        """This client's memory: from its context, or, in a resumed run, from its state folder."""
        state = {}
        if CLIENT_STATE in context.state:
            state = {k: v.numpy() for k, v in context.state[CLIENT_STATE].items()}
        elif state_dir is not None:
            state = load_client(state_dir, pid, rnd) or {}
        def take(prefix: str) -> dict[str, np.ndarray]:
            return {k[len(prefix):]: state.pop(k) for k in list(state) if k.startswith(prefix)}

        attack, defense = take(ATTACK_MEMORY), take(DEFENSE_MEMORY)
        return cls(state, attack, defense)

    def codec_state(self, dim: int) -> dict[str, np.ndarray]:
        """The codec's state for a model of `dim` parameters: none if the model was factorized since
        (old residuals no longer fit)."""
        if self.codec and int(self.codec.pop(LAYOUT_DIM, [dim])[0]) != dim:
            self.codec = {}
        return self.codec

    def keep(self, context, pid: int, rnd: int, state_dir: str | None, codec_state: dict, dim: int) -> None:
        """Remember the codec's new state and the attack's or defense's arrays for the next round."""
        state = dict(codec_state)
        if state:
            state[LAYOUT_DIM] = np.array([dim], dtype=np.int64)
        state.update({ATTACK_MEMORY + k: np.asarray(v) for k, v in self.attack.items()})
        state.update({DEFENSE_MEMORY + k: np.asarray(v) for k, v in self.defense.items()})
        if state:
            context.state[CLIENT_STATE] = pack_payload(state)
            if state_dir is not None:
                save_client(state_dir, pid, rnd, state)
