"""What the server measures on the global model each round: main-task accuracy and loss on the
(optionally subsampled) test set, the attack's success rate on its own test set, and clean
accuracy on the edge set's source class; with `evaluation.edge_model`, the same numbers on each
edge copy of the model (pruned / quantized as a device runs it: fedsim/models/edge_copy.py).

A defense with an inference part (its registry entry's `inference`) changes what is measured:
every number is taken on the model it deploys (Lockdown: the global model after consensus
fusion), and an input its rule rejects (FLIP: softmax confidence below a threshold) counts as
not correct for the main accuracy and the source class, and as no hit for the backdoor success,
over the same denominators (FLIP's official `test.py`). The loss is the deployed model's on all inputs."""

from __future__ import annotations

import copy
import functools
from typing import Callable

import numpy as np
import torch

from fedsim.devices import resolve_device
from fedsim.models.edge_copy import edge_copy
from fedsim.registry import DEFENSES
from fedsim.seeding import SERVER, derive_seed, numpy_rng
from fedsim.server.tools import server_sample
from fedsim.training import predict


CERTIFY = 0xCE7  # seed stream of a certifying defense's noise
CALIBRATE = 0xCA1  # seed stream of a static int8 edge copy's calibration subset


class CentralEvaluator:
    def __init__(self, runtime, reference: torch.nn.Module | None = None) -> None:
        """`reference`: the clean initial model; the backdoor inputs it already sends to the
        attacker's label are left out of `backdoor_success_beyond_clean`."""
        scenario = runtime.scenario
        self.batch_size = scenario.evaluation.batch_size
        self.device = resolve_device(scenario.evaluation.device, "evaluation.device")
        self.x, self.y = runtime.data.x_test, runtime.data.y_test
        held = held_out_test(runtime)
        if held is not None:  # test examples the server holds as its own data are not evaluated on
            keep = np.setdiff1d(np.arange(len(self.y)), held)
            self.x, self.y = self.x[keep], self.y[keep]
        subset = scenario.evaluation.test_subset
        if subset is not None and subset < len(self.y):  # a fixed seeded subset, the same every round
            keep = np.sort(numpy_rng(scenario.seed, SERVER, 0).choice(len(self.y), subset, replace=False))
            self.x, self.y = self.x[keep], self.y[keep]
        self.y = np.array(self.y)  # labels in memory (a cached test set may be memory-mapped, read-only)
        self.runtime, self.reference = runtime, reference
        self.shared: dict[str, np.ndarray] | None = None  # the latest attacker report the backdoor set follows
        self._set_backdoor(runtime.attack.backdoor_test_set(runtime) if runtime.attack is not None else None)
        self.source = runtime.attack.source_class() if runtime.attack is not None else None
        self.scenario = scenario
        # defenses that certify the global model (CRFL): (name, spec, certify function)
        certify = [(d.name, d, DEFENSES.get(d.name).load("certify")) for d in scenario.defenses]
        self.certifiers = [c for c in certify if c[2] is not None]
        # defenses that deploy another model or reject inputs at inference (Lockdown, FLIP): (index, spec, function)
        inference = [(i, d, DEFENSES.get(d.name).load("inference")) for i, d in enumerate(scenario.defenses)]
        self.inference = [(i, d, fn) for i, d, fn in inference if fn is not None]
        self.edge_specs = [(f"evaluation.edge_model[{i}]", spec) for i, spec in enumerate(scenario.evaluation.edge_model)]
        # a static int8 copy's calibration inputs: a fixed seeded subset of the evaluated test set
        need = max((s.calibration for _, s in self.edge_specs if s.quantize == "int8_static"), default=0)
        self.calibration = None
        if need:
            pick = np.sort(numpy_rng(scenario.seed, SERVER, CALIBRATE).permutation(len(self.y))[:need])
            self.calibration = torch.from_numpy(np.array(self.x[pick]))
        if reference is not None:  # a copy this model cannot have is refused before the first round
            for where, spec in self.edge_specs:
                self._copy(reference, where, spec)

    def _set_backdoor(self, backdoor) -> None:
        self.backdoor = backdoor
        self.beyond_clean = None  # backdoor inputs the clean model does not already send to the target
        if backdoor is not None and self.reference is not None:
            x_bd, targets = backdoor
            self.beyond_clean = predict(self.reference, x_bd, self.batch_size)[0] != targets

    def use_shared(self, shared: dict[str, np.ndarray]) -> None:
        """Measure the backdoor an attacker reported planting (a trigger it optimised this round)
        from now on: the attack rebuilds its test set from the report."""
        self.shared = shared
        self._set_backdoor(self.runtime.attack.backdoor_test_set(self.runtime, shared))

    def certify(self, model: torch.nn.Module, rnd: int) -> dict | None:
        """What the certifying defenses say of `model` in round `rnd` (they choose their rounds:
        the last round always, every `certify_every` rounds if they have that parameter), or None."""
        last = rnd == self.scenario.federation.rounds
        out = {}
        for name, spec, fn in self.certifiers:
            every = getattr(spec, "certify_every", None)
            if last or (every and rnd % every == 0):
                sets = {"main": (self.x, self.y)}
                if self.backdoor is not None:
                    sets["backdoor"] = self.backdoor
                out[name] = fn(spec, model, sets, derive_seed(self.scenario.seed, SERVER, CERTIFY, rnd), rnd=rnd)
        return out or None

    def deploy(self, model: torch.nn.Module, rnd: int | None, deployed: list | None = None) -> tuple[torch.nn.Module, Callable | None]:
        """The model the server deploys after round `rnd` and its rejection rule (logits -> bool [n]:
        accepted; None accepts all): each inference defense's, in the scenario's order, given its
        `deployed_state()` after that round (`deployed`: one per scenario defense; None: none yet).
        `model` is never changed in place."""
        accepts = []
        for index, spec, fn in self.inference:
            model, accept = fn(spec, model, self.runtime, rnd, None if deployed is None else deployed[index])
            if accept is not None:
                accepts.append(accept)
        if not accepts:
            return model, None
        return model, lambda logits: functools.reduce(torch.logical_and, (a(logits) for a in accepts))

    def __call__(self, model: torch.nn.Module, rnd: int | None = None, deployed: list | None = None) -> dict:
        """One forward pass over each set: the source-class accuracy reuses the main predictions.
        With `rnd`, the certifying defenses' numbers of that round come under `certification`;
        `deployed`: the defenses' deployed states after it (`deploy`)."""
        model, accept = self.deploy(model, rnd, deployed)
        given, on_cpu = model, self.device.type == "cpu"
        channels_last = self.x.ndim == 4 and on_cpu  # image models: NHWC convolutions are faster on CPU
        if channels_last:
            model = copy.deepcopy(model).to(memory_format=torch.channels_last)  # the caller's model keeps its layout
        # a copy on the evaluation's device; certification below keeps the CPU model
        net = model if on_cpu else copy.deepcopy(model).to(self.device)
        out, pred = self._metrics(net, channels_last, self.device, accept)
        if self.edge_specs:
            out["edge_model"] = {spec.key(): self._edge(given, where, spec, pred, accept) for where, spec in self.edge_specs}
        if rnd is not None and self.certifiers:
            certification = self.certify(model, rnd)
            if certification is not None:
                out["certification"] = certification
        return out

    def _copy(self, model: torch.nn.Module, where: str, spec):
        return edge_copy(model, spec, where, self.calibration, self.batch_size)

    def _edge(self, model: torch.nn.Module, where: str, spec, fp32_pred: np.ndarray, accept: Callable | None = None) -> dict:
        """The fp32 metrics on one edge copy of `model`, with the same sets and batches, plus
        `agreement`: the share of test inputs on which it predicts the fp32 model's class. An int8
        copy runs on the CPU (its kernels are CPU only), the others where the evaluation runs."""
        edge = self._copy(model, where, spec)
        device = torch.device("cpu") if edge.cpu_only else self.device
        out, pred = self._metrics(edge.to(device), False, device, accept)
        main = {k: out.pop(k) for k in ("main_accuracy", "main_loss")}
        return {**main, "agreement": _share(pred == fp32_pred), **out}

    def _metrics(self, net: torch.nn.Module, channels_last: bool, device: torch.device,
                 accept: Callable | None = None) -> tuple[dict, np.ndarray]:
        """(main accuracy and loss, backdoor success and the source class's accuracy when measured,
        and with a rejection rule the shares it rejects; the main predictions) of `net` on `device`;
        an input `accept` rejects is never a hit."""
        pred, logits = predict(net, self.x, self.batch_size, channels_last, device)
        loss = torch.nn.functional.cross_entropy(logits, torch.from_numpy(self.y)).item() if len(self.y) else float("nan")
        answered = _accepted(accept, logits)
        correct = (pred == self.y) & answered
        out = {"main_accuracy": _share(correct), "main_loss": float(loss), "backdoor_success": None}
        if accept is not None:
            out["inputs_rejected"] = {"main": _share(~answered)}
        if self.backdoor is not None:
            x_bd, targets = self.backdoor
            bd_pred, bd_logits = predict(net, x_bd, self.batch_size, channels_last, device)
            bd_answered = _accepted(accept, bd_logits)
            hits = (bd_pred == targets) & bd_answered
            out["backdoor_success"] = _share(hits)
            if accept is not None:
                out["inputs_rejected"]["backdoor"] = _share(~bd_answered)
            if self.beyond_clean is not None:
                out["backdoor_success_beyond_clean"] = _share(hits[self.beyond_clean])
        if self.source is not None:
            mask = self.y == self.source
            out["source_class_accuracy"] = _share(correct[mask])
        return out, pred


def held_out_test(runtime) -> np.ndarray | None:
    """Indices of the test split the server holds as its own data (FLTrust's `root_source: test`), or None."""
    spec = runtime.scenario.aggregator
    if getattr(spec, "root_source", None) != "test":
        return None
    return server_sample(runtime, spec.root_size, "test")


def _accepted(accept: Callable | None, logits: torch.Tensor) -> np.ndarray | bool:
    """Which inputs the deployed model answers (True: all)."""
    return True if accept is None else accept(logits).cpu().numpy().astype(bool)


def _share(hits: np.ndarray) -> float:
    return float(hits.mean()) if len(hits) else float("nan")
