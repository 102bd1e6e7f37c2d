"""Scenario settings FedMA cannot work with, refused at validation (declared as the `fedma`
protocol's `scenario_check` in its registry entry)."""

from __future__ import annotations

from typing import Any


def fedma_conflicts(sc) -> list[tuple[str, str, Any]]:
    """Settings FedMA's layer-wise matching cannot work with, refused before anything runs."""
    from fedsim.models.nets import resizable
    from fedsim.registry import ATTACKS, COMPRESSORS

    both = "aggregator.name=fedma"
    out = []
    if sc.lowrank is not None:
        out.append(("lowrank", f"{both} matches the neurons of full layers; lowrank.name={sc.lowrank.name} factorizes them: drop one",
                    sc.lowrank.name))
    if not COMPRESSORS.get(sc.compression.name).traits.dense:
        out.append(("compression", f"{both} uploads whole layers whose width changes every exchange; compression.name="
                    f"{sc.compression.name} encodes fixed-shape model updates: set compression to none", sc.compression.name))
    if sc.defenses:
        out.append(("defenses", f"{both} aggregates layers of varying width, not [n, d] updates; defenses="
                    f"{[d.name for d in sc.defenses]} need the latter: remove them", [d.name for d in sc.defenses]))
    if sc.model.name not in resizable():
        out.append(("model", f"{both} grows hidden layers; model.name={sc.model.name} cannot be resized (allowed: {resizable()})",
                    sc.model.name))
    if sc.attack is not None:
        attack = ATTACKS.get(sc.attack.name).obj(sc.attack)
        if attack.side != "client" or not attack.poisons_data_only():
            mode = getattr(sc.attack, "mode", None)
            what = f"attack.name={sc.attack.name}" + (f" (mode {mode})" if mode else "")
            out.append(("attack", f"{both} supports data-poisoning attackers only; {what} needs the [n, d] update protocol "
                        "(server-side crafting, PGD projection or update scaling)", sc.attack.name))
    server = sc.server
    if server.optimizer != "sgd" or server.lr != 1.0 or server.momentum != 0.0:
        out.append(("server", f"{both} builds the new global model by matching, not by adding an update; server.optimizer="
                    f"{server.optimizer} (lr {server.lr}, momentum {server.momentum}) has nothing to step: leave server at its "
                    "defaults", server.optimizer))
    if sc.aggregator.local_init and (sc.init.checkpoint or sc.init.pretrain_epochs):
        out.append(("aggregator.local_init", "aggregator.local_init=true starts every client from its own initialisation, so "
                    "init.checkpoint / init.pretrain_epochs would be ignored: set aggregator.local_init=false to start from them",
                    True))
    return out
