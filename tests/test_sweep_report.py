"""Sweeps expand, validate, skip finished runs and resume killed ones; reports come from the files."""

from __future__ import annotations

import json

import pytest

from conftest import run_local
from fedsim.server.record import without_times
from fedsim.runs.report import find_runs, markdown_table, write_report
from fedsim.runs.folder import RunFolder
from fedsim.runs.results import read_rounds
from fedsim.scenario import ScenarioError
from fedsim.runs.sweep import expand, run_sweep, sweep_dir

SWEEP = """
base: {quickstart}
name: tiny
federation: {{num_clients: 6, clients_per_round: 3, rounds: 3}}
attack: {{schedule: {{name: every_round}}, num_edge: 20, num_clean: 20}}
sweep:
  attack.mode: [blackbox, pgd]
  defenses: [[], [{{name: norm_clipping, delta: 1.0}}]]
"""


@pytest.fixture
def sweep_file(tmp_path):
    from pathlib import Path

    path = tmp_path / "sweep.yaml"
    path.write_text(SWEEP.format(quickstart=Path("scenarios/quickstart.yaml").resolve()))
    return path


def local_runner(kill=None):
    def runner(scenario, run_dir):
        def progress(record):
            if kill is not None and kill(scenario, record):
                raise KeyboardInterrupt
        run_local(scenario, RunFolder(run_dir), progress=progress, checkpoints=True, client_states=True)
    return runner


def test_expand_grid_names_and_base_merge(sweep_file):
    name, runs = expand(sweep_file)
    assert name == "tiny" and len(runs) == 4
    assert {r.name for r in runs} == {
        "mode_blackbox__defenses_none", "mode_blackbox__defenses_norm_clipping-delta1.0",
        "mode_pgd__defenses_none", "mode_pgd__defenses_norm_clipping-delta1.0",
    }
    run = next(r for r in runs if r.name == "mode_pgd__defenses_norm_clipping-delta1.0")
    assert run.scenario.attack.mode == "pgd" and run.scenario.defenses[0].delta == 1.0
    assert run.scenario.federation.rounds == 3 and run.scenario.model.name == "mlp"  # merged over the base


def test_every_bad_combination_is_reported_before_running(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("sweep:\n  aggregator: [fedavg, nope]\n  federation.rounds: [0, 2]\n")
    with pytest.raises(ScenarioError) as info:
        expand(path)
    text = str(info.value)
    assert "aggregator=nope" in text and "rounds=0" in text


def test_killed_sweep_resumes_without_redoing_finished_runs(sweep_file, tmp_path):
    name, runs = expand(sweep_file)
    folder = sweep_dir(name, runs, tmp_path / "out")
    third = runs[2].name
    with pytest.raises(KeyboardInterrupt):  # dies in round 2 of the third run
        run_sweep(folder, runs, local_runner(kill=lambda s, r: s.name == third and r["round"] == 2))
    finished = {p.name for p in folder.iterdir() if (p / "summary.json").exists()}
    assert finished == {runs[0].name, runs[1].name}
    stamps = {n: (folder / n / "summary.json").stat().st_mtime_ns for n in finished}
    assert [r["round"] for r in read_rounds(folder / third)] == [1, 2]

    run_sweep(folder, runs, local_runner())
    assert all((folder / r.name / "summary.json").exists() for r in runs)
    assert all((folder / n / "summary.json").stat().st_mtime_ns == t for n, t in stamps.items())  # not rerun
    # the resumed run equals an uninterrupted run of the same scenario
    fresh = tmp_path / "fresh" / third
    local_runner()(runs[2].scenario, fresh)
    assert without_times(read_rounds(folder / third)) == without_times(read_rounds(fresh))


def test_report_table_and_plots_from_files(sweep_file, tmp_path):
    name, runs = expand(sweep_file)
    folder = sweep_dir(name, runs, tmp_path / "out")
    run_sweep(folder, runs, local_runner())
    report = write_report([folder], tmp_path / "report")
    text = report.read_text()
    for run in runs:
        summary = json.loads((folder / run.name / "summary.json").read_text())
        row = next(line for line in text.splitlines() if line.startswith(f"| {run.name} |"))
        assert f"{100 * summary['final_main_accuracy']:.1f}" in row
        assert f"{100 * summary['peak_backdoor_success']:.1f}" in row
    assert "| attack.mode | defenses |" in markdown_table(find_runs([folder])).splitlines()[0].replace("| run ", "")
    for png in ("curves.png", "bytes_vs_accuracy.png", "heatmap_peak_backdoor.png"):
        assert (tmp_path / "report" / png).stat().st_size > 1000
