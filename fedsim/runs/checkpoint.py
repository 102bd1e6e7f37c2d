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

A server checkpoint carries a SHA-256 of its content and the fingerprint of the scenario that
wrote it (`fedsim.scenario.scenario_fingerprint`): a truncated or bit-flipped file, or one copied
from another scenario's run, is refused with the reason and the next older one is used.
"""

from __future__ import annotations

import hashlib
import io
import logging
import re
import zipfile
from pathlib import Path

import numpy as np
import torch

from fedsim.runs.atomic import remove_temp_files, write_atomic
from fedsim.runs.folder import RunFolder

KEEP = 2
# A server checkpoint: this line, the SHA-256 of the rest (32 bytes), then a torch.save payload.
HEADER = b"fedsim-checkpoint-2\n"
log = logging.getLogger("fedsim")


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
                extra: dict | None = None, scenario_id: str = "") -> None:
    """`extra`: plain data (ints, strings, tensors, dicts of them) such as the low-rank switch state;
    `scenario_id`: the fingerprint of the scenario the run follows."""
    folder = server_dir(run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    payload = {"round": rnd, "global": global_vec.clone(), "defenses": defense_states, "extra": extra or {},
               "scenario": scenario_id}
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    body = buffer.getvalue()
    write_atomic(folder / f"round-{rnd}.pt", lambda p: p.write_bytes(HEADER + hashlib.sha256(body).digest() + body))
    _prune(_rounds(folder, r"round-(\d+)\.pt"))


def read_server(path: Path, rnd: int, scenario_id: str | None = None) -> tuple[dict | None, str]:
    """(the state, "") from a server checkpoint, or (None, why it cannot be used)."""
    try:
        data = path.read_bytes()
    except OSError as err:
        return None, f"unreadable ({err.strerror or err})"
    digest_end = len(HEADER) + 32
    if not data.startswith(HEADER) or len(data) < digest_end:
        return None, "not a fedsim checkpoint (its header is missing: truncated, or written by something else)"
    if hashlib.sha256(data[digest_end:]).digest() != data[len(HEADER):digest_end]:
        return None, "damaged: its content does not match its SHA-256 (truncated or altered)"
    try:
        state = torch.load(io.BytesIO(data[digest_end:]), map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001  (torch raises several kinds for a payload it cannot read)
        return None, f"unreadable ({type(err).__name__}: {err})"
    if not isinstance(state, dict) or state.get("round") != rnd or "global" not in state:
        return None, f"does not hold round {rnd}'s server state"
    if scenario_id is not None and state.get("scenario") != scenario_id:
        return None, (f"written by another scenario (fingerprint {state.get('scenario') or 'none'}, "
                      f"this run's {scenario_id})")
    return state, ""


def load_server(run_dir: Path | RunFolder, at_most: int, scenario_id: str | None = None) -> dict | None:
    """The newest usable server checkpoint of a round <= `at_most` (of the scenario `scenario_id`
    when given), or None. One that cannot be used (damaged, another scenario's) is refused with
    the reason, logged, and the next older one used."""
    found = sorted(((r, p) for r, p in _rounds(server_dir(run_dir), r"round-(\d+)\.pt") if r <= at_most), reverse=True)
    for rnd, path in found:
        state, why = read_server(path, rnd, scenario_id)
        if state is not None:
            return state
        log.warning("checkpoint %s is refused: %s; using an older one", path, why)
    return None


# --- clients ---------------------------------------------------------------------------------------
def save_client(state_dir: str | Path, pid: int, rnd: int, state: dict[str, np.ndarray]) -> None:
    folder = Path(state_dir)
    folder.mkdir(parents=True, exist_ok=True)
    def write(path: Path) -> None:
        with open(path, "wb") as fh:
            np.savez(fh, **state)

    write_atomic(folder / f"{pid}-r{rnd}.npz", write)
    _prune(_rounds(folder, rf"{pid}-r(\d+)\.npz"))


def load_client(state_dir: str | Path, pid: int, before_round: int) -> dict[str, np.ndarray] | None:
    """The client's newest readable saved state from a round before `before_round`, or None.

    Files from `before_round` on were written by a run that was killed before the server kept
    those rounds: the server is about to redo them, so they are deleted here, by the client. A file
    that cannot be read (damaged) is skipped with a warning for the next older one."""
    remove_temp_files(Path(state_dir), prefix=f"{pid}-r")  # a write the client was killed in
    mine = _rounds(Path(state_dir), rf"{pid}-r(\d+)\.npz")
    for r, path in mine:
        if r >= before_round:
            path.unlink(missing_ok=True)
    for _, path in sorted(((r, p) for r, p in mine if r < before_round), reverse=True):
        try:
            with np.load(path, allow_pickle=False) as data:
                return {k: data[k] for k in data.files}
        except (OSError, ValueError, EOFError, zipfile.BadZipFile) as err:  # what np.load raises for a damaged .npz
            log.warning("client state %s is unreadable (%s: %s); using an older one", path, type(err).__name__, err)
    return None
