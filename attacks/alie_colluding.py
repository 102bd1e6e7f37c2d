"""ALIE by colluding clients: the attackers estimate μ and σ from their own benign updates.

The server-side `alie` (attacks/byzantine.py) crafts its updates from the *honest* clients'
updates: an omniscient attacker, and one that needs the server to see every update. Baruch et al.
(2019) state their attack without that knowledge as well: the m malicious workers each compute
their correct gradient, and the mean and standard deviation of those m gradients stand in for the
honest ones' (they are samples of the same distribution). This is that attack, run where an
attacker runs, on its client:

* every sampled attacker computes the benign update of every member of the attacker pool on the
  round's global model (the colluders exchange them over a side channel; the simulation has each
  colluder recompute them, each with that member's own data and training seed, so every colluder
  arrives at the same μ and σ);
* it sends μ + z·σ per coordinate, with z = z_max(n, f) for n = clients per round and f = the pool
  size unless set, and reports its own example count.

Because nothing here needs the server, it runs under secure aggregation (docs/secure_aggregation.md).
Simulation only: a colluder reads its partners' partitions.
"""

from __future__ import annotations

import numpy as np
import torch
from pydantic import Field, model_validator

from fedsim.attacks.base import AttackerRound, AttackParams, ClientAttack
from fedsim.attacks.byzantine import _std, alie_z_max
from fedsim.registry import ATTACKS
from fedsim.seeding import TRAIN, derive_seed


class ALIEColludingParams(AttackParams):
    num_attackers: int = Field(2, ge=1, description="colluders; at least 2 (a std needs two updates)")
    z: float | None = Field(None, description="deviation in colluders' stds; None = z_max(n = clients per round, f = pool size)")
    unbiased: bool = Field(True, description="unbiased std over the colluders' updates (as the NDSS'21 code's torch.std)")

    @model_validator(mode="after")
    def _two_colluders(self) -> "ALIEColludingParams":
        pool = len(self.attacker_ids) if self.attacker_ids is not None else self.num_attackers
        if pool < 2:
            raise ValueError(f"alie_colluding estimates a standard deviation from the attackers' own updates: "
                             f"it needs at least 2 attackers, got {pool}")
        return self


@ATTACKS.register("alie_colluding", ALIEColludingParams)
class ALIEColluding(ClientAttack):
    """A little is enough, non-omniscient: μ + z·σ of the colluding attackers' own benign updates."""

    simulation_only = True

    def training_set(self, runtime, partition_id: int) -> tuple[np.ndarray, np.ndarray]:
        return runtime.client_data(partition_id)

    def benign_updates(self, job: AttackerRound) -> tuple[torch.Tensor, float]:
        """([m, d] each pool member's honest update on this round's global model, trained with its own
        data and seed; their mean training loss)."""
        from fedsim.training import train

        scenario = job.runtime.scenario
        pool = self.params.resolve_attackers(scenario.federation.num_clients, scenario.seed)
        rows, losses = [], []
        for pid in pool:
            job.layout.load_into(job.model, job.global_vec)  # the round's model object, reset for each member
            x, y = self.training_set(job.runtime, pid)
            if len(x):
                losses.append(train(job.model, x, y, job.train, derive_seed(scenario.seed, TRAIN, job.round, pid))["loss"])
            rows.append(job.layout.flatten_model(job.model) - job.global_vec)
        return torch.stack(rows).to(torch.float64), float(np.mean(losses)) if losses else 0.0

    def z(self, job: AttackerRound, pool: int) -> float:
        if self.params.z is not None:
            return self.params.z
        return alie_z_max(job.runtime.scenario.federation.clients_per_round, pool)

    def local_train(self, job: AttackerRound) -> tuple[int, dict, dict]:
        x, _ = self.training_set(job.runtime, job.partition_id)
        benign, loss = self.benign_updates(job)
        mu, sigma = benign.mean(dim=0), _std(benign, self.params.unbiased)
        crafted = (mu + self.z(job, benign.shape[0]) * sigma).to(job.global_vec.dtype)
        job.layout.load_into(job.model, job.global_vec + crafted)
        return len(x), {"loss": loss}, {"num_examples": len(x), **job.config}
