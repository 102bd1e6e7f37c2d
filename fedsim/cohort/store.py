"""Where a cohort's updates wait between `prepare_cohort` (fedsim/client/cohort.py), which trains
the cohort together, and each client's own answer (`local_update` in fedsim/client/steps.py),
which takes its update from here instead of training: one dict per runtime (per scenario and
process), keyed by (round, partition id)."""

from __future__ import annotations

import torch

STORE_KEY = ("cohort-updates",)


def cohort_store(rt) -> dict:
    """(round, partition id) -> (the global model it started from, its update), for runtime `rt`."""
    return rt.cached(STORE_KEY, dict)


def take_pretrained(rt, rnd: int, pid: int, global_vec: torch.Tensor):
    """This client's update if its cohort trained it from this very global model, else None; an
    update is taken once."""
    found = cohort_store(rt).pop((rnd, pid), None)
    if found is None or not torch.equal(found[0], global_vec):
        return None
    return found[1]
