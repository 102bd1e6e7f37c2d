"""`fedsim run | validate | list`: the command line."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import threading
from pathlib import Path

from rich.console import Console
from rich.table import Table

console = Console()
err_console = Console(stderr=True)


def _fmt(value, pct: bool = False) -> str:
    if value is None:
        return "-"
    return f"{100 * value:.1f}%" if pct else f"{value}"


def print_wide(renderable) -> None:
    """Print without cutting columns: a console that is not a terminal (CI logs, `| tee`) is taken
    as 80 columns wide by rich, which ellipsizes a table ("backdo…"); give it the table's width."""
    from rich.measure import Measurement

    if console.is_terminal:
        console.print(renderable)
        return
    width, narrow = console.width, console.width
    width = max(width, min(Measurement.get(console, console.options.update_width(400), renderable).maximum, 400))
    console.width = width  # print(width=...) would be capped at the console's width
    try:
        console.print(renderable)
    finally:
        console.width = narrow


def round_table(rounds: list[dict], title: str) -> Table:
    """The rounds as a table; its rows are the lines a ServerApp under `flwr run` logs per round."""
    from fedsim.server.app import ROUND_COLUMNS, round_cells

    table = Table(title=title)
    for col in ROUND_COLUMNS:
        table.add_column(col, justify="right", no_wrap=True)
    for r in rounds:
        table.add_row(*round_cells(r))
    return table


def preflight_runs(runs, source: str) -> None:
    """`preflight` once per distinct data/model/attack of a sweep's runs (what the files decide)."""
    from fedsim.preflight import preflight
    from fedsim.scenario import scenario_dict

    seen = set()
    for run in runs:
        d = scenario_dict(run.scenario)
        key = json.dumps([d["data"], d["model"], d["attack"], d["federation"]["num_clients"], d["seed"]], sort_keys=True)
        if key not in seen:
            seen.add(key)
            preflight(run.scenario, f"{source} [{run.name}]")


def cmd_validate(args) -> int:
    from fedsim.preflight import preflight
    from fedsim.scenario import dump_scenario, load_scenario, read_yaml

    raw = read_yaml(args.file)
    if isinstance(raw, dict) and "sweep" in raw:
        from fedsim.runs.sweep import expand

        name, runs = expand(args.file, args.set)
        preflight_runs(runs, str(args.file))
        console.print(f"sweep {name}: {len(runs)} valid runs", markup=False, highlight=False)  # a name is the user's text
        for run in runs:
            console.print(f"  {run.name}", markup=False, highlight=False)
        return 0
    scenario = load_scenario(args.file, args.set)
    preflight(scenario, str(args.file))
    console.print(dump_scenario(scenario), markup=False, highlight=False)
    return 0


def param_defaults(params) -> str:
    """`key=default` for every parameter of a component (its `name` aside)."""
    parts = []
    for key, field in params.model_fields.items():
        if key == "name":
            continue
        if field.is_required():
            parts.append(f"{key} (required)")
        else:
            default = field.default_factory() if field.default_factory else field.default
            if hasattr(default, "model_dump"):
                default = default.model_dump(mode="json").get("name", default)
            parts.append(f"{key}={default!r}")
    return ", ".join(parts)


def option_sets() -> dict[str, list]:
    """Choices that are pydantic unions inside a component rather than registries of their own:
    attack schedules, edge-case sets, low-rank schemes. {kind: [parameter model, ...]}."""
    import typing

    from fedsim.attacks.schedules import Schedule
    from fedsim.data.edge import EdgeSpec
    from fedsim.scenario import Cuttlefish, Pufferfish

    def members(annotated) -> list:
        return list(typing.get_args(typing.get_args(annotated)[0]))

    return {"schedule": members(Schedule), "edge set": members(EdgeSpec), "lowrank": [Pufferfish, Cuttlefish]}


def first_sentence(doc: str | None) -> str:
    """A docstring's first sentence, joined across its wrapped lines."""
    paragraph = " ".join((doc or "").strip().split("\n\n")[0].split())
    return paragraph.split(". ")[0].rstrip(".") + "."


def source_file(module: str) -> str:
    """Where a module's code is, as a path from the folder holding the fedsim package (the
    repository in a checkout: `aggregators/krum.py`, which installs as fedsim.aggregators.krum)."""
    import importlib.util

    import fedsim

    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        return module
    root, origin = Path(fedsim.__file__).resolve().parents[1], Path(spec.origin).resolve()
    return str(origin.relative_to(root)) if origin.is_relative_to(root) else module


def code_of(entry) -> str:
    """Where a registered component's code is: its module, and for a round protocol the modules of
    its server exchange and client step too."""
    modules = [entry.where]
    for ref in (getattr(entry.traits, "exchange", None), getattr(entry.traits, "client_step", None)):
        if isinstance(ref, str) and ":" in ref:
            modules.append(ref.partition(":")[0])
    return ", ".join(source_file(m) for m in dict.fromkeys(m for m in modules if m))


def listing(where: bool = False) -> dict[str, list[tuple[str, ...]]]:
    """{kind: [(YAML name, parameters with defaults, one-line summary)]} of everything a scenario can name,
    with where its code is as a fourth column when `where`."""
    from fedsim.registry import ALL

    def row(name, params, summary, module_paths):
        return (name, params, summary, module_paths()) if where else (name, params, summary)

    out = {kind: [row(e.name, param_defaults(e.params), e.summary, lambda e=e: code_of(e)) for e in ALL[kind].entries()]
           for kind in sorted(ALL)}
    for kind, models in option_sets().items():
        out[kind] = [row(m.model_fields["name"].default, param_defaults(m), first_sentence(m.__doc__),
                         lambda m=m: source_file(m.__module__)) for m in models]
    return out


def component_table_markdown() -> str:
    """The README's component table, generated from the registries and the option sets."""
    lines = ["| kind | YAML name | parameters (default) | what it is |", "|---|---|---|---|"]
    for kind, rows in listing().items():
        for name, params, summary in rows:
            params = params.replace("|", "\\|") or "-"
            lines.append(f"| {kind} | `{name}` | {params} | {summary.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def scenario_list_markdown() -> str:
    """The README's list of ready scenarios, generated from scenarios/."""
    from fedsim.scenario_files import ready_scenarios

    return "".join(f"- `{path}`: {what} — {about}\n" for path, what, about in ready_scenarios())


def replace_between(text: str, tag: str, body: str) -> str:
    head, rest = text.split(f"<!-- {tag}:start -->\n", 1)
    tail = rest.split(f"<!-- {tag}:end -->", 1)[1]
    return head + f"<!-- {tag}:start -->\n" + body + f"<!-- {tag}:end -->" + tail


KIND_ALIASES = {"edge_set": "edge set", "edge_sets": "edge set", "edge-set": "edge set", "edge-sets": "edge set",
                "tracking_sink": "tracking sink", "tracking-sink": "tracking sink", "tracking": "tracking sink",
                "sink": "tracking sink", "round protocol": "protocol",
                "codec": "compressor", "codecs": "compressor", "dataset": "dataset",
                "privacy_attack": "privacy attack", "privacy-attack": "privacy attack", "leakage": "privacy attack"}


def kind_name(text: str, kinds: list[str]) -> str | None:
    """The kind `text` names, singular or plural (`attack`, `attacks`, `edge_sets`)."""
    text = text.lower()
    for candidate in (text, text[:-1] if text.endswith("s") else text, text[:-2] if text.endswith("es") else text):
        candidate = KIND_ALIASES.get(candidate, candidate)
        if candidate in kinds:
            return candidate
    return None


def cmd_list(args) -> int:
    if args.markdown:
        print(component_table_markdown(), end="")
        return 0
    if args.write_readme:
        text = replace_between(args.write_readme.read_text(), "components", component_table_markdown())
        args.write_readme.write_text(replace_between(text, "scenarios", scenario_list_markdown()))
        return 0
    every = listing(where=args.where)
    kinds = list(every) + ["scenario"]
    if args.kind:
        kind = kind_name(args.kind, kinds)
        if kind is None:
            spelled = [k if k == "lowrank" else k.replace(" ", "_") + "s" for k in kinds]
            err_console.print(f"unknown kind {args.kind!r}; allowed: {', '.join(spelled)} (or singular)",
                              markup=False, highlight=False, soft_wrap=True)
            return 2
        kinds = [kind]
    for kind in kinds:
        if kind == "scenario":
            from fedsim.scenario_files import ready_scenarios

            table = Table(title="ready scenarios (fedsim run PATH, from any folder)")
            table.add_column("path", no_wrap=True)
            table.add_column("name")
            table.add_column("what it is")
            for row in ready_scenarios():
                table.add_row(*row)
        else:
            table = Table(title={"lowrank": "low-rank schemes"}.get(kind, f"{kind}s"))
            table.add_column("YAML name")
            table.add_column("parameters (default)")
            table.add_column("what it is")
            if args.where:
                table.add_column("code")
            for row in every[kind]:
                table.add_row(*row)
        print_wide(table)
    return 0


def cmd_run(args) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from fedsim.runs.folder import RunFolder
    from fedsim.scenario import ScenarioError, apply_overrides, read_yaml, validate_scenario

    if args.resume is not None:
        if args.file is not None or args.set:
            raise ScenarioError("--resume", [("--resume", "takes the run folder only: the scenario is its scenario.yaml", str(args.file))])
        run_dir = args.resume
        path = run_dir / "scenario.yaml"
    else:
        if args.file is None:
            raise ScenarioError("fedsim run", [("FILE", "a scenario file is required (or --resume DIR)", None)])
        path = args.file
    raw = read_yaml(path)
    if isinstance(raw, dict):
        raw = apply_overrides(raw, list(args.set or []))
    # Ray starts while the scenario is validated (which imports torch and every component), as a
    # sweep's does; it is shut down once the run's result, or an error, has been printed
    engine = begin_engine(args, raw)
    if engine is not None:
        args.later.callback(engine.close)
    from fedsim.engine.interrupt import RunInterrupted, on_signals
    from fedsim.flower.stoppable_grid import RunStopped  # imports Flower
    from fedsim.runs.results import read_rounds  # imports torch

    scenario = validate_scenario(raw, str(path))
    from fedsim.preflight import preflight

    # before a run folder exists; its caches of the data are what the warming client actors read
    preflight(scenario, str(args.resume or args.file))
    engine = start_run_engine(engine, scenario)
    stop = threading.Event()
    with on_signals(stop) as signals:
        try:
            if args.resume is None:
                run_dir = RunFolder.create(scenario, args.output).path
            from fedsim.engine.simulate import simulate  # imports flwr/ray: after the scenario is known to be valid

            columns = [TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                       TextColumn("{task.fields[status]}"), TimeElapsedColumn()]
            with Progress(*columns, console=console, transient=False) as progress:
                task = progress.add_task(scenario.name, total=scenario.federation.rounds, status="starting Ray..." if engine is None else "starting...")

                def on_round(record: dict) -> None:
                    status = f"acc {_fmt(record.get('main_accuracy'), True)}"
                    if record.get("backdoor_success") is not None:
                        status += f"  backdoor {_fmt(record['backdoor_success'], True)}"
                    progress.update(task, completed=record["round"], status=status)

                if engine is not None:
                    engine.open()
                simulate(scenario, run_dir=run_dir, verbose=args.verbose, progress=on_round, stop=stop, signals=signals,
                         engine=engine)
        except (RunInterrupted, RunStopped) as err:
            code = err.exit_code if isinstance(err, RunInterrupted) else 130
            code = stopped(code, scenario, run_dir if "run_dir" in locals() else None, fresh=args.resume is None)
            if engine is not None:  # Ray shuts down under fedsim's handlers: a second Ctrl-C exits at once
                engine.close()
            return code
        except OSError as err:
            if "run_dir" not in locals() or not _names_a_file_in(err, run_dir):
                raise
            code = write_failed(err, scenario, run_dir)
            if engine is not None:
                engine.close()
            return code
    if engine is not None:  # Ray shuts down while the results are printed
        args.later.callback(engine.close_in_background().join)
    print_wide(round_table(read_rounds(run_dir), f"{scenario.name} (seed {scenario.seed})"))
    summary = json.loads((run_dir / "summary.json").read_text())
    console.print(
        f"final main accuracy {_fmt(summary['final_main_accuracy'], True)}, "
        f"final backdoor success {_fmt(summary['final_backdoor_success'], True)} "
        f"(peak {_fmt(summary['peak_backdoor_success'], True)}), "
        f"{summary['total_bytes_up'] / 1e6:.2f} MB up, {summary['wall_seconds']:.1f} s in rounds"
    )
    console.print(f"results: {run_dir}", markup=False, highlight=False)
    return skipped_exit_code(read_rounds(run_dir))


def begin_engine(args, raw):
    """The Ray engine of `fedsim run` or `fedsim sweep` (fedsim/engine/shared.py), starting in the
    background, on the cluster the raw scenario's `federation.ray_address` or $RAY_ADDRESS names
    (validated after); None for a file that is not a mapping (validation then says why)."""
    if not isinstance(raw, dict):
        return None
    from fedsim.engine.shared import SharedEngine

    federation = raw.get("federation")
    address = federation.get("ray_address") if isinstance(federation, dict) else None
    return SharedEngine(address=address or os.environ.get("RAY_ADDRESS") or None, verbose=args.verbose).begin()


def start_run_engine(engine, scenario):
    """`engine` up with the run's client actors warming up, or None (closed) where the run starts
    Ray itself as before: clients with GPU shares (the path run on real GPUs, docs/gpu.md), or a
    Flower that lacks what a shared engine needs."""
    if engine is None:
        return None
    from fedsim.engine.ray_start import ray_address
    from fedsim.engine.shared import SharedEngine

    if scenario.federation.client_gpus > 0 or ray_address(scenario) != engine.address:
        engine.close()
        return None
    engine.start(scenario)
    if not SharedEngine.available():
        engine.close()
        return None
    return engine


def skipped_exit_code(rounds: list[dict]) -> int:
    """1 (with the reasons on stderr) when no round of the run was aggregated, else 0."""
    from fedsim.server.app import nothing_trained

    reason = nothing_trained(rounds)
    if reason is not None:
        err_console.print(f"error: {reason}", markup=False, highlight=False, soft_wrap=True)
        return 1
    skipped = [r["round"] for r in rounds if r["round"] > 0 and r.get("skipped")]
    if skipped:
        err_console.print(f"warning: rounds {skipped} were skipped (see 'skipped' in rounds.jsonl)", markup=False, highlight=False)
    return 0


def stopped(code: int, scenario, run_dir: Path | None, fresh: bool) -> int:
    """Say what an interrupted run kept and how to resume it; wait briefly for the ServerApp's threads."""
    from fedsim.engine.interrupt import exit_now, wait_for_threads
    from fedsim.runs.results import read_rounds

    done = max((r["round"] for r in read_rounds(run_dir)), default=0) if run_dir is not None else 0
    signal_name = {130: "SIGINT", 143: "SIGTERM"}.get(code, f"signal {code - 128}")
    if run_dir is None or (fresh and done == 0 and not (run_dir / "checkpoint").exists()):
        if run_dir is not None:  # nothing computed: no run folder is left behind
            shutil.rmtree(run_dir, ignore_errors=True)
        err_console.print(f"interrupted ({signal_name}) before the first round; nothing was kept", markup=False)
    elif scenario.output.checkpoints:
        err_console.print(f"interrupted ({signal_name}) after round {done} of {scenario.federation.rounds}; "
                          f"continue with: fedsim run --resume {run_dir}", markup=False, highlight=False, soft_wrap=True)
    else:
        err_console.print(f"interrupted ({signal_name}) after round {done} of {scenario.federation.rounds}; rounds so far "
                          f"are in {run_dir} (output.checkpoints is off: it cannot be resumed)",
                          markup=False, highlight=False, soft_wrap=True)
    if not wait_for_threads(5.0):
        exit_now(code)
    return code


def _names_a_file_in(err: OSError, folder: Path) -> bool:
    if err.filename is None:
        return False
    path = Path(os.fsdecode(err.filename)).resolve()
    return path.is_relative_to(Path(folder).resolve())


def write_failed(err: OSError, scenario, run_dir: Path) -> int:
    """A file of the run could not be written (a full disk, a folder made read-only): say which,
    why, what was kept and how to go on. Returns 1."""
    from fedsim.runs.results import read_rounds

    done = max((r["round"] for r in read_rounds(run_dir)), default=0)
    cause = err.strerror or str(err)
    head = f"error: cannot write {os.fsdecode(err.filename)}: {cause}; the run stopped after round {done} of {scenario.federation.rounds}"
    if scenario.output.checkpoints:
        tail = f"once it can be written again (free space, permissions), continue with: fedsim run --resume {run_dir}"
    else:
        tail = f"the rounds so far are in {run_dir} (output.checkpoints is off: it cannot be resumed)"
    err_console.print(f"{head}; {tail}", markup=False, highlight=False, soft_wrap=True)
    return 1


def cmd_sweep(args) -> int:
    from fedsim.runs.sweep import Grid, is_done, sweep_dir

    grid = Grid.read(args.file, args.set)
    if args.only:
        grid = grid.only(args.only)
    # Ray starts while the runs are validated, and the first run's client actors warm up
    # while this process imports the server and checks the files (fedsim/engine/shared.py)
    engine = begin_engine(args, grid.base)
    if engine is not None:
        args.later.callback(engine.close)
    name, runs = grid.name, grid.validated()
    folder = sweep_dir(name, runs, args.output)
    again = clear_runs_that_trained_nothing(folder, runs)
    todo = [r for r in runs if not is_done(folder / r.name)]
    if engine is not None:
        from fedsim.runs.report import load_drawing

        load_drawing()  # while Ray is still starting
        engine = start_sweep_engine(args, engine, todo)
    import shlex

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from fedsim.engine.interrupt import RunInterrupted, exit_now, on_signals, wait_for_threads
    from fedsim.flower.stoppable_grid import RunStopped
    from fedsim.runs.report import markdown_table, write_report

    preflight_runs(runs, str(args.file))
    console.print(f"sweep {name}: {len(runs)} runs, {len(runs) - len(todo)} already done, results in {folder}"
                  + (f"; {len(again)} that trained nothing last time run again" if again else ""),
                  markup=False, highlight=False)  # the name and folder are the user's text
    columns = [TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[status]}"), TimeElapsedColumn()]
    stop = threading.Event()
    with on_signals(stop) as signals:
        try:
            with Progress(*columns, console=console) as progress:
                overall = progress.add_task("runs", total=len(runs), completed=len(runs) - len(todo), status="")
                if todo:
                    run_on_one_engine(folder, runs, todo, args, progress, overall, stop, signals, engine)
        except (RunInterrupted, RunStopped, OSError) as err:
            if isinstance(err, OSError) and not _names_a_file_in(err, folder):
                raise
            code = err.exit_code if isinstance(err, RunInterrupted) else 130 if isinstance(err, RunStopped) else 1
            done = sum(finished(folder / r.name) for r in runs)
            again = ["fedsim", "sweep", str(args.file), *sum((["--set", s] for s in args.set), []),
                     *sum((["--only", s] for s in args.only), []),
                     *(["--output", str(args.output)] if args.output is not None else []),
                     *(["--jobs", str(args.jobs)] if args.jobs != 2 else [])]
            why = (f"error: cannot write {os.fsdecode(err.filename)}: {err.strerror or err}; the sweep stopped"
                   if isinstance(err, OSError) else f"sweep interrupted ({err})")
            err_console.print(f"{why}: {done} of {len(runs)} runs finished, in {folder}; "
                              f"continue with: {shlex.join(again)}", markup=False, highlight=False, soft_wrap=True)
            if not wait_for_threads(5.0):
                exit_now(code)
            return code
    if engine is not None:  # Ray shuts down while the report is drawn
        args.later.callback(engine.close_in_background().join)
    path = write_report([folder], folder / "report")
    done = [folder / r.name for r in runs if finished(folder / r.name)]
    print(markdown_table(done, {d: d.name for d in done}))
    console.print(f"report: {path}")
    failed = {r.name: why for r in runs if (why := trained_nothing(folder / r.name))}
    if failed:
        err_console.print(f"error: {len(failed)} of {len(runs)} runs trained nothing (every round skipped); "
                          "`fedsim sweep` runs them again:\n" + "\n".join(f"  {n}: {why}" for n, why in failed.items()),
                          markup=False, highlight=False, soft_wrap=True)
    return 0 if len(done) == len(runs) else 1


def trained_nothing(run_dir: Path) -> str | None:
    """Why a run that ended measured nothing (every round skipped), from its summary.json; None
    when it trained or has not ended. A summary written before `all_rounds_skipped` existed is
    judged from its rounds.jsonl."""
    from fedsim.runs.folder import RunFolder

    folder = RunFolder(run_dir)
    try:
        summary = json.loads(folder.summary_file.read_text())
    except (OSError, ValueError):
        return None
    if "all_rounds_skipped" not in summary:
        from fedsim.server.app import nothing_trained
        from fedsim.runs.results import read_rounds

        return nothing_trained(read_rounds(folder))
    return (summary.get("failure") or "every round was skipped") if summary["all_rounds_skipped"] else None


def finished(run_dir: Path) -> bool:
    """A sweep's run is done when it ended (summary.json) having trained: a run whose every round
    was skipped measured only the initial model, so it is neither counted nor reported as done."""
    from fedsim.runs.sweep import is_done

    return is_done(run_dir) and trained_nothing(run_dir) is None


def clear_runs_that_trained_nothing(folder: Path, runs) -> list[str]:
    """Make the sweep's runs that trained nothing run again, from the start: their rounds,
    checkpoints and summary are removed (a resume would only reload their last checkpoint and
    end the same way); their scenario, sweep.json and fedsim.log stay. Returns their names."""
    from fedsim.runs.folder import RunFolder

    names = []
    for run in runs:
        folder_of_run = RunFolder(folder / run.name)
        if trained_nothing(folder_of_run.path) is None:
            continue
        folder_of_run.rounds_file.unlink(missing_ok=True)
        shutil.rmtree(folder_of_run.checkpoints, ignore_errors=True)
        folder_of_run.summary_file.unlink()  # last: a clearing cut short is done again next time
        names.append(run.name)
    return names


def start_sweep_engine(args, engine, todo):
    """`engine` up, with the first unfinished run's client actors warming up; None (closed) when
    nothing is left to run or the installed Flower lacks what a shared engine needs."""
    from fedsim.engine.ray_start import ray_address
    from fedsim.engine.shared import SharedEngine
    from fedsim.scenario import ScenarioError

    addresses = {ray_address(r.scenario) for r in todo}
    if addresses - {engine.address}:  # a swept or case-set address
        raise ScenarioError(str(args.file), [("federation.ray_address", "the runs of one sweep share one Ray cluster",
                                              sorted(map(str, addresses | {engine.address})))])
    if not todo:
        engine.close()
        return None
    engine.start(todo[0].scenario)
    if not SharedEngine.available():  # imports Flower's engine: after Ray's start, while the actors warm up
        engine.close()
        err_console.print("warning: this Flower lacks what a shared engine needs; each run starts its own Ray, one at a time",
                          markup=False, highlight=False)
        return None
    return engine


def run_on_one_engine(folder: Path, runs, todo, args, progress, overall, stop, signals, engine) -> None:
    """`fedsim sweep`: every unfinished run on `engine` (start_sweep_engine), `--jobs` runs in
    flight at once, sharing its client actors; without one (a Flower that lacks what it needs),
    one run at a time, each starting its own Ray."""
    from fedsim.engine.simulate import simulate
    from fedsim.runs.sweep import run_sweep

    def runner(scenario, run_dir, engine=None):
        task = progress.add_task(scenario.name[:40], total=scenario.federation.rounds, status="")
        try:
            simulate(scenario, run_dir=run_dir, verbose=args.verbose, stop=stop, signals=signals, engine=engine,
                     progress=lambda r: progress.update(task, completed=r["round"]))
        finally:
            progress.remove_task(task)
        failure = trained_nothing(run_dir)
        progress.update(overall, advance=1, status=f"{scenario.name}: {'FAILED' if failure else 'ok'}")
        if failure:
            progress.console.print(f"run {scenario.name} failed: {failure}", markup=False, highlight=False, soft_wrap=True)

    if engine is None:
        run_sweep(folder, runs, runner)
        return
    engine.open()  # closed by the caller
    run_sweep(folder, runs, lambda scenario, run_dir: runner(scenario, run_dir, engine), jobs=max(1, args.jobs))


def cmd_deploy(args) -> int:
    import os
    import shlex
    import subprocess

    from fedsim.deploy import commands as deploy

    preload = deploy.PRELOAD if args.preload is None else tuple(m for m in args.preload.split(",") if m)
    if args.role == "executor":  # before anything else is imported: the executor forks ClientApps
        runtime_api = args.runtime_api or f"127.0.0.1:{deploy.node_port(args.partition, args.node_port)}"
        if args.dry_run:
            print(shlex.join(deploy.executor_cmd(runtime_api, args.runtime_root_cert, args.poll_interval, preload)))
            return 0
        from fedsim.deploy.executor import serve_clientapps

        return serve_clientapps(runtime_api, args.runtime_root_cert, args.poll_interval, preload)

    from fedsim.scenario import ScenarioError

    certs = None if args.insecure else args.certs
    if certs is None and not args.insecure:
        raise ScenarioError("fedsim deploy", [("--certs", "TLS needs a certificate folder (scripts/generate_certs.sh), or pass --insecure for loopback tests", None)])
    tls = None if certs is None else deploy.Tls(certs / "ca.crt", certs / "server.pem", certs / "server.key")
    if args.health is not None and args.role not in ("superlink", "supernode"):
        raise ScenarioError("fedsim deploy", [("--health", "Flower's health service belongs to a superlink or supernode", args.role)])
    cmds, connection = [], None
    if args.role == "superlink":
        cmds.append(deploy.superlink_cmd(args.host, args.port, tls, auth=not args.no_auth, database=args.database,
                                         health_address=args.health))
    elif args.role == "supernode":
        key = args.auth_key if args.auth_key is not None else (None if certs is None else certs / f"node{args.partition}_key")
        cmds.append(deploy.supernode_cmd(args.partition, args.num_partitions, args.superlink, args.node_port,
                                         None if tls is None else tls.ca_cert, key, args.data_dir, isolation=args.isolation,
                                         state_dir=args.state_dir, health_address=args.health, local_data=args.local_data))
        if args.isolation == "process" and args.executor == "fork":
            from fedsim.flower import compat as flower_compat

            missing = flower_compat.PROBES["forking-executor"].missing()
            if missing:
                raise ScenarioError("fedsim deploy", [("--executor", "fedsim's forking executor needs Flower internals this "
                                                      "flwr lacks; use --executor flower", ", ".join(missing))])
        if args.isolation == "process":  # the SuperNode starts no executor: run one beside it
            runtime_api = f"127.0.0.1:{deploy.node_port(args.partition, args.node_port)}"
            cmds.append(deploy.executor_cmd(runtime_api, poll_interval=args.poll_interval, preload=preload)
                        if args.executor == "fork" else deploy.superexec_cmd(runtime_api))
    else:
        if args.file is None and args.resume is None:
            raise ScenarioError("fedsim deploy run", [("FILE", "a scenario file inside the Flower app directory is required (or --resume DIR)", None)])
        from fedsim.deploy.run_config import deployable, read_run_config
        from fedsim.scenario import load_scenario

        try:
            resume = None if args.resume is None else deploy.resume_target(args.resume)
            if args.file is None:  # --resume DIR alone: the scenario and --set options the run folder recorded
                if args.set or args.output is not None:
                    raise deploy.DeployError("--resume DIR alone takes the scenario, --set and --output of the run it "
                                             "continues; to name them, pass FILE as well")
                app_dir = deploy.find_app_dir(args.app, resume=True)
                scenario_name, sets = read_run_config(args.resume)
                cmds.append(deploy.run_cmd("fedsim", scenario_name, sets, None, app_dir=app_dir, resume_dir=resume,
                                           in_app=True))
                scenario_file, sets_given = app_dir / scenario_name, sets
            else:
                scenario_file, sets_given = args.file, args.set
            try:  # a scenario on the federation clock is refused here, before any process starts
                scenario = load_scenario(scenario_file, sets_given)
            except (OSError, ScenarioError):
                scenario = None  # read where it runs, which reports what is wrong with it, as before
            if scenario is not None:
                deployable(scenario, str(scenario_file))
                if resume is not None:
                    deploy.resumable(scenario)
            if args.file is not None:  # the app is the current directory's (or --app's); the scenario travels inside its FAB
                app_dir = deploy.find_app_dir(args.app, resume=resume is not None)
                cmds.append(deploy.run_cmd("fedsim", args.file, args.set, args.output, app_dir=app_dir, resume_dir=resume))
        except deploy.DeployError as err:
            err_console.print(f"error: {err}", markup=False, highlight=False, soft_wrap=True)
            return 2
        connection = deploy.connection_entry("fedsim", args.superlink, None if tls is None else tls.ca_cert)
    env = deploy.deploy_env()
    if connection is not None:
        home = Path(os.environ.get("FLWR_HOME", Path.home() / ".flwr"))
        if args.dry_run:  # a dry run writes nothing: it shows the entry `flwr run` will need
            print(f"# would add to {home / 'config.toml'}:")
            print("\n".join(f"#   {line}" for line in connection.splitlines()))
        else:
            deploy.write_connection(home, "fedsim", args.superlink, None if tls is None else tls.ca_cert)
    print(f"export {deploy.POLL_ENV}={env[deploy.POLL_ENV]}")
    for cmd in cmds:
        print(shlex.join(cmd))
    if args.dry_run:
        return 0
    if len(cmds) > 1:
        return deploy.supervise(cmds, env)
    if args.role == "run":
        return deploy.run_and_check(cmds[0], "fedsim", env)
    return subprocess.call(cmds[0], env=env)


def cmd_report(args) -> int:
    from fedsim.runs.report import find_runs, markdown_table, run_labels, write_report

    try:
        path = write_report(args.dirs, args.out)
    except ValueError as err:  # several folders on unrelated trees and no --out
        err_console.print(f"error: {err}", markup=False, highlight=False, soft_wrap=True)
        return 2
    runs = find_runs(args.dirs)
    print(markdown_table(runs, run_labels(runs, args.dirs)))
    console.print(f"report: {path}")
    if args.html:
        from fedsim.runs.report_html import write_html

        console.print(f"page: {write_html(args.dirs, path.parent)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fedsim", description="Federated learning under attack, on Flower.")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run a scenario on Ray-simulated clients")
    run.add_argument("file", type=Path, nargs="?", default=None)
    run.add_argument("--resume", type=Path, default=None, metavar="DIR", help="continue a run folder after its last completed round")
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override, e.g. federation.rounds=5")
    run.add_argument("--output", type=Path, default=None, help="parent folder of the run folder (default: output.dir)")
    run.add_argument("--verbose", action="store_true", help="show Flower and Ray logs")
    run.set_defaults(func=cmd_run)

    val = sub.add_parser("validate", help="check a scenario and print it with every default resolved")
    val.add_argument("file", type=Path)
    val.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    val.set_defaults(func=cmd_validate)

    swp = sub.add_parser("sweep", help="run every combination of a scenario's `sweep:` grid, skipping finished runs")
    swp.add_argument("file", type=Path)
    swp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    swp.add_argument("--only", action="append", default=[], metavar="AXIS=LABEL[,LABEL...]",
                     help="run a slice of the grid: only these values of a swept key (case labels, or values as run "
                          "names write them); the runs keep the full grid's folders, so the whole grid skips them later")
    swp.add_argument("--output", type=Path, default=None, help="parent folder (default: output.dir)")
    swp.add_argument("--jobs", type=int, default=2,
                     help="runs in flight at once, sharing the sweep's one Ray engine and its client actors (default 2)")
    swp.add_argument("--verbose", action="store_true")
    swp.set_defaults(func=cmd_sweep)

    dep = sub.add_parser("deploy", help="run the same apps on a real SuperLink and SuperNodes")
    dep.add_argument("role", choices=["superlink", "supernode", "run", "executor"],
                     help="executor: fedsim's forking ClientApp executor for a `--isolation process` SuperNode")
    dep.add_argument("file", type=Path, nargs="?", default=None,
                     help="run: the scenario, a file inside the app directory (see --app)")
    dep.add_argument("--insecure", action="store_true", help="no TLS, no node authentication: loopback tests only")
    dep.add_argument("--certs", type=Path, default=None, help="folder from scripts/generate_certs.sh")
    dep.add_argument("--host", default="127.0.0.1", help="SuperLink bind address (0.0.0.0 for other machines)")
    dep.add_argument("--port", type=int, default=8000, help="SuperLink port (Fleet, Control and Runtime APIs)")
    dep.add_argument("--no-auth", action="store_true", help="TLS without SuperNode authentication")
    dep.add_argument("--superlink", default="127.0.0.1:8000", help="SuperLink address, for supernode and run")
    dep.add_argument("--partition", type=int, default=0)
    dep.add_argument("--num-partitions", type=int, default=1)
    dep.add_argument("--node-port", type=int, default=None, help="this SuperNode's local port (default 9094 + partition)")
    dep.add_argument("--auth-key", type=Path, default=None, help="this SuperNode's private key (default certs/node<i>_key)")
    dep.add_argument("--data-dir", type=Path, default=None, help="this device's data folder")
    dep.add_argument("--local-data", type=Path, default=None,
                     help="supernode: this device's own training set (image folder, .npz/.npy, CSV) instead of its partition")
    dep.add_argument("--state-dir", type=Path, default=None,
                     help="supernode: folder for the ClientApp's memory between rounds (error feedback), kept across restarts")
    dep.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    dep.add_argument("--output", default=None,
                     help="run: parent of the run folder, a path on the ServerApp's machine (relative: to where its SuperLink started)")
    dep.add_argument("--isolation", choices=["subprocess", "process"], default="subprocess",
                     help="supernode: `process` runs the ClientApp executor beside the SuperNode (see --executor)")
    dep.add_argument("--executor", choices=["fork", "flower"], default="fork",
                     help="with --isolation process: fedsim's executor that forks warm ClientApp processes (fork), "
                          "or Flower's flower-superexec, a fresh flwr-clientapp per message (flower)")
    dep.add_argument("--poll-interval", type=float, default=0.2, help="fork executor: seconds between task polls when idle")
    dep.add_argument("--preload", default=None, help="fork executor: modules imported once, comma-separated "
                                                     "(default torch,numpy,pydantic,yaml)")
    dep.add_argument("--runtime-api", default=None, help="executor: the SuperNode's Runtime API (default 127.0.0.1:<node port>)")
    dep.add_argument("--runtime-root-cert", type=Path, default=None, help="executor: CA of a TLS Runtime API (SuperNode --ssl-*)")
    dep.add_argument("--app", type=Path, default=None,
                     help="run: the Flower app directory `flwr run` builds and ships, with the scenario inside it "
                          "(default: the current directory; it needs a pyproject.toml with [tool.flwr.app])")
    dep.add_argument("--health", default=None, metavar="ADDR",
                     help="superlink, supernode: start Flower's gRPC health service on ADDR (host:port, no TLS)")
    dep.add_argument("--database", type=Path, default=None, metavar="FILE",
                     help="superlink: keep the SuperLink's state (nodes, runs) in this SQLite file, so a restarted "
                          "SuperLink knows its SuperNodes (default: in memory)")
    dep.add_argument("--resume", default=None, metavar="DIR",
                     help="run: continue a deployed run's folder (a path on the ServerApp's machine) after its last "
                          "checkpointed round; alone, it reads the scenario and --set options the folder recorded")
    dep.add_argument("--dry-run", action="store_true", help="print the Flower commands and stop; writes nothing")
    dep.set_defaults(func=cmd_deploy)

    rep = sub.add_parser("report", help="markdown table and plots from run folders")
    rep.add_argument("dirs", type=Path, nargs="+", help="run folders, or folders holding run folders")
    rep.add_argument("--out", type=Path, default=None,
                     help="where report.md and the PNGs go (default: report/ inside the folder reported on, "
                          "or inside the folders' common parent)")
    rep.add_argument("--html", action="store_true",
                     help="also write report.html: one self-contained page with the sortable tables, the curves per "
                          "defense, each defense's worst case over attacks, its detection audit and cost")
    rep.set_defaults(func=cmd_report)

    lst = sub.add_parser("list", help="list registered components and their parameters")
    lst.add_argument("kind", nargs="?", default=None,
                     help="aggregators, attacks, defenses, compressors, datasets, models, partitioners, protocols, "
                          "tracking_sinks, privacy_attacks, schedules, edge_sets, lowrank or scenarios (singular works too); default: all")
    lst.add_argument("--where", action="store_true", help="add a column: the file(s) each component's code is in")
    lst.add_argument("--markdown", action="store_true", help="print the README's component table")
    lst.add_argument("--write-readme", type=Path, default=None, metavar="README",
                     help="rewrite the component table and the ready-scenario list in README")
    lst.set_defaults(func=cmd_list)
    return parser


def main(argv: list[str] | None = None) -> int:
    from fedsim.data.base import DataFileError
    from fedsim.scenario import ScenarioError

    args = build_parser().parse_args(argv)
    try:
        # `args.later`: what a command leaves to close once its outcome is printed (Ray's shutdown)
        with contextlib.ExitStack() as args.later:
            try:
                return args.func(args)
            except ScenarioError as err:
                err_console.print(str(err), markup=False, highlight=False, soft_wrap=True)
                return 2
            except DataFileError as err:
                err_console.print(f"data error: {err}", markup=False, highlight=False, soft_wrap=True)
                return 2
            except FileNotFoundError as err:
                err_console.print(f"error: {err}", markup=False, highlight=False, soft_wrap=True)
                return 2
            except KeyboardInterrupt:  # outside a run (fedsim.engine.interrupt handles signals inside one)
                err_console.print("interrupted")
                return 130
    except KeyboardInterrupt:  # again, while Ray shuts down
        return 130


if __name__ == "__main__":
    sys.exit(main())
