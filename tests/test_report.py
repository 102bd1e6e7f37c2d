"""`fedsim report` on a results folder as users have them (#16 item 5): runs at any depth, distinct
labels, the legend outside the plots, a heatmap that fills its canvas with a labelled colour bar,
and the report written inside the folder reported on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedsim.cli import main
from fedsim.runs.report import bytes_figure, curves_figure, default_out, find_runs, heatmap_figure, legend_below, run_labels


def fake_run(folder: Path, name: str, swept: dict | None = None, rounds: int = 5) -> Path:
    folder.mkdir(parents=True)
    lines = [{"round": r, "main_accuracy": 0.5 + 0.08 * r, "backdoor_success": 0.1 * r, "bytes_up": 1000,
              "wall_seconds": 0.1, "attackers": [1] if r % 2 else []} for r in range(1, rounds + 1)]
    (folder / "rounds.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (folder / "summary.json").write_text(json.dumps({"name": name}))
    if swept is not None:
        (folder / "sweep.json").write_text(json.dumps(swept))
    return folder


def results(tmp_path: Path) -> Path:
    root = tmp_path / "results"
    fake_run(root / "quickstart-20261124-101010", "quickstart")
    fake_run(root / "quickstart-20261124-121212", "quickstart")
    for mode in ("blackbox", "pgd"):
        for clip in ("none", "clip"):
            fake_run(root / "grid" / f"mode={mode}__defenses={clip}", f"mode={mode}__defenses={clip}",
                     {"attack.mode": mode, "defenses": clip})
    return root


def test_runs_at_any_depth_with_distinct_labels(tmp_path):
    root = results(tmp_path)
    runs = find_runs([root])
    assert len(runs) == 6  # the sweep's runs one level deeper are found too
    labels = run_labels(runs, [root])
    assert len(set(labels.values())) == 6
    assert labels[root / "grid" / "mode=pgd__defenses=clip"] == "grid/mode=pgd__defenses=clip"
    assert labels[root / "quickstart-20261124-101010"] == "quickstart-20261124-101010"


def test_report_goes_inside_the_reported_folder(tmp_path, monkeypatch, capsys):
    root = results(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert main(["report", str(root)]) == 0
    assert (root / "report" / "report.md").exists() and not (tmp_path / "report").exists()
    table = (root / "report" / "report.md").read_text()
    assert "grid/mode=blackbox__defenses=none" in table and table.count("quickstart-2026") == 2
    assert (root / "report" / "curves.png").exists() and (root / "report" / "heatmap_peak_backdoor.png").exists()


def test_several_folders_report_into_their_common_parent_never_the_root(tmp_path):
    assert default_out([tmp_path / "results" / "a", tmp_path / "results" / "b"]) == (tmp_path / "results" / "report").resolve()
    assert default_out([Path("/srv/results/a"), Path("/home/me/results/b")]) is None  # not /report: --out is needed


def test_legend_is_outside_every_plot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    lines = [axes[0].plot(range(10), [i] * 10)[0] for i in range(12)]
    legend_below(fig, axes, lines, [f"run {i} with a long label" for i in range(12)])
    fig.canvas.draw()
    box = fig.legends[0].get_window_extent()
    assert all(not box.overlaps(ax.get_window_extent()) for ax in axes)
    plt.close(fig)


def test_heatmap_fills_its_canvas_and_labels_its_colour_bar(tmp_path):
    root = results(tmp_path)
    fig = heatmap_figure(find_runs([root / "grid"]))
    fig.canvas.draw()
    cells, bar = fig.axes
    assert bar.get_ylabel() == "peak backdoor"
    w, h = fig.get_size_inches() * fig.dpi
    extent = cells.get_window_extent()
    assert extent.width * extent.height / (w * h) > 0.35


def test_heatmap_of_a_results_folder_leaves_out_runs_outside_the_sweep(tmp_path):
    root = results(tmp_path)  # two plain quickstart runs beside the sweep: no "None" row or column
    fig = heatmap_figure(find_runs([root]))
    cells = fig.axes[0]
    assert [t.get_text() for t in cells.get_xticklabels()] == ["blackbox", "pgd"]
    assert [t.get_text() for t in cells.get_yticklabels()] == ["clip", "none"]


def look(handle) -> tuple:
    """What tells a legend entry apart: a line's colour and dashes, a scatter's colour and marker."""
    if hasattr(handle, "get_xdata"):
        return str(handle.get_color()), str(handle.get_linestyle())
    return str(handle.get_facecolor().tolist()), str(handle.get_paths()[0].vertices.round(3).tolist())


def test_report_figures_keep_long_legends_whole_and_runs_apart(tmp_path):
    """A results folder's labels are long paths: the legend stays inside the canvas, below the
    plots, and run 11 does not look like run 1 (matplotlib has 10 colours)."""
    import matplotlib.pyplot as plt

    root = tmp_path / "results"
    for i in range(14):
        fake_run(root / "tails_modes_x_defenses-20261124-101010" / f"attack.mode=pgd_replacement__defenses=run{i:02d}",
                 "x", {"attack.mode": "pgd_replacement", "defenses": f"run{i:02d}"})
    runs = find_runs([root])
    for fig in (curves_figure(runs, run_labels(runs, [root])), bytes_figure(runs, run_labels(runs, [root]))):
        fig.canvas.draw()
        box, canvas = fig.legends[0].get_window_extent(), fig.bbox
        assert box.x0 >= canvas.x0 and box.x1 <= canvas.x1 and box.y0 >= canvas.y0, (box, canvas)
        assert all(not box.overlaps(ax.get_window_extent()) for ax in fig.axes)
        looks = {look(h) for h in fig.legends[0].legend_handles}
        assert len(looks) == 14
        plt.close(fig)


def seeded_run(folder: Path, seed: int, mode: str, final: float, lifecycle: dict | None = None) -> Path:
    """A run of a sweep over `seed` and `attack.mode` whose final accuracy is `final`."""
    folder.mkdir(parents=True)
    lines = [{"round": r, "main_accuracy": final - 0.1 * (3 - r), "backdoor_success": 0.2 * r, "bytes_up": 10,
              "wall_seconds": 0.1, "attackers": []} for r in (1, 2, 3)]
    (folder / "rounds.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (folder / "summary.json").write_text(json.dumps({"name": folder.name, "backdoor_lifecycle": lifecycle}))
    (folder / "sweep.json").write_text(json.dumps({"seed": seed, "attack.mode": mode}))
    return folder


def test_runs_differing_only_in_seed_are_one_row_with_mean_std_and_interval(tmp_path):
    from statistics import mean, stdev

    from fedsim.runs.report import seeds_table, write_report
    from fedsim.runs.seeds import Spread

    finals = {"pgd": [0.90, 0.92, 0.97], "blackbox": [0.80, 0.84]}
    for mode, values in finals.items():
        for seed, v in enumerate(values):
            seeded_run(tmp_path / "sw" / f"seed={seed}__mode={mode}", seed, mode, v)
    spread = Spread.of(finals["pgd"])
    half = 4.302652729911275 * stdev(finals["pgd"]) / 3 ** 0.5  # t(0.975, 2 degrees of freedom), from tables
    assert spread.mean == pytest.approx(mean(finals["pgd"])) and spread.std == pytest.approx(stdev(finals["pgd"]))
    assert (spread.low, spread.high) == pytest.approx((spread.mean - half, spread.mean + half))
    assert Spread.of(finals["blackbox"]).low is None  # two seeds: no interval
    table = seeds_table(find_runs([tmp_path / "sw"]))
    pgd_row = next(line for line in table.splitlines() if line.startswith("| pgd |"))
    assert f"| 3 | {spread.percent()} |" in pgd_row and "[" in pgd_row
    bb_row = next(line for line in table.splitlines() if line.startswith("| blackbox |"))
    assert "| 2 | 82.0 ± 2.8 |" in bb_row
    report = write_report([tmp_path / "sw"])
    assert "## Over seeds" in report.read_text() and (report.parent / "curves_over_seeds.png").exists()


def test_without_a_seed_axis_there_is_no_seed_table_and_lifecycle_columns_follow_the_summary(tmp_path):
    from fedsim.runs.report import markdown_table, seeds_table

    root = results(tmp_path)
    assert seeds_table(find_runs([root])) is None
    assert "lifespan" not in markdown_table(find_runs([root]))
    lc = {"rounds_to_implant": 2, "lifespan": None, "half_life": None, "auc_after_attack": 0.75, "rounds_after": 15}
    run = seeded_run(tmp_path / "bd", 1, "pgd", 0.9, lc)
    header, _, row = markdown_table([run]).splitlines()
    assert row.endswith("| 2 | ≥ 15 | - | 75.0 |")
    assert header.endswith("| s | rounds to implant | lifespan | half-life | backdoor AUC after attack % |")


def test_a_table_renders_as_markdown_with_its_pipes_escaped_and_numbers_right_aligned():
    """report.md and report.html share one Table of cell texts; this is its markdown."""
    from fedsim.runs.report import Table, markdown

    table = Table(["run", "final acc %", "lifespan"], [False, True, True], [["a|b", "93.1", "≥ 4"], ["c", "-", "2"]])
    assert markdown(table) == "| run | final acc % | lifespan |\n|---|---:|---:|\n| a\\|b | 93.1 | ≥ 4 |\n| c | - | 2 |\n"
    assert markdown(table, trailing_space=True).splitlines()[2] == "| a\\|b | 93.1 | ≥ 4 | "
