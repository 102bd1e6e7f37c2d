"""Per-round checkpoints, so a killed run resumes from its last completed round and ends exactly
where an uninterrupted run would.

Server side: `checkpoint/round-<N>.pt` holds the global model and every defense's state after
round N (random streams need no saving: each is derived from the seed and the round). Client
side: a client that keeps memory between rounds (error-feedback residuals) keeps it in its Flower
`Context.state`; when its node has a state folder (the ClientApp's `state_dir`, or a SuperNode's
`--node-config 'state-dir="..."'`, on the client's own disk) it also writes it to
`<state dir>/<pid>-r<N>.npz` after training in round N and, when its context is fresh (a resumed
run, a restarted device), reads back the newest file from before the current round. Nothing about
it travels in a message or depends on the server's disk. Files are written atomically (temp file,
then rename) and only the newest two per owner are kept.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import torch

from fedsim.runs.folder import RunFolder

KEEP = 2


def _atomic_write(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    write(tmp)
    tmp.replace(path)


def _prune(files: list[tuple[int, Path]]) -> None:
    for _, path in sorted(files)[:-KEEP]:
        path.unlink(missing_ok=True)


# --- server ----------------------------------------------------------------------------------------
def server_dir(run_dir: Path | RunFolder) -> Path:
    return RunFolder.of(run_dir).checkpoints


def _rounds(folder: Path, pattern: str) -> list[tuple[int, Path]]:
    out = []
    for path in folder.glob("*") if folder.exists() else []:
        m = re.fullmatch(pattern, path.name)
        if m:
            out.append((int(m.group(1)), path))
    return out


def save_server(run_dir: Path | RunFolder, rnd: int, global_vec: torch.Tensor, defense_states: dict[str, dict],
                extra: dict | None = None) -> None:
    """`extra`: plain data (ints, strings, tensors, dicts of them) such as the low-rank switch state."""
    folder = server_dir(run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    payload = {"round": rnd, "global": global_vec.clone(), "defenses": defense_states, "extra": extra or {}}
    _atomic_write(folder / f"round-{rnd}.pt", lambda p: torch.save(payload, p))
    _prune(_rounds(folder, r"round-(\d+)\.pt"))


def load_server(run_dir: Path | RunFolder, at_most: int) -> dict | None:
    """The newest server checkpoint of a round <= `at_most`, or None."""
    found = [(r, p) for r, p in _rounds(server_dir(run_dir), r"round-(\d+)\.pt") if r <= at_most]
    if not found:
        return None
    return torch.load(max(found)[1], map_location="cpu", weights_only=True)


# --- clients ---------------------------------------------------------------------------------------
def save_client(state_dir: str | Path, pid: int, rnd: int, state: dict[str, np.ndarray]) -> None:
    folder = Path(state_dir)
    folder.mkdir(parents=True, exist_ok=True)
    _atomic_write(folder / f"{pid}-r{rnd}.npz", lambda p: np.savez(open(p, "wb"), **state))
    _prune(_rounds(folder, rf"{pid}-r(\d+)\.npz"))


def load_client(state_dir: str | Path, pid: int, before_round: int) -> dict[str, np.ndarray] | None:
    """The client's newest saved state from a round before `before_round`, or None.

    Files from `before_round` on were written by a run that was killed before the server kept
    those rounds: the server is about to redo them, so they are deleted here, by the client."""
    mine = _rounds(Path(state_dir), rf"{pid}-r(\d+)\.npz")
    for r, path in mine:
        if r >= before_round:
            path.unlink(missing_ok=True)
    found = [(r, p) for r, p in mine if r < before_round]
    if not found:
        return None
    with np.load(max(found)[1], allow_pickle=False) as data:
        return {k: data[k] for k in data.files}
