"""Atomic file writes for everything a run folder holds that a later read trusts.

A write goes to a temp file beside the target, is flushed to disk, renamed over the target, and
the folder is flushed: a process killed at any point (SIGKILL, power loss) leaves the old file or
the new one, never a part of one. A write that fails (a full disk, a folder made read-only) removes
its temp file and raises an `OSError` that names the target (see `fedsim/cli.py`: the message and
how to resume).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Callable


def write_atomic(path: Path, write: Callable[[Path], None]) -> None:
    """`write(temp_path)` writes the content; then it replaces `path` in one step."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        write(tmp)
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        tmp.replace(path)
        folder = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(folder)
        finally:
            os.close(folder)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        if err.filename is None or Path(err.filename) != path:  # name the file the run meant to write
            raise OSError(err.errno, err.strerror or str(err), str(path)) from err
        raise
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text_atomic(path: Path, text: str) -> None:
    write_atomic(path, lambda tmp: tmp.write_text(text))


def remove_temp_files(folder: Path, prefix: str = "") -> list[Path]:
    """Delete the temp files of writes that a killed process never renamed (`.<name>.tmp<pid>`)
    whose name starts with `prefix`; only call where no write can be under way. Returns them."""
    folder = Path(folder)
    gone = [p for p in folder.glob(f".{prefix}*") if re.fullmatch(r"\..+\.tmp\d+", p.name)] if folder.is_dir() else []
    for path in gone:
        path.unlink(missing_ok=True)
    return gone
