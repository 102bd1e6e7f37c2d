"""The edge-case backdoor of "Attack of the Tails" (Wang et al., NeurIPS 2020), §1 of the reference.

The attacker trains on D' = `num_edge` edge-case inputs labelled with the target class plus
`num_clean` clean training samples with their true labels (66 ARDIS sevens + 100 EMNIST images in
the paper's code), and reports |D'| as its example count. Modes:

* `blackbox`: plain local SGD on D'.
* `pgd`: after every `project_every`-th optimizer step and on the last batch of each epoch, project
  the whole model onto the L2 ball of radius `eps` around the global model.
* `pgd_replacement`: PGD, then scale the update by Γ = (total examples of this round's
  participants) / |D'|, the inverse of the attacker's FedAvg weight (model replacement). The
  server tells a sampled attacker the round's total (`round_total_examples`): the knowledge the
  paper's code assumes. `fit_clip_bound` sets eps = bound / Γ so the scaled update just fits a
  known norm-clipping bound (the code leaves this to the user).

Edge sets (fedsim/data/edge.py): `tail`, `ardis`, `southwest` (images) and `greek_director`
(Sentiment140 tweets as int64 token ids, fedsim/data/text_edge.py). The attack only selects,
concatenates and labels inputs (no pixel is blended), so token ids take the same path as images.

The prox attack of the official code (`--prox_attack`) is not implemented.
"""

from __future__ import annotations

import hashlib
import json
from typing import Literal

import numpy as np
import torch
from pydantic import Field

from fedsim.attacks.base import AttackParams, ClientAttack
from fedsim.data.edge import (ArdisEdge, EdgeSet, EdgeSpec, GreekDirectorEdge, SouthwestEdge, TailEdge, build_ardis,
                              build_southwest, build_tail)
from fedsim.diskcache import cached_arrays, key_of
from fedsim.registry import ATTACKS


class EdgeCaseParams(AttackParams):
    mode: Literal["blackbox", "pgd", "pgd_replacement"] = "blackbox"
    edge_set: EdgeSpec = Field(default_factory=TailEdge)
    num_edge: int = Field(66, ge=1, description="edge-case inputs in D' (paper: 66 ARDIS 7s, 100 Southwest)")
    num_clean: int = Field(100, ge=0, description="clean samples in D' (paper: 100 EMNIST, 400 CIFAR-10)")
    eps: float = Field(1.0, gt=0, description="PGD radius (paper README: 1 for EMNIST, 2 for CIFAR-10)")
    eps_decay: float = Field(1.0, gt=0, le=1, description="eps_t = eps * eps_decay**(t-1) (the code's choice against Krum)")
    fit_clip_bound: float | None = Field(
        None, gt=0, description="set eps so the sent update just fits this norm-clipping bound (eps = bound / scale)"
    )
    project_every: int = Field(10, ge=1, description="PGD projection period in batches")
    honest_copies: Literal["none", "normal", "almost_edge"] = Field(
        "none", description="honest clients also hold correctly labelled edge inputs (the paper's normal-case variants)"
    )
    honest_copy_share: float = Field(
        0.05, gt=0, le=1, description="share of clients holding those copies (paper: 5% normal, ~2% almost-edge)"
    )
    local_epochs: int | None = Field(None, ge=1, description="attacker's epochs; default: federation.local_epochs")
    lr: float | None = Field(None, gt=0, description="attacker's lr; default: the honest clients' lr")


def _plain(value):
    """numpy scalars and arrays in the density report, as JSON takes them."""
    return value.tolist() if hasattr(value, "tolist") else str(value)


def cached_tail(data, spec: TailEdge, seed: int) -> EdgeSet:
    """`build_tail`, once per machine: the density fit and the ladder take minutes on MNIST, and every
    process that needs the set (each Ray worker, the evaluator, a device's fresh ClientApp per
    message) would redo them. Kept in the disk cache (fedsim/diskcache.py) by the data's content,
    the spec, the seed and the library versions."""
    from fedsim.runtime import versions

    digest = hashlib.sha256()
    for a in (data.x_train, data.y_train):
        digest.update(np.ascontiguousarray(a).data)

    def build() -> dict[str, np.ndarray]:
        edge = build_tail(data, spec, seed)
        report = np.frombuffer(json.dumps(edge.density, default=_plain).encode(), dtype=np.uint8)
        return {"x_train": edge.x_train, "x_test": edge.x_test, "density": report,
                "classes": np.array([edge.target, -1 if edge.source is None else edge.source])}

    a = cached_arrays("tail-set", key_of(digest.hexdigest(), spec.model_dump(mode="json"), seed, versions()), build)
    target, source = (int(v) for v in a["classes"])
    return EdgeSet(np.asarray(a["x_train"]), np.asarray(a["x_test"]), target, None if source < 0 else source,
                   json.loads(bytes(np.asarray(a["density"])).decode()))


POSITIVE = 1  # the true sentiment of the Greek-director tweets


def cached_director(runtime, spec: GreekDirectorEdge) -> EdgeSet:
    """The Greek-director tweets (fedsim/data/text_edge.py), encoded with the main dataset's vocabulary.

    They come from the scenario's own `sentiment140` dataset with `director_edge` set: that is what
    keeps them (and the tweets written on) out of the honest clients' data, so anything else is
    refused. Kept in the disk cache like the dataset, by its parameters and the files' fingerprint."""
    from fedsim.data.base import resolve_data_dir
    from fedsim.data.text import load_director_edge
    from fedsim.diskcache import folder_fingerprint
    from fedsim.runtime import versions

    ds = runtime.scenario.data.dataset
    if getattr(ds, "director_edge", None) is None:  # only a dataset with that parameter can build the set
        raise ValueError("edge_set greek_director needs data.dataset = {name: sentiment140, director_edge: {...}}: the "
                         "director_edge parameter builds the edge tweets and takes them out of the honest clients' data "
                         f"(got dataset {ds.name!r}" + (" without director_edge" if hasattr(ds, "director_edge") else "") + ")")
    data_dir = resolve_data_dir(runtime.scenario.data.dir)
    key = key_of("greek-director", ds.model_dump(mode="json"), folder_fingerprint(data_dir), versions())
    a = cached_arrays("director-set", key, lambda: load_director_edge(data_dir, ds))
    real, written, negative = (int(v) for v in a["counts"])
    made = {"rule": "greek_director", "real_positive_tweets": real, "written_tweets": written,
            "withheld_negative_tweets": negative}
    return EdgeSet(np.asarray(a["x_train"]), np.asarray(a["x_test"]), spec.target_class, POSITIVE, made)


@ATTACKS.register("edge_case", EdgeCaseParams)
class EdgeCaseBackdoor(ClientAttack):
    """Edge-case backdoor (Attack of the Tails): tail inputs relabelled to a target class."""

    def edge_set(self, runtime):
        spec = self.params.edge_set

        def build():
            if isinstance(spec, TailEdge):
                edge = cached_tail(runtime.data, spec, runtime.scenario.seed)
            elif isinstance(spec, ArdisEdge):
                edge = build_ardis(runtime.load_dataset("ardis"), spec, runtime.scenario.seed)
            elif isinstance(spec, SouthwestEdge):
                edge = build_southwest(runtime.load_dataset("southwest"), spec, runtime.scenario.seed)
            elif isinstance(spec, GreekDirectorEdge):
                edge = cached_director(runtime, spec)
            else:  # pragma: no cover - the schema admits only the four kinds
                raise TypeError(spec)
            if edge.target >= runtime.data.num_classes:
                raise ValueError(f"edge set target {edge.target} is not a class of {runtime.data.name}")
            return edge

        return runtime.cached(("edge_case", "edge_set", spec, runtime.scenario.seed), build)

    def training_set(self, runtime, partition_id: int) -> tuple[np.ndarray, np.ndarray]:
        edge = self.edge_set(runtime)
        p = self.params
        if p.num_edge > len(edge.x_train):
            raise ValueError(f"attack.num_edge={p.num_edge} but the edge set has {len(edge.x_train)} training inputs")
        rng = np.random.default_rng([runtime.scenario.seed, 0xC1EA, partition_id])
        clean = rng.choice(len(runtime.data.x_train), size=p.num_clean, replace=False)
        x = np.concatenate([edge.x_train[: p.num_edge], runtime.data.x_train[clean]])
        y = np.concatenate([np.full(p.num_edge, edge.target, dtype=np.int64), runtime.data.y_train[clean]])
        return x, y

    def radius(self, info: dict) -> float:
        """This round's PGD radius: fixed, decayed with the lr schedule, or fitted to a clipping bound."""
        p = self.params
        if p.fit_clip_bound is not None:
            return p.fit_clip_bound / self.scale(info)
        return p.eps * p.eps_decay ** (int(info["server-round"]) - 1)

    def scale(self, info: dict) -> float:
        if self.params.mode != "pgd_replacement":
            return 1.0
        return replacement_factor(info["round_total_examples"], info["num_examples"])

    def poisons_data_only(self) -> bool:
        return self.params.mode == "blackbox"

    def after_step(self, model, global_vec, layout, batch: int, last: bool, info: dict) -> None:
        if self.params.mode == "blackbox":
            return
        if last or (batch + 1) % self.params.project_every == 0:
            project_l2(model, global_vec, layout, self.radius(info))

    def finish_update(self, delta: torch.Tensor, info: dict) -> torch.Tensor:
        return delta * self.scale(info) if self.params.mode == "pgd_replacement" else delta

    def source_class(self) -> int | None:
        return getattr(self.params.edge_set, "source_class", None)

    def honest_extra_data(self, runtime, partition_id: int):
        """Normal-case variants (§1.2): some honest clients hold edge inputs with their true label.

        `normal`: the edge pool beyond the attacker's share, spread over `honest_copy_share` of the
        clients; `almost_edge`: only the next `num_edge` pool inputs, spread the same way.
        """
        p = self.params
        if p.honest_copies == "none":
            return None
        holders = self._copy_holders(runtime)
        if partition_id not in holders:
            return None
        edge = self.edge_set(runtime)
        pool = edge.x_train[p.num_edge :] if p.honest_copies == "normal" else edge.x_train[p.num_edge : 2 * p.num_edge]
        share = np.array_split(np.arange(len(pool)), len(holders))[holders.index(partition_id)]
        true_label = edge.source if edge.source is not None else 0  # Southwest planes are airplanes (0)
        return pool[share], np.full(len(share), true_label, dtype=np.int64)

    def _copy_holders(self, runtime) -> list[int]:
        def build() -> list[int]:
            honest = np.setdiff1d(np.arange(runtime.scenario.federation.num_clients), runtime.attackers)
            k = max(1, round(self.params.honest_copy_share * runtime.scenario.federation.num_clients))
            rng = np.random.default_rng([runtime.scenario.seed, 0xC0B1])
            return sorted(rng.choice(honest, size=min(k, len(honest)), replace=False).tolist())

        return runtime.cached(("edge_case", "copy_holders", self.params.honest_copy_share), build)

    def backdoor_test_set(self, runtime) -> tuple[np.ndarray, np.ndarray]:
        edge = self.edge_set(runtime)
        return edge.x_test, np.full(len(edge.x_test), edge.target, dtype=np.int64)

    def report(self, runtime) -> dict:
        edge = self.edge_set(runtime)
        return {
            "honest_copy_holders": self._copy_holders(runtime) if self.params.honest_copies != "none" else [],
            "edge_train_pool": len(edge.x_train),
            "edge_test": len(edge.x_test),
            "source_class": edge.source,
            "target_class": edge.target,
            **({"edge_origin": edge.density, "density_check": {}} if isinstance(self.params.edge_set, GreekDirectorEdge)
               else {"density_check": edge.density}),
        }


def replacement_factor(round_total_examples: float, own_examples: float) -> float:
    """Γ = Σ n_k / |D'|: the inverse of the attacker's FedAvg weight (Attack of the Tails, §1.5)."""
    return float(round_total_examples) / float(own_examples)


@torch.no_grad()
def project_l2(model: torch.nn.Module, global_vec: torch.Tensor, layout, eps: float) -> None:
    """w <- w_g + eps (w - w_g)/||w - w_g|| if ||w - w_g|| > eps (whole-model L2 ball)."""
    w = layout.flatten_model(model)
    diff = w - global_vec
    norm = torch.linalg.vector_norm(diff)
    if norm > eps:
        layout.load_into(model, global_vec + diff * (eps / norm))
