"""Kill a real fedsim server process with SIGKILL between any two of its file-system writes, resume
it, and compare with the uninterrupted run (tests/test_chaos_server.py, benchmarks/chaos.py).

A child process (`python tests/kill_points.py child ...`) runs a scenario in a run folder with the
real strategy over the in-process grid (fedsim.flower.local_grid; clients keep their memory in the
run folder, as under `fedsim run`). A Python audit hook sees every write it makes there: a file
opened for writing, a rename, a removal. Event number `kill_at` is not carried out: the hook sends
the process SIGKILL first, as the kernel's OOM killer or a power cut would. A kill inside a write
(a rounds.jsonl line or a checkpoint half written) is the kill at that file's opening followed by
the bytes a cut write leaves: half of the line the uninterrupted run wrote there (`torn`).

`campaign()` runs the scenario whole once (counting its writes), then once per kill point: killed,
resumed in a fresh child, compared line by line (times left out), summary and final global model
bit for bit. Its children are forked by one server process that imported fedsim once (`ForkServer`).
A kill point may instead make the write fail (`N:ENOSPC`): the run must then end with exit code 1
and an error naming the file.
"""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


# --- the child ---------------------------------------------------------------------------------------
def _write_event(event: str, args: tuple, root: str) -> str | None:
    """'open <path>' / 'rename <src> -> <dst>' / 'remove <path>' for a write under `root`, else None."""
    if event == "open":
        path, mode, flags = args
        if not isinstance(path, (str, bytes, os.PathLike)):
            return None
        writes = any(c in mode for c in "wax+") if isinstance(mode, str) else bool((flags or 0) & WRITE_FLAGS)
        path = os.path.abspath(os.fsdecode(path))
        return f"open {os.path.relpath(path, root)}" if writes and path.startswith(root) else None
    if event == "os.rename":
        src, dst = (os.path.abspath(os.fsdecode(p)) for p in args[:2])
        return f"rename {os.path.relpath(src, root)} -> {os.path.relpath(dst, root)}" if dst.startswith(root) else None
    if event in ("os.remove", "os.truncate"):
        path = os.path.abspath(os.fsdecode(args[0])) if isinstance(args[0], (str, bytes, os.PathLike)) else ""
        return f"{event[3:]} {os.path.relpath(path, root)}" if path.startswith(root) else None
    return None


def install_killer(root: str, events_file: str, kill_at: int | str) -> list[str]:
    """Record this process's writes under `root` (returned list); SIGKILL it before write number
    `kill_at` (1-based; 0: never), after listing the writes so far in `events_file`. `kill_at`
    "N:ENOSPC" (any errno name) makes write N fail with that error instead, and every later write
    but removals: a disk that fills up or a folder that turns read-only stays so."""
    number, _, error = str(kill_at).partition(":")
    kill_at, fail = int(number), getattr(errno, error) if error else None
    root = os.path.abspath(root) + os.sep
    seen: list[str] = []

    def hook(event: str, args: tuple) -> None:
        what = _write_event(event, args, root)
        if what is None:
            return
        seen.append(what)
        if fail is not None and kill_at and len(seen) >= kill_at and not what.startswith("remove "):
            Path(events_file).write_text("\n".join(seen) + "\n")
            raise OSError(fail, os.strerror(fail), os.path.join(root, what.split(" ")[-1]))
        if len(seen) == kill_at:
            Path(events_file).write_text("\n".join(seen) + "\n")  # outside the run folder: not an event
            os.kill(os.getpid(), signal.SIGKILL)

    sys.addaudithook(hook)
    return seen


def child(run_dir: str, events_file: str, kill_at: int | str) -> None:
    """Run (or resume) the scenario in `run_dir` in this process over the in-process grid."""
    from fedsim.client.app import make_client_app
    from fedsim.flower.local_grid import LocalGrid
    from fedsim.runs.folder import RunFolder
    from fedsim.scenario import load_scenario
    from fedsim.server.app import run_server

    folder = RunFolder(run_dir)
    scenario = load_scenario(folder.scenario_file)
    app = make_client_app(scenario, folder.client_states)
    grid = LocalGrid(app, scenario.federation.num_clients)
    seen = install_killer(run_dir, events_file, kill_at)
    run_server(grid, scenario, folder, checkpoints=True)
    Path(events_file).write_text("\n".join(seen) + "\n")


# --- the parent ----------------------------------------------------------------------------------------
class ForkServer:
    """A process that imports fedsim once and forks one child per run: each child is a real process
    that its hook may SIGKILL, and none pays the imports (seconds) again. The children's output goes
    to `<events file>.out`."""

    def __init__(self) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__)), "serve"], env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def run(self, run_dir: Path, events_file: Path, kill_at: int | str) -> tuple[int, str]:
        self.proc.stdin.write(json.dumps([str(run_dir), str(events_file), str(kill_at)]) + "\n")
        self.proc.stdin.flush()
        reply = self.proc.stdout.readline()
        if not reply:
            raise RuntimeError(f"the fork server ended (exit {self.proc.wait()})")
        code = json.loads(reply)
        return code, Path(f"{events_file}.out").read_text()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)

    def __enter__(self) -> "ForkServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def serve() -> None:
    """The fork server's loop: a JSON [run_dir, events_file, kill_at] per line in, an exit code out
    (negative: killed by that signal)."""
    import traceback

    import fedsim.client.app, fedsim.flower.local_grid, fedsim.scenario, fedsim.server.app  # noqa: F401,E401  once, before forking

    for line in sys.stdin:
        run_dir, events_file, kill_at = json.loads(line)
        pid = os.fork()
        if pid == 0:  # the child: its output to a file, never to the pipe the server answers on
            out = os.open(f"{events_file}.out", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(out, 1)
            os.dup2(out, 2)
            code = 0
            try:
                child(run_dir, events_file, kill_at)
            except BaseException:  # noqa: BLE001  reported as the run's output and exit code
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        print(json.dumps(-os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)), flush=True)


def run_child(run_dir: Path, events_file: Path, kill_at: int | str = 0, server: ForkServer | None = None) -> tuple[int, str]:
    """(exit code, output) of a child run (forked by `server`, else a fresh process); an error if it
    failed other than as asked (killed: -9; a write error: exit 1)."""
    if server is not None:
        code, out = server.run(run_dir, events_file, kill_at)
    else:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
        proc = subprocess.run([sys.executable, str(Path(__file__)), "child", str(run_dir), str(events_file), str(kill_at)],
                              env=env, capture_output=True, text=True, timeout=300)
        code, out = proc.returncode, proc.stderr
    if code not in (0, -signal.SIGKILL) and not (code == 1 and ":" in str(kill_at)):
        raise RuntimeError(f"child exited with {code}:\n{out[-3000:]}")
    return code, out


@dataclass
class KillPoint:
    number: int  # the write it was killed before (1-based)
    event: str
    torn: bool = False  # and the file it was opening was left with half its next content
    error: str | None = None  # not killed: this write and those after it fail with this errno (ENOSPC)

    @property
    def label(self) -> str:
        return f"#{self.number} {self.event}" + (" (torn)" if self.torn else "") + (f" ({self.error})" if self.error else "")

    @property
    def kill_at(self) -> str:
        return f"{self.number}:{self.error}" if self.error else str(self.number)


@dataclass
class Outcome:
    point: KillPoint
    identical: bool
    lines_lost: int
    problems: list[str] = field(default_factory=list)


def new_run(scenario, parent: Path, name: str) -> Path:
    from fedsim.runs.folder import RunFolder

    return RunFolder.at(parent / name, scenario).path


def _final_state(run_dir: Path) -> tuple[list[dict], dict, bytes]:
    import torch

    from fedsim.runs.checkpoint import load_server
    from fedsim.runs.folder import RunFolder
    from fedsim.runs.results import read_rounds
    from fedsim.server.record import without_times

    folder = RunFolder(run_dir)
    summary = json.loads(folder.summary_file.read_text())
    for key in ("wall_seconds", "run_dir"):  # the clock's time and the folder's name differ between runs
        summary.pop(key, None)
    summary.get("backdoor_lifecycle", {}).pop("attacker_train_seconds", None)
    rounds = read_rounds(folder)
    state = load_server(folder, at_most=max(r["round"] for r in rounds))
    return without_times(rounds), summary, state["global"].numpy().tobytes() if isinstance(state["global"], torch.Tensor) else b""


def _tear(event: str, run_dir: Path, reference: Path) -> None:
    """Leave what a kill in the middle of the write `event` (an opening) leaves: half a rounds.jsonl
    line (appended in place), or a temp file never renamed."""
    target = event.split(" ", 1)[1]
    path = run_dir / target
    if target == "rounds.jsonl":
        have = path.read_text().count("\n") if path.exists() else 0
        line = (reference / "rounds.jsonl").read_text().splitlines()[have]
        with open(path, "a") as fh:
            fh.write(line[: len(line) // 2])
    else:
        path.write_bytes(os.urandom(1000))


def written_file(event: str) -> str:
    """The file a write event is for: a renamed file's new name, a temp file's target
    (`checkpoint/.round-2.pt.tmp123` -> `checkpoint/round-2.pt`)."""
    path = Path(event.split(" ", 1)[1].split(" -> ")[-1])
    return str(path.with_name(re.sub(r"^\.(.+)\.tmp\d+$", r"\1", path.name)))


def _no_pid(event: str) -> str:
    """A write's description without the writer's process id (in temp files' names)."""
    return re.sub(r"\.tmp\d+", ".tmp", event)


def kill_points(events: list[str], tear: bool = True, errors: tuple[str, ...] = ()) -> list[KillPoint]:
    """Every write a kill can come before; each opening of rounds.jsonl or of a temp file again with
    the write cut in half (`tear`), and failing with each of `errors` (errno names)."""
    points = [KillPoint(i + 1, e) for i, e in enumerate(events)]
    openings = [(i + 1, e) for i, e in enumerate(events) if e == "open rounds.jsonl" or (e.startswith("open ") and ".tmp" in e)]
    if tear:
        points += [KillPoint(n, e, torn=True) for n, e in openings]
    points += [KillPoint(n, e, error=error) for error in errors for n, e in openings]
    return points


def campaign(scenario, workdir: Path, select=None, log=print, errors: tuple[str, ...] = ()) -> tuple[list[KillPoint], list[Outcome]]:
    """Run `scenario` whole, then killed (or failing to write) at each kill point (or those
    `select(points)` keeps) and resumed; returns (all points, outcomes). A failed write must end
    the run with exit code 1 and an error naming the run's file."""
    with ForkServer() as server:
        return _campaign(scenario, workdir, select, log, errors, server)


def _campaign(scenario, workdir, select, log, errors, server):
    reference = new_run(scenario, workdir, "whole")
    run_child(reference, workdir / "whole.events", server=server)
    events = (workdir / "whole.events").read_text().splitlines()
    points = kill_points(events, errors=errors)
    chosen = select(points) if select is not None else points
    expected = _final_state(reference)
    outcomes = []
    for k, point in enumerate(chosen):
        cut = new_run(scenario, workdir, f"cut-{k}")
        code, out = run_child(cut, workdir / f"cut-{k}.events", kill_at=point.kill_at, server=server)
        problems = []
        if point.error is None and code != -signal.SIGKILL:
            problems.append(f"the child was not killed (exit {code})")
        seen = (workdir / f"cut-{k}.events").read_text().splitlines()
        if point.error is not None:
            # the server's own file; a client's (its memory) fails that client's message, and the
            # server's next write, on the same full disk, ends the run
            named = re.findall(rf"{os.strerror(getattr(errno, point.error))}: '([^']+)'", out)
            target = str(cut / written_file(seen[point.number - 1]))
            server_file = "/clients/" not in target
            if code != 1 or not named or (named[-1] != target if server_file else not named[-1].startswith(f"{cut}/")):
                problems.append(f"a failed write did not end the run with an error naming {target} (exit {code})")
            seen = seen[: point.number]
        if [_no_pid(e) for e in seen] != [_no_pid(e) for e in events[: point.number]]:
            problems.append(f"the killed run's writes differ from the whole run's: {seen[-1:]} vs {events[point.number - 1]}")
        if point.torn:
            _tear(seen[-1], cut, reference)
        run_child(cut, workdir / f"resume-{k}.events", server=server)  # resume
        got = _final_state(cut)
        lost = sum(1 for line in expected[0] if line not in got[0])
        for name, a, b in zip(("rounds.jsonl", "summary.json", "global model"), got, expected):
            if a != b:
                problems.append(f"{name} differs from the uninterrupted run's")
        leftovers = [p.name for p in cut.rglob(".*.tmp*")]
        if leftovers:
            problems.append(f"temp files left: {leftovers}")
        outcome = Outcome(point, identical=not problems, lines_lost=lost, problems=problems)
        outcomes.append(outcome)
        log(f"{point.label}: {'identical' if outcome.identical else '; '.join(problems)}")
    return points, outcomes


def cli_child(root: str, events_file: str, kill_at: int | str, argv: list[str]) -> int:
    """`fedsim <argv>` (Ray-simulated clients) in this process, killed at write `kill_at` under `root`."""
    from fedsim.cli import main

    seen = install_killer(root, events_file, kill_at)
    code = main(argv)
    Path(events_file).write_text("\n".join(seen) + "\n")
    return code


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "child":
        child(sys.argv[2], sys.argv[3], sys.argv[4])
    elif sys.argv[1:] == ["serve"]:
        serve()
    elif len(sys.argv) > 5 and sys.argv[1] == "cli":
        sys.exit(cli_child(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:]))
    else:
        sys.exit("usage: kill_points.py child RUN_DIR EVENTS_FILE KILL_AT | serve | cli ROOT EVENTS_FILE KILL_AT FEDSIM-ARGS...")
