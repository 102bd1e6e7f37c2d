"""The scenario's privacy attacks, run by the server on what it saw (issue #36, docs/leakage.md).

The round driver calls `PrivacyProbe.after_pipeline` once a round's updates are decoded and
aggregated (before the global model steps) and `after_step` once it has. The probe builds each
attack's `Observation` from what the server holds at that moment: the broadcast model, the decoded
uploads (a curious server) or the round's aggregate (a secure-aggregation server, or anyone who
sees two consecutive global models), and the federation's training settings. Only here, in
simulation, are the clients' true data read: to match and score the reconstructions
(leakage/metrics.py) and to draw the image grids in the run folder's `privacy/`. Membership
inference runs on the new global model against members (examples some client holds) and held-out
test examples. Nothing here changes what clients compute or what the server aggregates; every
attack works on copies. The cost of each attack is reported in `privacy_attack_seconds`.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import torch

from fedsim.leakage.base import LocalTraining, MembershipQuery, Observation
from fedsim.registry import PRIVACY_ATTACKS
from fedsim.seeding import derive_seed, numpy_rng

log = logging.getLogger("fedsim")

LEAKAGE = 6  # seeding purpose of the privacy attacks' streams (fedsim/seeding.py's purposes end at 5)
MEMBERSHIP_TARGETS = 500  # members and as many non-members per membership game, at most


def data_bounds(data) -> tuple[float, float]:
    """The dataset's input range: what a reconstruction is clamped to and what PSNR's peak is."""
    x = data.x_train
    return float(x.min()), float(x.max())


class PrivacyProbe:
    """The scenario's `privacy_attacks`, one instance each, with where their image grids go."""

    def __init__(self, runtime, run_folder=None, device: torch.device | None = None) -> None:
        self.rt, self.scenario = runtime, runtime.scenario
        self.device = device or torch.device("cpu")
        self.folder = None if run_folder is None else Path(getattr(run_folder, "path", run_folder))
        self.attacks = [(spec, PRIVACY_ATTACKS.get(spec.name)) for spec in self.scenario.privacy_attacks]
        self.instances = [entry.obj(spec) for spec, entry in self.attacks]

    def __bool__(self) -> bool:
        return bool(self.attacks)

    # --- what the server knows -----------------------------------------------------------------
    def training(self, rnd: int, num_examples: int) -> LocalTraining:
        fed = self.scenario.federation
        return LocalTraining(lr=self.rt.lr(rnd), epochs=fed.local_epochs, batch_size=fed.batch_size,
                             max_steps=fed.local_steps, momentum=fed.momentum, weight_decay=fed.weight_decay,
                             num_examples=int(num_examples))

    def generator(self, rnd: int, index: int, client: int) -> torch.Generator:
        return torch.Generator(device="cpu").manual_seed(derive_seed(self.scenario.seed, LEAKAGE, rnd, index, client + 1))

    def _observation(self, rnd, kind, model, layout, weights, update, num_examples, clients, index) -> Observation:
        shape, classes = self.rt.model_shape
        model = model.to(self.device).eval()
        return Observation(round=rnd, kind=kind, model=model, layout=layout, weights=weights.to(self.device),
                           update=update.to(self.device), training=self.training(rnd, num_examples),
                           input_shape=tuple(shape), num_classes=classes, bounds=data_bounds(self.rt.data),
                           generator=self.generator(rnd, index, clients[0] if len(clients) == 1 else -1),
                           device=self.device, clients=tuple(clients))

    def targets(self, spec, client_ids, strikers) -> list[int]:
        """The sampled clients an upload attack looks at: the named ones, else the lowest-id honest ones."""
        honest = [c for c in sorted(client_ids) if c not in strikers]
        chosen = [c for c in honest if c in spec.clients] if spec.clients is not None else honest
        return chosen[: spec.per_round]

    # --- the driver's calls --------------------------------------------------------------------
    def after_pipeline(self, rnd: int, batch, strikers: set[int], individual: bool, model_fn, layout,
                       weights: torch.Tensor, aggregate: torch.Tensor | None, contributors: list[int],
                       examples: int) -> tuple[list[dict], dict]:
        """Inversion attacks of round `rnd`: on the decoded uploads (`individual`: the rows are
        clients' own updates) and on the aggregate the pipeline made (None: the round was skipped).
        `contributors` are the clients whose data is in the aggregate, `examples` their examples."""
        lines, seconds = [], {}
        for index, ((spec, entry), attack) in enumerate(zip(self.attacks, self.instances)):
            if entry.traits.kind != "inversion" or rnd not in spec.rounds:
                continue
            if spec.observe == "upload":
                if not individual:
                    continue  # refused at validation; a protocol that sums (secure) never shows an upload
                for pid in self.targets(spec, batch.client_ids, strikers):
                    row = batch.client_ids.index(pid)
                    obs = self._observation(rnd, "upload", model_fn(), layout, weights, batch.updates[row].detach().cpu(),
                                            float(batch.weights[row]), [pid], index)
                    lines.append(self._invert(spec, attack, obs, seconds))
            elif aggregate is not None and contributors:
                # the aggregate is the weighted mean of per-client updates: each client took its own
                # steps on about examples/len(contributors) examples; all of them are to be recovered
                honest = [c for c in contributors if c not in strikers]
                obs = self._observation(rnd, "aggregate", model_fn(), layout, weights, aggregate.detach().cpu(),
                                        max(1, round(examples / len(contributors))), sorted(contributors), index)
                obs.images = int(examples)
                lines.append(self._invert(spec, attack, obs, seconds, truth_clients=honest))
        return lines, seconds

    def after_step(self, rnd: int, model_fn, trained_fn) -> tuple[list[dict], dict]:
        """Membership inference of round `rnd` against the new global model (`model_fn()`);
        `trained_fn(rnd)`: the honest clients whose data some round so far was trained on (the
        members are theirs). Both are asked for only when an attack runs this round."""
        lines, seconds = [], {}
        for index, ((spec, entry), attack) in enumerate(zip(self.attacks, self.instances)):
            if entry.traits.kind != "membership" or rnd not in spec.rounds:
                continue
            started = time.perf_counter()
            query, is_member = self.membership_game(rnd, index, model_fn(), trained_fn(rnd))
            scores = attack.scores(query).detach().cpu()
            from fedsim.leakage.membership import membership_metrics

            info = getattr(attack, "info", {}) or {}
            metrics = membership_metrics(scores, is_member, threshold=info.get("decision_threshold"))
            line = {"attack": spec.name, "round": rnd, "target": "model", **metrics, "info": _plain(info)}
            seconds[f"{spec.name}"] = time.perf_counter() - started
            lines.append(line)
        return lines, seconds

    # --- inversion: run, match, score, draw --------------------------------------------------
    def _invert(self, spec, attack, obs: Observation, seconds: dict, truth_clients=None) -> dict:
        from fedsim.leakage.metrics import save_grid, score

        started = time.perf_counter()
        rec = attack.reconstruct(obs)
        spent = time.perf_counter() - started
        who = list(obs.clients if truth_clients is None else truth_clients)
        xs, ys = zip(*(self.rt.client_data(c) for c in who)) if who else ((), ())
        truth_x = torch.from_numpy(np.concatenate(xs)) if xs else torch.zeros((0, *obs.input_shape))
        truth_y = torch.from_numpy(np.concatenate(ys)) if ys else torch.zeros(0, dtype=torch.int64)
        result = score(rec, truth_x, truth_y, obs.bounds) if len(truth_x) else {"images": len(rec.inputs)}
        pairs = result.pop("pairs", [])
        line = {"attack": spec.name, "round": obs.round, "target": obs.kind, "clients": list(obs.clients),
                **result, "info": _plain(rec.info)}
        key = f"{spec.name}/{obs.kind}/{'+'.join(map(str, obs.clients)) if obs.kind == 'upload' else 'sum'}"
        seconds[key] = spent
        if spec.grid and self.folder is not None and pairs:
            name = f"r{obs.round:04d}_{spec.name}_{obs.kind}_{'c' + str(obs.clients[0]) if obs.kind == 'upload' else 'sum'}.png"
            path = self.folder / "privacy" / name
            path.parent.mkdir(parents=True, exist_ok=True)
            save_grid(path, truth_x, rec.inputs.detach().cpu(), pairs, obs.bounds, spec.grid)
            line["grid"] = str(Path("privacy") / name)
        return line

    # --- membership: the game ------------------------------------------------------------------
    def membership_game(self, rnd: int, index: int, model, trained: list[int]) -> tuple[MembershipQuery, torch.Tensor]:
        """Members: examples drawn from the partitions of the honest clients trained so far (what
        the global model has seen); non-members: examples of one half of the test set; the
        attacker's population: the other half. Seeded by the attack's place in the scenario, so
        the same run draws the same game."""
        data, rng = self.rt.data, numpy_rng(self.scenario.seed, LEAKAGE, index)
        held = np.concatenate([np.asarray(self.rt.partitions[p]) for p in sorted(trained)])
        half = len(data.y_test) // 2
        test_order = rng.permutation(len(data.y_test))
        outside, population = test_order[:half], test_order[half:]
        k = min(MEMBERSHIP_TARGETS, len(held), len(outside))
        members = rng.choice(held, k, replace=False)
        non_members = rng.choice(outside, k, replace=False)
        x = torch.from_numpy(np.concatenate([data.x_train[members], data.x_test[non_members]]))
        y = torch.from_numpy(np.concatenate([data.y_train[members], data.y_test[non_members]]))
        is_member = torch.cat([torch.ones(k, dtype=torch.bool), torch.zeros(k, dtype=torch.bool)])
        pop = (torch.from_numpy(data.x_test[population]), torch.from_numpy(data.y_test[population]))
        fed = self.scenario.federation
        training = LocalTraining(self.rt.lr(rnd), fed.local_epochs, fed.batch_size, fed.local_steps, fed.momentum,
                                 fed.weight_decay, num_examples=len(held))
        query = MembershipQuery(round=rnd, model=model.to(self.device).eval(), x=x, y=y, population=pop,
                                build_model=self.rt.build_model, training=training,
                                generator=torch.Generator().manual_seed(derive_seed(self.scenario.seed, LEAKAGE, index, rnd)),
                                device=self.device)
        return query, is_member


def _plain(info: dict) -> dict:
    """An attack's own numbers as JSON values (tensors and numpy scalars to floats and lists),
    less its timings: a round's line stays the same from run to run (the cost is in
    `privacy_attack_seconds`)."""
    out = {}
    for k, v in info.items():
        if "seconds" in k:
            continue
        if isinstance(v, torch.Tensor):
            v = v.item() if v.numel() == 1 else v.tolist()
        elif isinstance(v, np.generic):
            v = v.item()
        out[k] = v
    return out
