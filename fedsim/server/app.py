"""The ServerApp: run the scenario's strategy and write the run folder round by round."""

from __future__ import annotations

import logging
import re
import threading
from pathlib import Path
from typing import Callable

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fedsim.flower.compat import flower_log as flwr_log
from fedsim.runs.atomic import remove_temp_files
from fedsim.runs.checkpoint import load_server
from fedsim.flower.stoppable_grid import RunStopped, StoppableGrid
from fedsim.flower.options import EngineOptions
from fedsim.runs.folder import RunFolder
from fedsim.runs.results import append_round, every_round_skipped, read_rounds, rewrite_rounds, rounds_torn, summarize, write_summary
from fedsim.runtime import runtime_for
from fedsim.scenario import scenario_fingerprint
from fedsim.server.strategy import ScenarioStrategy
from fedsim.tracking.trackers import Trackers

log = logging.getLogger("fedsim")
NodeMap = Callable[[Grid, float], "dict[int, int] | None"]  # (grid, timeout) -> {partition id: node id}, or None


def run_server(grid: Grid, scenario, run_dir: Path | RunFolder, progress=None, checkpoints: bool = False,
               real_clock: bool = False) -> dict:
    """Drive all rounds on `grid`; returns the summary (also written to `run_dir/summary.json`).

    `run_dir` is the run's folder, made by the caller (fedsim/runs/folder.py). With `checkpoints`,
    the server's state is saved every round under its `checkpoint/`, and a run folder that already
    holds completed rounds is resumed after the last of them.
    """
    return drive_server(grid, scenario, run_dir, progress, checkpoints, real_clock=real_clock)()


def drive_server(grid: Grid, scenario, run_dir: Path | RunFolder, progress=None, checkpoints: bool = False,
                 defer_last_evaluation: bool = False, options: EngineOptions = EngineOptions(),
                 node_map: NodeMap | None = None, real_clock: bool = False) -> Callable[[], dict]:
    """Run the rounds of `run_server`; returns the call that completes the run (waits for the last
    round's line, writes and returns the summary).

    With `defer_last_evaluation` (and `evaluation.overlap`), this returns as soon as the last round
    is aggregated and its evaluation runs in the background: the simulation engine then stops its
    client actors and Ray (about 2 s) while the global model is evaluated, instead of after.
    `node_map(grid, timeout)` gives the simulation engine's {partition id: node id} (see
    fedsim/server/nodes.py); `options` are the engine's (fedsim/flower/options.py). `real_clock`: a
    deployment, where a `systems:` section's asynchronous round runs on the real clock.
    """
    trackers = Trackers.of(scenario, run_dir)  # a sink whose library is missing fails here, before any round
    rt = runtime_for(scenario)
    fed = scenario.federation
    run_dir = RunFolder.of(run_dir)

    def on_round(record: dict) -> None:
        append_round(run_dir, record)
        trackers.log_round(record)
        if progress is not None:
            progress(record)

    strategy = ScenarioStrategy(rt, on_round=on_round, checkpoint_to=run_dir if checkpoints else None,
                                        options=options, node_map=node_map, defer_last_round=defer_last_evaluation,
                                        real_clock=real_clock, run_folder=run_dir)
    done = prepare_resume(run_dir, strategy, scenario) if checkpoints else 0
    if done < fed.rounds:
        strategy.discover_nodes(grid, timeout=fed.round_timeout)
        try:
            strategy.start(
                grid=grid,
                initial_arrays=strategy.arrays(),
                num_rounds=fed.rounds - done,
                timeout=fed.round_timeout,
                evaluate_fn=strategy.end_round,
            )
        except RunStopped:
            strategy.wait_for_lines()  # a completed round's evaluation still running keeps its line
            trackers.close()
            raise
        except BaseException:
            trackers.close()  # the tracking runs end as stopped; a resume continues them
            raise

    def complete() -> dict:
        strategy.wait_for_lines()
        summary = finish(run_dir, scenario, rt)
        trackers.finish(summary)  # after summary.json: tracking is a copy of the run folder
        return summary

    return complete


def prepare_resume(run_dir: RunFolder, strategy: ScenarioStrategy, scenario) -> int:
    """Load the newest checkpoint of `scenario` that has its rounds.jsonl line; drop anything later.
    Returns its round.

    Clients' own saved state from later rounds is theirs to drop (fedsim/runs/checkpoint.py)."""
    for folder in (run_dir.path, run_dir.checkpoints, run_dir.client_states):  # writes a killed run never finished
        remove_temp_files(folder)
    rounds = read_rounds(run_dir)
    last_line = max((r["round"] for r in rounds), default=0)
    state = load_server(run_dir, at_most=last_line, scenario_id=scenario_fingerprint(scenario))
    done = int(state["round"]) if state is not None else 0
    if state is not None:
        strategy.resume_from(state)
    keep = [r for r in rounds if r["round"] <= done] if done else []  # nothing to resume: start afresh
    if len(keep) != len(rounds) or rounds_torn(run_dir):  # a torn last line goes too
        rewrite_rounds(run_dir, keep)
    return done


def finish(run_dir: RunFolder, scenario, rt) -> dict:
    """Write summary.json. A run that measured nothing says so there (`all_rounds_skipped`, and
    why in `failure`): its numbers are those of the initial model, and a sweep must not count it
    as done (fedsim/cli.py: cmd_sweep runs it again)."""
    rounds = read_rounds(run_dir)
    failure = nothing_trained(rounds)
    extra = {"attackers": rt.attackers, "run_dir": str(run_dir.path), "all_rounds_skipped": failure is not None,
             "failure": failure}
    if rt.attack is not None:
        extra["attack"] = rt.attack.report(rt)
    summary = summarize(scenario, rounds, extra)
    write_summary(run_dir, summary)
    return summary


def nothing_trained(rounds: list[dict], causes: int = 3) -> str | None:
    """Why no round of the run was aggregated (None when one was): the rounds' `skipped` reasons
    and the first `causes` distinct reasons the clients' uploads were rejected for (a client's
    error, a node gone offline, a timeout), each cut to one line."""
    reason = every_round_skipped(rounds)
    if reason is None:
        return None
    seen = dict.fromkeys(_one_line(v) for r in rounds if r["round"] > 0 for v in (r.get("rejected") or {}).values())
    if seen:
        listed = list(seen)[:causes]
        more = f" (+{len(seen) - len(listed)} more in rounds.jsonl)" if len(seen) > len(listed) else ""
        reason += "; uploads rejected: " + " | ".join(listed) + more
    return reason


def _one_line(reason, limit: int = 300) -> str:
    """A rejection reason on one line. A traceback (a ClientApp's error through Ray or Flower)
    becomes its first line's prefix and the first `SomeError: message` line in it, the root cause."""
    lines = [line.strip() for line in str(reason).splitlines() if line.strip()]
    if len(lines) > 1:
        cause = next((line for line in lines if re.match(r"[A-Za-z_][\w.]*(Error|Exception): ", line)), None)
        if cause is not None:
            return f"{lines[0].split(':', 1)[0]}: {cause}"[:limit]
    return " ".join(lines)[:limit]


# --- the round's line in a log: the columns of `fedsim run`'s table (fedsim/cli.py: round_table) ---
ROUND_COLUMNS = ("round", "acc", "backdoor", "loss", "attackers", "rejected", "MB up", "MB down", "s")


def _percent(value) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def round_cells(record: dict) -> list[str]:
    """One rounds.jsonl line as the cells of ROUND_COLUMNS."""
    return [
        str(record["round"]),
        _percent(record.get("main_accuracy")),
        _percent(record.get("backdoor_success")),
        "-" if record.get("main_loss") is None else f"{record['main_loss']:.3f}",
        ",".join(map(str, record.get("attackers", []))) or "-",
        str(len(record.get("rejected") or {})) + (" (skipped)" if record.get("skipped") else ""),
        f"{record.get('bytes_up', 0) / 1e6:.2f}",
        f"{record.get('bytes_down', 0) / 1e6:.2f}",
        f"{record.get('wall_seconds', 0):.1f}",
    ]


def round_log_line(record: dict, rounds: int) -> str:
    """`fedsim round 3/10: acc 91.2% | backdoor 4.0% | ...`: a round's table row as one log line."""
    cells = dict(zip(ROUND_COLUMNS, round_cells(record)))
    head = f"fedsim round {cells.pop('round')}/{rounds}: "
    return head + " | ".join(f"{column} {cell}" for column, cell in cells.items())


def make_server_app(scenario=None, run_dir: Path | RunFolder | None = None, progress=None, checkpoints: bool = False,
                    on_rounds_done: Callable[[Callable[[], dict]], None] | None = None,
                    stop: threading.Event | None = None, finished: threading.Event | None = None,
                    options: EngineOptions = EngineOptions(), node_map: NodeMap | None = None) -> ServerApp:
    """A ServerApp for `scenario` (simulation), or reading it from the run config (deployment).

    With `on_rounds_done` (fedsim's simulation), the app hands it the call that completes the run
    and returns without waiting for the last round's evaluation (see `drive_server`); the caller
    must make that call after the engine has stopped. With `stop`, the app stops waiting for
    replies once the event is set and returns (fedsim.engine.interrupt); `finished` is set when it returns.
    `options` and `node_map` go to `drive_server`.
    """
    from fedsim.deploy.run_config import scenario_from_context

    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        scen = scenario if scenario is not None else scenario_from_context(context)
        keep = checkpoints
        if run_dir is None:  # under `flwr run` the ServerApp starts the run (or continues one: `resume-dir`)
            folder, keep = deployed_run_folder(scen, context)
        else:
            folder = RunFolder.of(run_dir)
        if scenario is None:  # Flower's HTTP grid pulls any reply whole: stop at the server's bound instead
            from fedsim.deploy.bounded_grid import bounded, reply_limit

            grid = bounded(grid, reply_limit(runtime_for(scen).layout))
        report = progress
        if report is None and scenario is None:  # under `flwr run`: each round's row in the ServerApp's log
            report = log_rounds(scen.federation.rounds)
            flwr_log(logging.INFO, "fedsim: run folder %s (on this machine)", folder.path.resolve())
        if stop is not None:
            grid = StoppableGrid(grid, stop, options.reply_poll_seconds)
        try:
            if on_rounds_done is None:
                try:
                    summary = run_server(grid, scen, folder, report, keep, real_clock=scenario is None)
                except BaseException as err:  # noqa: BLE001 - logged, then raised as it came
                    if scenario is None and not isinstance(err, RunStopped):
                        log_resume_hint(folder, keep, err)
                    raise
                if summary.get("failure"):  # under `flwr run`: the run ends as failed (fedsim's simulation: the CLI's exit code)
                    raise RuntimeError(f"{summary['failure']} (results in {folder.path})")
            else:
                on_rounds_done(drive_server(grid, scen, folder, progress, checkpoints, defer_last_evaluation=True,
                                            options=options, node_map=node_map))
        except RunStopped as stopped:
            log.info("ServerApp stopped: %s", stopped)
        finally:
            if finished is not None:
                finished.set()

    return app


def deployed_run_folder(scenario, context: Context) -> tuple[RunFolder, bool]:
    """The run folder of a ServerApp under `flwr run`, and whether it keeps checkpoints.

    A fresh folder under the run config's `output-dir` (default: `output.dir`), holding the run
    config it was started with, so that `fedsim deploy run --resume DIR` can start it again; or,
    with `resume-dir`, that folder, continued after its last checkpointed round (checked against
    this run's scenario first: fedsim/deploy/run_config.py: resumed_folder). Checkpoints follow
    `output.checkpoints`: the server's state only (each device keeps its own, `--state-dir`)."""
    from fedsim.deploy.run_config import record_run_config, resumed_folder

    resume = str(context.run_config.get("resume-dir", "") or "")
    if resume:
        folder = resumed_folder(resume, scenario)
        flwr_log(logging.INFO, "fedsim: resuming the run in %s after its last checkpointed round", folder.path)
        return folder, True
    folder = RunFolder.create(scenario, context.run_config.get("output-dir") or None)
    record_run_config(folder, context)
    return folder, scenario.output.checkpoints


def log_resume_hint(folder: RunFolder, checkpoints: bool, err: BaseException) -> None:
    """A deployed run that ends without finishing (its SuperLink gone or restarted, the run stopped,
    the process interrupted): say through Flower's logger what it kept and how to continue it.
    Best effort: when the SuperLink is gone, only the ServerApp's own console gets the line, which
    is why `fedsim deploy run` says it too (fedsim/deploy/commands.py: run_and_check)."""
    try:
        kept = [r["round"] for r in read_rounds(folder) if r["round"] > 0] if folder.rounds_file.exists() else []
    except (OSError, ValueError):
        kept = []
    what = f"rounds 1-{max(kept)}" if kept else "no completed round"
    if checkpoints:
        flwr_log(logging.ERROR, "fedsim: the run stopped (%s) with %s in %s; continue it with: fedsim deploy run "
                 "--resume %s", type(err).__name__, what, folder.path, folder.path.resolve())
    else:
        flwr_log(logging.ERROR, "fedsim: the run stopped (%s) with %s in %s (output.checkpoints is off: it cannot "
                 "be resumed)", type(err).__name__, what, folder.path)


def log_rounds(rounds: int) -> Callable[[dict], None]:
    """Progress for a ServerApp under `flwr run`: each round's row, logged when its line is written
    (after its evaluation). Flower's own "Global evaluation" line cannot serve: with
    `evaluation.overlap` a round's evaluation is still running when Flower logs it, so it shows
    `MetricRecord: None` for every round but the last. Through Flower's logger, whose output
    `flwr run --stream` and `flwr log` show."""

    def log_round(record: dict) -> None:
        flwr_log(logging.INFO, "%s", round_log_line(record, rounds))

    return log_round


# The component `flwr run` loads (`[tool.flwr.app.components]` in pyproject.toml): the scenario
# comes from the run config's `scenario` key.
app = make_server_app()
