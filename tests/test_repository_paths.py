"""No tracked file names an absolute path of one machine (issue #32, item 7).

A path like the team's shared folder, a home folder or a fixed temp file works only where it was
written: scenario headers and docs point to documents in the repository, code finds files from
`Path(__file__)`, $FEDSIM_DATA_DIR or `tempfile.gettempdir()`. Paths that are right everywhere (a
folder inside the container image, a made-up value a test only passes along) are allowed below,
each with its reason.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
THIS = Path(__file__).resolve().relative_to(REPO).as_posix()  # names every root itself

# Written without their slashes so that this file's own text does not match.
ROOTS = ("work", "farm", "home", "root", "Users", "tmp", "mnt")
# A root at the start of a path: not preceded by a character that makes it part of a longer path
# (`../shared`, `$HOME/tmp/`, `.venv/...`, `~/x`).
ABSOLUTE = re.compile(r"(?<![\w.~$}-])/(?:" + "|".join(ROOTS) + r")/|\b[A-Za-z]:\\\\?Users\\")

# (file, text on the line): why that absolute path is right on every machine.
ALLOWED = {
    ("deploy/Dockerfile", "--home-dir /home/fedsim"):
        "the image's own user's home folder, inside the container, not on the host",
    ("tests/test_engine_adjustments.py", '"/tmp/run/checkpoint/clients"'):
        "a made-up state folder the test pickles and compares as a string; nothing is written there",
    ("tests/test_report.py", 'Path("/home/me/results/b")'):
        "two unrelated absolute folders as input to default_out, which must refuse to pick their common root",
}


def tracked_files() -> list[str]:
    if shutil.which("git") is None:
        pytest.skip("git is not installed: cannot list the tracked files")
    if not (REPO / ".git").exists():
        pytest.skip(f"{REPO} is not a git checkout (no .git): cannot list the tracked files")
    out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    return [name for name in out.decode().split("\0") if name]


def text_of(path: Path) -> str | None:
    """The file's text, or None for a binary file (images, ...) or one deleted in the work tree."""
    try:
        data = path.read_bytes()
    except (FileNotFoundError, IsADirectoryError):
        return None
    if b"\0" in data[:8192]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def offending_lines() -> tuple[list[str], set[tuple[str, str]]]:
    """('file:line: text' of each absolute machine path not allowed, the allow-list entries used)."""
    found, used = [], set()
    for name in tracked_files():
        if name == THIS:
            continue
        text = text_of(REPO / name)
        if text is None:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if not ABSOLUTE.search(line):
                continue
            allowed = [key for key in ALLOWED if key[0] == name and key[1] in line]
            if allowed:
                used.update(allowed)
            else:
                found.append(f"{name}:{number}: {line.strip()[:160]}")
    return found, used


def test_no_tracked_file_names_an_absolute_machine_path():
    found, used = offending_lines()
    assert not found, (
        "absolute paths of one machine in tracked files (point to a file in the repository, use a path "
        "relative to it, $FEDSIM_DATA_DIR or tempfile.gettempdir(); or allow it in "
        f"{THIS} with the reason):\n" + "\n".join(found))
    stale = sorted(set(ALLOWED) - used)
    assert not stale, f"allow-list entries that match no line any more (remove them from {THIS}): {stale}"


def test_the_pattern_catches_machine_paths_and_spares_relative_ones():
    # the first written in two pieces, so that this file itself names no machine root
    for line in ("see /" + "work/shared/reference/algorithms.md", "flock /tmp/fedsim-bench.lock x",
                 "`/home/me/app`", "cd /Users/me", r"C:\Users\me", "--app-dir=/mnt/old"):
        assert ABSOLUTE.search(line), line
    for line in ("../shared/data", "~/myapp", "$HOME/tmp/x", ".venv/bin/python", "docs/paper_scale.md",
                 "https://github.com/home/x", "/opt/fedsim/venv", "/var/lib/fedsim"):
        assert not ABSOLUTE.search(line), line
