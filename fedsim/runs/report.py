"""Reports drawn from run folders on disk only (rounds.jsonl, summary.json), never from memory,
so any report can be redrawn later: a markdown table and matplotlib plots."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from fedsim.runs.results import central_privacy, read_rounds
from fedsim.runs.seeds import Spread, seed_groups, without_seed
from fedsim.runs.detection import run_detection


def find_runs(paths: list[Path]) -> list[Path]:
    """Run folders (those holding rounds.jsonl) at or anywhere below `paths`: a run folder, a
    results folder, a sweep, a folder of sweeps. Sorted by path, so a report is stable."""
    runs: set[Path] = set()
    for path in map(Path, paths):
        if (path / "rounds.jsonl").exists():
            runs.add(path)
        runs.update(p.parent for p in path.rglob("rounds.jsonl"))
    return sorted(runs)


def run_labels(runs: list[Path], paths: list[Path]) -> dict[Path, str]:
    """A distinct label per run: its path below the folder it was found in (`sweep/run`), or its
    folder name when it is itself one of `paths`. Unrelated runs of one scenario name differ by
    their folders' timestamps; should two labels still clash, the full paths are used."""
    roots = [Path(p).resolve() for p in paths]
    labels = {}
    for run in runs:
        here = run.resolve()
        below = [here.relative_to(r) for r in roots if here != r and here.is_relative_to(r)]
        labels[run] = str(min(below, key=lambda p: len(p.parts))) if below else run.name
    if len(set(labels.values())) < len(labels):
        labels = {run: str(run) for run in runs}
    return labels


def run_label(run: Path) -> str:
    """The run's folder name (unique within its parent; see run_labels for a set of runs)."""
    return Path(run).name


def default_out(paths: list[Path]) -> Path | None:
    """Where a report goes without --out: `report/` inside the one folder reported on, or inside
    the folders' common parent; None when that parent is the filesystem root (give --out)."""
    import os

    if len(paths) == 1:
        return Path(paths[0]) / "report"
    common = Path(os.path.commonpath([str(Path(p).resolve()) for p in paths]))
    return None if common == Path(common.anchor) else common / "report"


def swept_values(run: Path) -> dict:
    """The swept keys and values of a run that belongs to a sweep (empty otherwise)."""
    path = run / "sweep.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _short(value) -> str:
    if isinstance(value, dict):  # a component, or a sweep's case (its label)
        return value.get("name", value.get("label", json.dumps(value)))
    if isinstance(value, list):
        return "+".join(_short(v) for v in value) or "none"
    return str(value)


def run_row(run: Path, label: str | None = None) -> dict:
    rounds = read_rounds(run)
    trained = [r for r in rounds if r["round"] > 0]  # round 0 is the initial (possibly pre-trained) model
    acc = [r["main_accuracy"] for r in trained if r.get("main_accuracy") is not None]
    bd = [r["backdoor_success"] for r in trained if r.get("backdoor_success") is not None]
    return {
        "run": label if label is not None else run_label(run),
        "rounds": len(rounds),
        "final_acc": acc[-1] if acc else None,
        "best_acc": max(acc) if acc else None,
        "final_backdoor": bd[-1] if bd else None,
        "peak_backdoor": max(bd) if bd else None,
        "mean_backdoor": sum(bd) / len(bd) if bd else None,
        "final_beyond_clean": _last(rounds, "backdoor_success_beyond_clean"),
        "final_source_acc": _last(rounds, "source_class_accuracy"),
        **rejection_columns(rounds),
        "mb_up": sum(r.get("bytes_up", 0) for r in rounds) / 1e6,
        "seconds": sum(r.get("wall_seconds", 0.0) for r in rounds),
        "pipeline_ms": _mean_ms([r["pipeline_seconds"] for r in rounds if r.get("pipeline_seconds") is not None]),
        "sim_time": _last(rounds, "sim_time"),  # on the federation clock
        "stragglers": sum(len(r.get("stragglers", [])) for r in rounds),
        **detection_columns(run_detection(rounds)),
        **lifecycle_columns(run),
        **leakage_columns(rounds),
    }


def rejection_columns(rounds: list[dict]) -> dict:
    """The last evaluated round's shares of the test and backdoor sets the deployed model refused (FLIP)."""
    last = _last(rounds, "inputs_rejected") or {}
    return {"final_rejected": last.get("main"), "final_backdoor_rejected": last.get("backdoor")}


def leakage_columns(rounds: list[dict]) -> dict:
    """With privacy attacks (fedsim/server/leakage.py): the mean PSNR of the attacked uploads and of
    the attacked aggregates, the strongest reconstruction (the highest mean PSNR of one attacked
    update, with its SSIM and label accuracy), and the last membership AUC and TPR at 1% FPR; None
    where the run has none."""
    entries = [e for r in rounds for e in (r.get("privacy_attack") or [])]
    inversions = [e for e in entries if e.get("psnr_mean") is not None]
    games = [e for e in entries if e.get("auc") is not None]
    best = max(inversions, key=lambda e: e["psnr_mean"], default=None)

    def mean_psnr(target):
        values = [e["psnr_mean"] for e in inversions if e["target"] == target]
        return sum(values) / len(values) if values else None

    local, central = _last(rounds, "local_privacy"), central_privacy(rounds)
    dp = local if local is not None else central  # the ε a scenario with DP quotes (null: no noise, ε = ∞)
    return {"leakage": bool(entries), "epsilon": None if dp is None else (dp.get("epsilon"), "local" if local else "central"),
            "leak_upload_psnr": mean_psnr("upload"), "leak_aggregate_psnr": mean_psnr("aggregate"),
            "leak_psnr": None if best is None else best["psnr_mean"],
            "leak_ssim": None if best is None else best.get("ssim_mean"),
            "leak_labels": None if best is None else best.get("label_accuracy"),
            "mia_auc": games[-1]["auc"] if games else None,
            "mia_tpr": games[-1].get("tpr_at_1pct_fpr") if games else None}


LIFECYCLE = ("rounds_to_implant", "lifespan", "half_life", "auc_after_attack")


def lifecycle_columns(run: Path) -> dict:
    """The backdoor lifecycle from the run's summary.json (fedsim/runs/lifecycle.py), when it has one."""
    path = Path(run) / "summary.json"
    try:
        lc = json.loads(path.read_text()).get("backdoor_lifecycle") if path.exists() else None
    except (json.JSONDecodeError, AttributeError):
        lc = None
    lc = lc if isinstance(lc, dict) else {}
    return {"lifecycle": bool(lc), **{k: lc.get(k) for k in LIFECYCLE}, "rounds_after": lc.get("rounds_after")}


def _last(rounds: list[dict], key: str):
    values = [r[key] for r in rounds if r.get(key) is not None and r["round"] > 0]
    return values[-1] if values else None


def _mean_ms(seconds: list[float]) -> float | None:
    return 1000 * sum(seconds) / len(seconds) if seconds else None


def detection_columns(total: dict | None) -> dict:
    """The detection audit's run totals shown beside accuracy (fedsim/runs/detection.py)."""
    total = total or {}
    return {"tpr": total.get("tpr"), "fpr": total.get("fpr"), "f1": total.get("f1"),
            "false_alarms": total.get("false_alarm_rate_without_attackers")}


def _ms(v) -> str:
    return "-" if v is None else f"{v:.1f}"


def _pct(v) -> str:
    return "-" if v is None else f"{100 * v:.1f}"


@dataclass(frozen=True)
class Table:
    """A report table as cell texts: what report.md renders as a pipe table (`markdown`) and
    report.html as a sortable one (fedsim/runs/report_html.py), so the two show the same cells.
    `numeric`: a number column (right-aligned in markdown; sorted by number on the page)."""

    headers: list[str]
    numeric: list[bool]
    rows: list[list[str]]


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|")  # a '|' in a run label or a swept value stays in its cell


def markdown(table: Table, trailing_space: bool = False) -> str:
    """The table as a pipe table: `| a | b |` lines, number columns right-aligned, '|' in a cell
    escaped. `trailing_space`: end each line with '| ' (the seeds table always has)."""
    end = " | " if trailing_space else " |"
    lines = ["| " + " | ".join(map(_md_cell, table.headers)) + end,
             "|" + "".join("---:|" if num else "---|" for num in table.numeric)]
    lines += ["| " + " | ".join(map(_md_cell, row)) + end for row in table.rows]
    return "\n".join(lines) + "\n"


def _sim(v) -> str:
    return "-" if v is None else f"{v:.4g}"


def _rounds(v) -> str:
    return "-" if v is None else str(v)


def _survived(row: dict) -> str:
    """Lifespan; '≥ k' when the backdoor was still above the threshold when the run ended k rounds later."""
    if row["lifespan"] is not None:
        return str(row["lifespan"])
    implanted_to_the_end = row["rounds_to_implant"] is not None and row["rounds_after"] and row["half_life"] is None
    return f"≥ {row['rounds_after']}" if implanted_to_the_end else "-"


def _pct_of(key: str):
    return lambda row: _pct(row[key])


RUN_COLUMNS = (  # (header, its cell's text from run_row), after the run and its swept values
    ("rounds", lambda r: str(r["rounds"])),
    ("final acc %", _pct_of("final_acc")),
    ("best acc %", _pct_of("best_acc")),
    ("final backdoor %", _pct_of("final_backdoor")),
    ("peak backdoor %", _pct_of("peak_backdoor")),
    ("mean backdoor %", _pct_of("mean_backdoor")),
    ("final backdoor beyond clean %", _pct_of("final_beyond_clean")),
    ("final source-class acc %", _pct_of("final_source_acc")),
    ("TPR %", _pct_of("tpr")),
    ("FPR %", _pct_of("fpr")),
    ("F1 %", _pct_of("f1")),
    ("false alarms, no attacker %", _pct_of("false_alarms")),
    ("defenses + rule ms/round", lambda r: _ms(r["pipeline_ms"])),
    ("MB up", lambda r: f"{r['mb_up']:.1f}"),
    ("s", lambda r: f"{r['seconds']:.0f}"),
)
LIFECYCLE_COLUMNS = (  # when a run has a backdoor lifecycle (fedsim/runs/lifecycle.py)
    ("rounds to implant", lambda r: _rounds(r["rounds_to_implant"])),
    ("lifespan", _survived),
    ("half-life", lambda r: _rounds(r["half_life"])),
    ("backdoor AUC after attack %", _pct_of("auc_after_attack")),
)
def _db(key: str):
    return lambda row: "-" if row[key] is None else f"{row[key]:.1f}"


def _epsilon(row) -> str:
    if row["epsilon"] is None:
        return "-"
    eps, kind = row["epsilon"]
    return f"∞ ({kind})" if eps is None else f"{eps:.3g} ({kind})"


LEAKAGE_COLUMNS = (  # when a run has privacy attacks
    ("ε", _epsilon),
    ("uploads PSNR dB", _db("leak_upload_psnr")),
    ("aggregate PSNR dB", _db("leak_aggregate_psnr")),
    ("best PSNR dB", _db("leak_psnr")),
    ("its SSIM", lambda r: "-" if r["leak_ssim"] is None else f"{r['leak_ssim']:.3f}"),
    ("its labels %", _pct_of("leak_labels")),
    ("MIA AUC", lambda r: "-" if r["mia_auc"] is None else f"{r['mia_auc']:.3f}"),
    ("MIA TPR@1%FPR %", _pct_of("mia_tpr")),
)
REJECTION_COLUMNS = (  # when a run's deployed model refuses low-confidence inputs (FLIP)
    ("final inputs rejected %", _pct_of("final_rejected")),
    ("final backdoor inputs rejected %", _pct_of("final_backdoor_rejected")),
)
CLOCK_COLUMNS = (  # when a run ran on the federation clock
    ("simulated s", lambda r: _sim(r["sim_time"])),
    ("stragglers", lambda r: str(r["stragglers"])),
)


def runs_table(runs: list[Path], labels: dict[Path, str] | None = None) -> Table:
    """One row per run; runs of a sweep get a column per swept key; the backdoor lifecycle's
    columns when a run has one, the rejection shares when a run's model refuses inputs, the federation clock's when a run ran on it, the leakage columns
    when a run has privacy attacks."""
    labels = labels or {}
    keys = sorted({k for run in runs for k in swept_values(run)})
    rows = {run: run_row(run, labels.get(run)) for run in runs}
    columns = (RUN_COLUMNS + (LIFECYCLE_COLUMNS if any(r["lifecycle"] for r in rows.values()) else ())
               + (REJECTION_COLUMNS if any(r["final_rejected"] is not None for r in rows.values()) else ())
               + (CLOCK_COLUMNS if any(r["sim_time"] is not None for r in rows.values()) else ())
               + (LEAKAGE_COLUMNS if any(r["leakage"] for r in rows.values()) else ()))
    cells = []
    for run in runs:
        r, swept = rows[run], swept_values(run)
        cells.append([r["run"], *(_short(swept.get(k, "-")) for k in keys), *(cell(r) for _, cell in columns)])
    return Table(["run", *keys, *(h for h, _ in columns)], [False] * (1 + len(keys)) + [True] * len(columns), cells)


def markdown_table(runs: list[Path], labels: dict[Path, str] | None = None) -> str:
    """`runs_table` as report.md shows it."""
    return markdown(runs_table(runs, labels))


SEED_METRICS = (("final_acc", "final acc %"), ("best_acc", "best acc %"), ("final_backdoor", "final backdoor %"),
                ("peak_backdoor", "peak backdoor %"), ("mean_backdoor", "mean backdoor %"),
                ("auc_after_attack", "backdoor AUC after attack %"))


def seeds_table_cells(runs: list[Path]) -> Table | None:
    """One row per cell of a sweep with `seed: [...]`: each metric as mean ± std over its seeds, and
    its 95% interval from three seeds on (None when no seed was swept)."""
    swept = {run: swept_values(run) for run in runs}
    groups = seed_groups(runs, swept)
    if groups is None:
        return None
    keys = sorted({k for run in runs for k in without_seed(swept[run])})
    rows = {run: run_row(run) for run in runs}
    metrics = [(m, title) for m, title in SEED_METRICS if any(rows[r][m] is not None for r in runs)]
    cells = []
    for members in groups.values():
        first = without_seed(swept[members[0]])
        spreads = [Spread.of([rows[r][m] for r in members if rows[r][m] is not None]) for m, _ in metrics]
        cells.append([*(_short(first.get(k, "-")) for k in keys), str(len(members)),
                      *(s.percent() if s else "-" for s in spreads)])
    return Table([*keys, "seeds", *(t for _, t in metrics)], [False] * len(keys) + [True] * (1 + len(metrics)), cells)


def seeds_table(runs: list[Path]) -> str | None:
    """`seeds_table_cells` as report.md shows it (None when no seed was swept)."""
    table = seeds_table_cells(runs)
    return None if table is None else markdown(table, trailing_space=True)


def plot_heatmap(runs: list[Path], out: Path, metric: str = "peak_backdoor") -> Path | None:
    """`metric` over the first two swept keys (averaged over the others, e.g. seeds)."""
    fig = heatmap_figure(runs, metric)
    if fig is None:
        return None
    import matplotlib.pyplot as plt

    path = out / f"heatmap_{metric}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def heatmap_figure(runs: list[Path], metric: str = "peak_backdoor"):
    """The heatmap's figure, sized to its cells (None without two swept keys)."""
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
        sw = swept_values(run)
        if kx not in sw or ky not in sw:  # a run outside the sweep (a results folder holds both)
            continue
        value = run_row(run)[metric]
        if value is not None:
            cells.setdefault((_short(sw.get(ky)), _short(sw.get(kx))), []).append(value)
    if not cells:
        return None
    rows = sorted({r for r, _ in cells})
    cols = sorted({c for _, c in cells})
    grid = np.full((len(rows), len(cols)), np.nan)
    for (r, c), vals in cells.items():
        grid[rows.index(r), cols.index(c)] = float(np.mean(vals))
    label_width = max(len(c) for c in cols)
    fig, ax = plt.subplots(figsize=(1.6 + 1.2 * len(cols) + 0.05 * label_width, 1.3 + 0.8 * len(rows)))
    im = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto")
    ax.set_xticks(range(len(cols)), cols, rotation=30, ha="right")
    ax.set_yticks(range(len(rows)), rows)
    title = metric.replace("_", " ")
    ax.set(xlabel=kx, ylabel=ky, title=f"{title} (mean over other keys)" if len(keys) > 2 else title)
    for i in range(len(rows)):
        for j in range(len(cols)):
            if not np.isnan(grid[i, j]):
                ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", color="w" if grid[i, j] < 0.6 else "k")
    bar = fig.colorbar(im, ax=ax, fraction=0.08, pad=0.03)
    bar.set_label(title)
    fig.tight_layout()
    return fig


def legend_below(fig, axes_list, handles, names) -> None:
    """One legend for the figure, below the plots, so it never covers the data; as many columns
    (up to 3) as fit the figure's width, and a wider figure when one column of the longest label
    does not fit (run labels are paths below the reported folder and can be long)."""
    width, height = fig.get_size_inches()
    renderer = fig.canvas.get_renderer()
    legend = None
    for ncol in range(min(3, max(1, len(names))), 0, -1):
        if legend is not None:
            legend.remove()
        legend = fig.legend(handles, names, loc="lower center", ncol=ncol, fontsize=7, frameon=False)
        if legend.get_window_extent(renderer).width / fig.dpi <= width - 0.2:
            break
    box = legend.get_window_extent(renderer)
    width = max(width, box.width / fig.dpi + 0.3)
    extra = box.height / fig.dpi + 0.15  # inches for the legend, below the plots
    fig.set_size_inches(width, height + extra)
    fig.tight_layout(rect=(0, extra / (height + extra), 1, 1))


def run_style(i: int) -> dict:
    """Colour and line/marker style of the i-th run: matplotlib's 10 colours, then other dashes
    and markers, so runs 1 and 11 never look alike."""
    return {"color": f"C{i % 10}", "linestyle": ["-", "--", ":", "-."][i // 10 % 4],
            "marker": ["o", "s", "^", "D"][i // 10 % 4]}


def curves_figure(runs: list[Path], labels: dict[Path, str] | None = None):
    """Main accuracy and backdoor success per round, one line per run; attack rounds marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = labels or {run: run_label(run) for run in runs}
    all_rounds = {run: read_rounds(run) for run in runs}
    targeted = any(r.get("backdoor_success") is not None for rs in all_rounds.values() for r in rs)
    fig, axes = plt.subplots(1, 2 if targeted else 1, figsize=(12 if targeted else 7, 4.2), squeeze=False)
    ax_acc = axes[0][0]
    handles = []
    for i, (run, rounds) in enumerate(all_rounds.items()):
        style = run_style(i)
        xs = [r["round"] for r in rounds]
        line, = ax_acc.plot(xs, [r.get("main_accuracy") for r in rounds], color=style["color"], linestyle=style["linestyle"])
        handles.append(line)
        if targeted:
            axes[0][1].plot(xs, [r.get("backdoor_success") for r in rounds], color=style["color"], linestyle=style["linestyle"])
            hits = [r for r in rounds if r.get("attackers") and r.get("backdoor_success") is not None]
            axes[0][1].plot([r["round"] for r in hits], [r["backdoor_success"] for r in hits], style["marker"],
                            color=style["color"], markersize=3)
    ax_acc.set(xlabel="round", ylabel="main-task accuracy", title="main task")
    if targeted:
        axes[0][1].set(xlabel="round", ylabel="backdoor success rate", title="backdoor (dots: attack rounds)", ylim=(-0.02, 1.02))
    from matplotlib.ticker import MaxNLocator

    for ax in axes[0]:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # rounds are whole numbers
    legend_below(fig, axes[0], handles, [labels[run] for run in all_rounds])
    return fig


def seed_curves_figure(runs: list[Path]):
    """Accuracy and backdoor success per round as the mean over each cell's seeds with a ±1 std band
    (None when no seed was swept)."""
    swept = {run: swept_values(run) for run in runs}
    groups = seed_groups(runs, swept)
    if groups is None:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    import numpy as np

    by_round = {run: {r["round"]: r for r in read_rounds(run)} for run in runs}
    metrics = [("main_accuracy", "main-task accuracy")]
    if any(r.get("backdoor_success") is not None for lines in by_round.values() for r in lines.values()):
        metrics.append(("backdoor_success", "backdoor success rate"))
    fig, axes = plt.subplots(1, len(metrics), figsize=(6 * len(metrics), 4.2), squeeze=False)
    handles, names = [], []
    for i, members in enumerate(groups.values()):
        style = run_style(i)
        for ax, (key, title) in zip(axes[0], metrics):
            rounds = sorted({t for m in members for t, r in by_round[m].items() if r.get(key) is not None})
            values = [[by_round[m][t][key] for m in members if by_round[m].get(t, {}).get(key) is not None] for t in rounds]
            mean = np.array([np.mean(v) for v in values])
            std = np.array([np.std(v, ddof=1) if len(v) > 1 else 0.0 for v in values])
            line, = ax.plot(rounds, mean, color=style["color"], linestyle=style["linestyle"])
            ax.fill_between(rounds, mean - std, mean + std, color=style["color"], alpha=0.2, linewidth=0)
            ax.set(xlabel="round", ylabel=title, title=f"{title}: mean ± std over seeds")
            ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        handles.append(line)
        other = without_seed(swept[members[0]])
        names.append((", ".join(_short(v) for v in other.values()) or "all") + f" ({len(members)} seeds)")
    legend_below(fig, axes[0], handles, names)
    return fig


def time_curves_figure(runs: list[Path], labels: dict[Path, str] | None = None):
    """Main accuracy (and backdoor success) against simulated time, for runs on the federation
    clock (None when no run is): a round's point sits at the simulated time it closed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = labels or {run: run_label(run) for run in runs}
    timed = {run: [r for r in read_rounds(run) if r["round"] == 0 or r.get("sim_time") is not None] for run in runs}
    timed = {run: rs for run, rs in timed.items() if any(r.get("sim_time") is not None for r in rs)}
    if not timed:
        return None
    targeted = any(r.get("backdoor_success") is not None for rs in timed.values() for r in rs)
    fig, axes = plt.subplots(1, 2 if targeted else 1, figsize=(12 if targeted else 7, 4.2), squeeze=False)
    handles = []
    for i, (run, rounds) in enumerate(timed.items()):
        style = run_style(i)
        xs = [r.get("sim_time", 0.0) for r in rounds]  # round 0: the start
        line, = axes[0][0].plot(xs, [r.get("main_accuracy") for r in rounds], color=style["color"], linestyle=style["linestyle"])
        handles.append(line)
        if targeted:
            axes[0][1].plot(xs, [r.get("backdoor_success") for r in rounds], color=style["color"], linestyle=style["linestyle"])
    axes[0][0].set(xlabel="simulated seconds", ylabel="main-task accuracy", title="main task on the federation clock")
    if targeted:
        axes[0][1].set(xlabel="simulated seconds", ylabel="backdoor success rate", title="backdoor", ylim=(-0.02, 1.02))
    legend_below(fig, axes[0], handles, [labels[run] for run in timed])
    return fig


def plot_curves(runs: list[Path], out: Path, labels: dict[Path, str] | None = None) -> list[Path]:
    import matplotlib.pyplot as plt

    fig = curves_figure(runs, labels)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "curves.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    paths = [path]
    in_time = time_curves_figure(runs, labels)
    if in_time is not None:
        paths.append(out / "curves_time.png")
        in_time.savefig(paths[-1], dpi=110)
        plt.close(in_time)
    banded = seed_curves_figure(runs)
    if banded is not None:
        paths.append(out / "curves_over_seeds.png")
        banded.savefig(paths[-1], dpi=110)
        plt.close(banded)
    return paths


def bytes_figure(runs: list[Path], labels: dict[Path, str] | None = None):
    """Final main accuracy against the MB each run uploaded, one point per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = labels or {run: run_label(run) for run in runs}
    fig, ax = plt.subplots(figsize=(6, 4.2))
    handles = []
    for i, run in enumerate(runs):
        rows, style = run_row(run), run_style(i)
        handles.append(ax.scatter(rows["mb_up"], rows["final_acc"], color=style["color"], marker=style["marker"]))
    ax.set(xlabel="MB uploaded (total)", ylabel="final main accuracy")
    legend_below(fig, [ax], handles, [labels[run] for run in runs])
    return fig


def plot_bytes_vs_accuracy(runs: list[Path], out: Path, labels: dict[Path, str] | None = None) -> Path:
    import matplotlib.pyplot as plt

    fig = bytes_figure(runs, labels)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "bytes_vs_accuracy.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def load_drawing() -> None:
    """Import what drawing a report takes (matplotlib, scipy's t quantile: ~1.5 s on two cores);
    `fedsim sweep` does it while its Ray starts rather than after the last run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot  # noqa: F401
    import scipy.special  # noqa: F401


def write_report(paths: list[Path], out: Path | None = None) -> Path:
    """`report.md` with the table and the plots, from the run folders at or below `paths`;
    `out` defaults to `default_out(paths)` (inside the folder reported on)."""
    paths = [Path(p) for p in paths]
    runs = find_runs(paths)
    if not runs:
        raise FileNotFoundError(f"no run folders (with rounds.jsonl) under {', '.join(map(str, paths))}")
    out = default_out(paths) if out is None else Path(out)
    if out is None:
        raise ValueError(f"{', '.join(map(str, paths))} share no folder but the root: say where the report goes with --out")
    labels = run_labels(runs, paths)
    out.mkdir(parents=True, exist_ok=True)
    plots = plot_curves(runs, out, labels) + [plot_bytes_vs_accuracy(runs, out, labels)]
    heat = plot_heatmap(runs, out)
    if heat is not None:
        plots.append(heat)
    seeds = seeds_table(runs)
    text = ("# fedsim report\n\n" + ("## Over seeds\n\n" + seeds + "\n## Runs\n\n" if seeds else "")
            + markdown_table(runs, labels) + "\n" + "".join(f"![{p.stem}]({p.name})\n" for p in plots))
    (out / "report.md").write_text(text)
    return out / "report.md"
