"""`fedsim report` on a results folder as users have them (#16 item 5): runs at any depth, distinct
labels, the legend outside the plots, a heatmap that fills its canvas with a labelled colour bar,
and the report written inside the folder reported on."""

from __future__ import annotations

import json
from pathlib import Path

from fedsim.cli import main
from fedsim.runs.report import find_runs, heatmap_figure, legend_below, run_labels


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
