"""Reports drawn from run folders on disk only (rounds.jsonl, summary.json), never from memory,
so any report can be redrawn later: a markdown table and matplotlib plots."""

from __future__ import annotations

import json
from pathlib import Path

from fedsim.results import read_rounds


def find_runs(paths: list[Path]) -> list[Path]:
    """Run folders among `paths` (a run folder itself, or a folder of run folders), sorted by name."""
    runs: list[Path] = []
    for path in paths:
        path = Path(path)
        if (path / "rounds.jsonl").exists():
            runs.append(path)
        else:
            runs += sorted(p.parent for p in path.glob("*/rounds.jsonl"))
    return sorted(set(runs), key=lambda p: p.name)


def run_label(run: Path) -> str:
    summary = run / "summary.json"
    if summary.exists():
        return json.loads(summary.read_text())["name"]
    return run.name


def swept_values(run: Path) -> dict:
    """The swept keys and values of a run that belongs to a sweep (empty otherwise)."""
    path = run / "sweep.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _short(value) -> str:
    if isinstance(value, dict):
        return value.get("name", json.dumps(value))
    if isinstance(value, list):
        return "+".join(_short(v) for v in value) or "none"
    return str(value)


def run_row(run: Path) -> dict:
    rounds = read_rounds(run)
    acc = [r["main_accuracy"] for r in rounds if r.get("main_accuracy") is not None]
    bd = [r["backdoor_success"] for r in rounds if r.get("backdoor_success") is not None]
    return {
        "run": run_label(run),
        "rounds": len(rounds),
        "final_acc": acc[-1] if acc else None,
        "best_acc": max(acc) if acc else None,
        "final_backdoor": bd[-1] if bd else None,
        "peak_backdoor": max(bd) if bd else None,
        "mean_backdoor": sum(bd) / len(bd) if bd else None,
        "mb_up": sum(r.get("bytes_up", 0) for r in rounds) / 1e6,
        "seconds": sum(r.get("wall_seconds", 0.0) for r in rounds),
    }


def _pct(v) -> str:
    return "-" if v is None else f"{100 * v:.1f}"


def markdown_table(runs: list[Path]) -> str:
    """One row per run; runs of a sweep get a column per swept key."""
    keys = sorted({k for run in runs for k in swept_values(run)})
    lines = [
        "| run | " + "".join(f"{k} | " for k in keys)
        + "rounds | final acc % | best acc % | final backdoor % | peak backdoor % | mean backdoor % | MB up | s |",
        "|---|" + "---|" * len(keys) + "---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for run in runs:
        r, swept = run_row(run), swept_values(run)
        lines.append(
            f"| {r['run']} | " + "".join(f"{_short(swept.get(k, '-'))} | " for k in keys)
            + f"{r['rounds']} | {_pct(r['final_acc'])} | {_pct(r['best_acc'])} | {_pct(r['final_backdoor'])} "
            f"| {_pct(r['peak_backdoor'])} | {_pct(r['mean_backdoor'])} | {r['mb_up']:.1f} | {r['seconds']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def plot_heatmap(runs: list[Path], out: Path, metric: str = "peak_backdoor") -> Path | None:
    """`metric` over the first two swept keys (averaged over the others, e.g. seeds)."""
    keys = sorted({k for run in runs for k in swept_values(run)})
    if len(keys) < 2:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    kx, ky = keys[0], keys[1]
    cells: dict[tuple[str, str], list[float]] = {}
    for run in runs:
        sw, value = swept_values(run), run_row(run)[metric]
        if value is not None:
            cells.setdefault((_short(sw.get(ky)), _short(sw.get(kx))), []).append(value)
    rows = sorted({r for r, _ in cells})
    cols = sorted({c for _, c in cells})
    grid = np.full((len(rows), len(cols)), np.nan)
    for (r, c), vals in cells.items():
        grid[rows.index(r), cols.index(c)] = float(np.mean(vals))
    fig, ax = plt.subplots(figsize=(1.6 + 1.4 * len(cols), 1.2 + 0.6 * len(rows)))
    im = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis")
    ax.set_xticks(range(len(cols)), cols, rotation=30, ha="right")
    ax.set_yticks(range(len(rows)), rows)
    ax.set(xlabel=kx, ylabel=ky, title=metric.replace("_", " "))
    for i in range(len(rows)):
        for j in range(len(cols)):
            if not np.isnan(grid[i, j]):
                ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", color="w" if grid[i, j] < 0.6 else "k")
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    path = out / f"heatmap_{metric}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_curves(runs: list[Path], out: Path) -> list[Path]:
    """Main accuracy and backdoor success per round, one line per run; attack rounds marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    all_rounds = {run: read_rounds(run) for run in runs}
    targeted = any(r.get("backdoor_success") is not None for rs in all_rounds.values() for r in rs)
    fig, axes = plt.subplots(1, 2 if targeted else 1, figsize=(12 if targeted else 7, 4.2), squeeze=False)
    ax_acc = axes[0][0]
    for run, rounds in all_rounds.items():
        xs = [r["round"] for r in rounds]
        label = run_label(run)
        ax_acc.plot(xs, [r.get("main_accuracy") for r in rounds], label=label)
        if targeted:
            line, = axes[0][1].plot(xs, [r.get("backdoor_success") for r in rounds], label=label)
            hits = [r for r in rounds if r.get("attackers") and r.get("backdoor_success") is not None]
            axes[0][1].plot([r["round"] for r in hits], [r["backdoor_success"] for r in hits], "o",
                            color=line.get_color(), markersize=3)
    ax_acc.set(xlabel="round", ylabel="main-task accuracy", title="main task")
    if targeted:
        axes[0][1].set(xlabel="round", ylabel="backdoor success rate", title="backdoor (dots: attack rounds)", ylim=(-0.02, 1.02))
        axes[0][1].legend(fontsize=7, loc="best")
    else:
        ax_acc.legend(fontsize=7, loc="best")
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    path = out / "curves.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def plot_bytes_vs_accuracy(runs: list[Path], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.2))
    for run in runs:
        rows = run_row(run)
        ax.scatter(rows["mb_up"], rows["final_acc"], label=rows["run"])
    ax.set(xlabel="MB uploaded (total)", ylabel="final main accuracy")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = out / "bytes_vs_accuracy.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(paths: list[Path], out: Path) -> Path:
    """`report.md` with the table and the plots, from the run folders under `paths`."""
    runs = find_runs(paths)
    if not runs:
        raise FileNotFoundError(f"no run folders (with rounds.jsonl) under {', '.join(map(str, paths))}")
    out.mkdir(parents=True, exist_ok=True)
    plots = plot_curves(runs, out) + [plot_bytes_vs_accuracy(runs, out)]
    heat = plot_heatmap(runs, out)
    if heat is not None:
        plots.append(heat)
    text = "# fedsim report\n\n" + markdown_table(runs) + "\n" + "".join(f"![{p.stem}]({p.name})\n" for p in plots)
    (out / "report.md").write_text(text)
    return out / "report.md"
