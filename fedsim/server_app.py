"""The ServerApp: run the scenario's strategy and write the run folder round by round."""

from __future__ import annotations

from pathlib import Path

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fedsim.results import append_round, new_run_dir, read_rounds, summarize, write_summary
from fedsim.runtime import runtime_for
from fedsim.strategy import ScenarioStrategy
from fedsim.wire import pack_model


def run_server(grid: Grid, scenario, run_dir: Path, progress=None) -> dict:
    """Drive all rounds on `grid`; returns the summary (also written to `run_dir/summary.json`)."""
    rt = runtime_for(scenario)
    fed = scenario.federation

    def on_round(record: dict) -> None:
        append_round(run_dir, record)
        if progress is not None:
            progress(record)

    strategy = ScenarioStrategy(rt, on_round=on_round)
    strategy.discover_nodes(grid, timeout=fed.round_timeout)
    strategy.start(
        grid=grid,
        initial_arrays=pack_model(strategy.global_vec, rt.layout),
        num_rounds=fed.rounds,
        timeout=fed.round_timeout,
        evaluate_fn=strategy.end_round,
    )
    extra = {"attackers": rt.attackers, "run_dir": str(run_dir)}
    if rt.attack is not None:
        extra["attack"] = rt.attack.report(rt)
    summary = summarize(scenario, read_rounds(run_dir), extra)
    write_summary(run_dir, summary)
    return summary


def make_server_app(scenario=None, run_dir: Path | None = None, progress=None) -> ServerApp:
    """A ServerApp for `scenario` (simulation), or reading it from the run config (deployment)."""
    from fedsim.deploy_config import scenario_from_context

    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        scen = scenario if scenario is not None else scenario_from_context(context)
        run_server(grid, scen, run_dir if run_dir is not None else new_run_dir(scen), progress)

    return app
