"""What both sides derive from a scenario (data, partitions, model, attackers, codec), built once per process.

A Ray actor hosts many virtual clients: the runtime is cached per process by the scenario's
content, so the dataset is loaded and partitioned once per worker, not once per client call.
Everything here is read-only after construction except `cache`, which only memoises, through
`cached`: what the runtime and the attacks compute once per process (a dataset, a trigger's
pieces, an attacker's poisoned rows).
"""

from __future__ import annotations

import collections
import functools
import hashlib
import json
import os
import threading
from typing import Callable, TypeVar

import numpy as np
import torch

from fedsim.data.base import ArrayDataset, resolve_data_dir
from fedsim.data.local import cache_parts, dataset_facts, load_local, require_facts
from fedsim.data.partition import Partitions
from fedsim.diskcache import cache_dir, cached_arrays, folder_fingerprint, key_of
from fedsim.models.layout import ModelLayout
from fedsim.lowrank.layers import build_factorized
from fedsim.registry import ATTACKS, COMPRESSORS, DATASETS, MODELS, PARTITIONERS
from fedsim.scenario import scenario_dict
from fedsim.seeding import TORCH_GLOBAL_RNG
from fedsim.training import TrainConfig, train

T = TypeVar("T")


class Runtime:
    def __init__(self, scenario) -> None:
        self.scenario = scenario
        self.cache: dict = {}

    def cached(self, key: tuple, make: Callable[[], T]) -> T:
        """`make()` once per runtime, then the same object for the same `key`. A key is a tuple whose
        first element names its owner (the runtime's own "dataset", "layout"...; an attack's
        registry name, e.g. "iba"), then whatever the value depends on, so no two owners collide.
        Not locked: two threads asking at once may both compute it, and keep one."""
        if not isinstance(key, tuple) or not key or not isinstance(key[0], str):
            raise TypeError(f"a runtime cache key is a tuple led by its owner's name, got {key!r}")
        if key not in self.cache:
            value = make()
            self.cache.setdefault(key, value)
        return self.cache[key]

    # --- data -------------------------------------------------------------------------------
    def load_dataset(self, name: str, spec=None) -> ArrayDataset:
        """Load a registered dataset (memoised). `spec` defaults to the dataset's default parameters."""
        def build() -> ArrayDataset:
            entry = DATASETS.get(name)
            params = spec if spec is not None else entry.params()
            data_dir = None if entry.traits.embedded else resolve_data_dir(self.scenario.data.dir)

            def load() -> dict[str, np.ndarray]:
                d = entry.obj(data_dir, params)
                out = {"x_train": d.x_train, "y_train": d.y_train, "x_test": d.x_test, "y_test": d.y_test,
                       "num_classes": np.array([d.num_classes])}
                if d.groups is not None:  # each training example's writer / role (LEAF, Sentiment140)
                    out["groups"] = d.groups
                return out

            disk_key = key_of(name, params.model_dump(mode="json"), folder_fingerprint(data_dir), versions())
            a = cached_arrays("dataset", disk_key, load)
            return ArrayDataset(name, a["x_train"], a["y_train"], a["x_test"], a["y_test"], int(a["num_classes"][0]),
                                groups=a.get("groups"))

        return self.cached(("dataset", name, spec), build)

    @functools.cached_property
    def data(self) -> ArrayDataset:
        spec = self.scenario.data.dataset
        return self.load_dataset(spec.name, spec)

    def local_data(self, path: str) -> tuple[np.ndarray, np.ndarray]:
        """A device's own training set (node config `local-data`), read once per process and cached
        on disk by its files' fingerprint, so a fresh ClientApp process does not decode it again."""
        def build() -> tuple[np.ndarray, np.ndarray]:
            facts = require_facts(self.scenario.data.dataset, path)

            def load() -> dict[str, np.ndarray]:
                x, y = load_local(path, facts)
                return {"x": x, "y": y}

            a = cached_arrays("local-data", key_of(cache_parts(path, facts), versions()), load)
            return a["x"], a["y"]

        return self.cached(("local-data", str(path)), build)

    @functools.cached_property
    def partitions(self) -> Partitions:
        """Every client's row indices (fedsim/data/partition.py: `Partitions`, one array and a size
        per client, cached on disk: a million clients cost two arrays in each process)."""
        spec = self.scenario.data.partition
        entry = PARTITIONERS.get(spec.name)
        labels, n, seed = self.data.y_train, self.scenario.federation.num_clients, self.scenario.seed
        # a natural partition (one writer per client) also needs each example's writer
        extra = {"groups": self.data.groups} if entry.traits.needs_groups else {}

        def compute() -> dict[str, np.ndarray]:
            parts = Partitions.of(entry.obj(labels, n, seed, spec, **extra))
            if len(parts) != n:
                raise RuntimeError(f"partitioner {spec.name!r} gave {len(parts)} partitions for {n} clients")
            return {"indices": parts.indices, "sizes": parts.sizes}

        content = hashlib.sha256(labels.tobytes())
        if extra and self.data.groups is not None:
            content.update(np.ascontiguousarray(self.data.groups).tobytes())
        key = key_of(content.hexdigest(), spec.model_dump(mode="json"), n, seed, versions())
        a = cached_arrays("partition", key, compute)
        return Partitions(a["indices"], a["sizes"])

    def client_data(self, partition_id: int) -> tuple[np.ndarray, np.ndarray]:
        """An honest client's training data: its partition, plus whatever the scenario gives honest
        clients on top (correctly labelled edge-case copies in the normal-case variants)."""
        idx = self.partitions[partition_id]
        x, y = self.data.x_train[idx], self.data.y_train[idx]
        extra = self.attack.honest_extra_data(self, partition_id) if self.attack is not None else None
        if extra is not None and len(extra[0]):
            x, y = np.concatenate([x, extra[0]]), np.concatenate([y, extra[1]])
        return x, y

    def client_size(self, partition_id: int, attacking: bool = False) -> int:
        """Examples a client trains on this round (an attacking client's own training set)."""
        if attacking and self.attack is not None and self.attack.side == "client":
            return len(self.attack.training_set(self, partition_id)[1])
        return len(self.client_data(partition_id)[1])

    # --- model ------------------------------------------------------------------------------
    @functools.cached_property
    def model_shape(self) -> tuple[tuple[int, ...], int]:
        """(input shape, class count) the model is built for: the dataset's static facts when it has
        them, so a device training on its own data never loads the central dataset; else the data's."""
        facts = dataset_facts(self.scenario.data.dataset)
        if facts is None:
            return self.data.input_shape, self.data.num_classes
        return facts.input_shape, facts.num_classes

    def build_model(self, ranks: dict[str, int] | None = None) -> torch.nn.Module:
        """The scenario's model; with `ranks`, its low-rank factorized architecture (Pufferfish layers)."""
        spec = self.scenario.model
        def full():
            return MODELS.get(spec.name).obj(*self.model_shape, spec)
        with TORCH_GLOBAL_RNG:  # its initialisation draws from torch's global generator
            return full() if not ranks else build_factorized(full, ranks)

    @functools.cached_property
    def layout(self) -> ModelLayout:
        return ModelLayout.of(self.build_model())

    def layout_for(self, ranks: dict[str, int] | None) -> ModelLayout:
        if not ranks:
            return self.layout
        return self.cached(("layout", tuple(sorted(ranks.items()))), lambda: ModelLayout.of(self.build_model(ranks)))

    def initial_weights(self) -> torch.Tensor:
        """The initial global model: seeded random init, then a checkpoint or central pre-training if configured."""
        layout = self.layout  # may build a model itself: do it before seeding
        init = self.scenario.init
        with TORCH_GLOBAL_RNG:
            torch.manual_seed(self.scenario.seed)
            model = self.build_model()
        if init.checkpoint:
            state = torch.load(init.checkpoint, map_location="cpu", weights_only=True)
            model.load_state_dict(state)
        elif init.pretrain_epochs:
            self._pretrain(model)
        return layout.flatten_model(model)

    def _pretrain(self, model: torch.nn.Module) -> None:
        """Central pre-training on the clean training set, cached on disk by everything it depends on."""
        init, sc = self.scenario.init, self.scenario
        key = json.dumps([scenario_dict(sc)[k] for k in ("data", "model", "init", "seed")], sort_keys=True)
        cache = cache_dir() / f"pretrained-{hashlib.sha256(key.encode()).hexdigest()[:16]}.pt"
        if cache.exists():
            model.load_state_dict(torch.load(cache, map_location="cpu", weights_only=True))
            return
        rng = np.random.default_rng([sc.seed, 0x9E7])
        n = len(self.data.y_train)
        idx = np.sort(rng.choice(n, size=max(1, round(init.pretrain_share * n)), replace=False))
        cfg = TrainConfig(init.pretrain_epochs, init.pretrain_batch_size, init.pretrain_lr, momentum=0.9)
        train(model, self.data.x_train[idx], self.data.y_train[idx], cfg, seed=sc.seed)
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".tmp{os.getpid()}")
        torch.save(model.state_dict(), tmp)
        tmp.replace(cache)  # atomic: parallel runs never read half a file

    # --- attack and codec -------------------------------------------------------------------
    @functools.cached_property
    def attack(self):
        spec = self.scenario.attack
        return None if spec is None else ATTACKS.get(spec.name).obj(spec)

    @functools.cached_property
    def attackers(self) -> list[int]:
        spec = self.scenario.attack
        return [] if spec is None else spec.resolve_attackers(self.scenario.federation.num_clients, self.scenario.seed)

    @functools.cached_property
    def codec(self):
        spec = self.scenario.compression
        return COMPRESSORS.get(spec.name).obj(spec)

    def lr(self, rnd: int) -> float:
        fed = self.scenario.federation
        return fed.lr * fed.lr_decay ** (rnd - 1)


@functools.cache  # installed versions do not change under a running process (a sweep asks once per run)
def versions() -> list[str]:
    """Library versions a cached result depends on (a new partitioner version may split differently).

    A package without installed metadata counts as "unknown" instead of failing: a device may run
    fedsim from a copied folder, or without scikit-learn (issue #21: every train failed there)."""
    from importlib.metadata import PackageNotFoundError, version  # reads package metadata: imports nothing heavy

    def known(package: str) -> str:
        try:
            return version(package)
        except PackageNotFoundError:
            return "unknown"

    return [known(p) for p in ("fedsim", "flwr-datasets", "scikit-learn", "numpy")]


def scenario_key(scenario) -> str:
    return hashlib.sha256(json.dumps(scenario_dict(scenario), sort_keys=True).encode()).hexdigest()


RUNTIMES_KEPT = 4  # scenarios per process: a sweep's runs in flight together share processes (fedsim/engine/shared.py)
_RUNTIMES: "collections.OrderedDict[str, Runtime]" = collections.OrderedDict()
_RUNTIMES_LOCK = threading.Lock()


def runtime_for(scenario) -> Runtime:
    """The process-wide runtime of this scenario (shared by the virtual clients of one Ray actor).

    The few most recently used are kept, keyed by the scenario's content: several runs of a sweep
    may be in flight in one process (their servers) or one actor (their clients)."""
    key = scenario_key(scenario)
    with _RUNTIMES_LOCK:
        if key in _RUNTIMES:
            _RUNTIMES.move_to_end(key)
            return _RUNTIMES[key]
    rt = Runtime(scenario)  # outside the lock: building one may load data
    with _RUNTIMES_LOCK:
        rt = _RUNTIMES.setdefault(key, rt)
        _RUNTIMES.move_to_end(key)
        while len(_RUNTIMES) > RUNTIMES_KEPT:
            _RUNTIMES.popitem(last=False)
    return rt
