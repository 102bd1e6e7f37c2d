"""`fedsim report --html`: the defenses leaderboard as one self-contained page, report.html.

The page holds, drawn from the run folders on disk like report.md (fedsim/runs/report.py):

- **Defenses**: one row per defense, its worst case over the attacks it faced: the lowest final
  main accuracy and the highest peak backdoor success (each naming the attack), its final accuracy
  without an attack, the detection audit pooled over its runs (TPR, FPR, F1, false alarms in rounds
  without attackers; fedsim/runs/detection.py) and its cost (defenses + rule ms per round, wall
  seconds per round, MB uploaded per round).
- **Curves**: main accuracy and backdoor success per round, one figure per attack, one line per
  defense (the mean over the runs of that cell, e.g. its seeds).
- the heatmap of report.md when the sweep has two swept keys;
- **Runs** (and **Over seeds** when a seed was swept): report.md's own tables. Both documents draw
  them from one `Table` of cell texts (`runs_table` / `seeds_table_cells` in fedsim/runs/report.py),
  which report.md renders as markdown and this page as HTML, so every cell shows the very text
  report.md shows and the two can never disagree.

Every table sorts by a click on its header (again: the other way); a column whose cells are all
numbers (or '-') sorts numerically, '-' last either way. The page makes no request: CSS and
JavaScript are inline, the figures are base64 PNGs from matplotlib, and a Content-Security-Policy
forbids anything else.

Which swept key is the attack: one whose first dotted part is `attack`, `attacks` or `threat`
(`attack.mode`, `threat`); `seed` is averaged over; every other swept key names the defense. A run
outside a sweep (or a sweep that swept no such key) takes its defense (the aggregator and the
defenses) and its attack from the resolved scenario in its summary.json.
"""

from __future__ import annotations

import base64
import html
import io
import json
import re
from dataclasses import dataclass
from pathlib import Path

from fedsim.runs.detection import run_detection
from fedsim.runs.report import (
    Table, _mean_ms, _pct, _short, default_out, find_runs, heatmap_figure, legend_below, run_labels, run_row, run_style,
    runs_table, seeds_table_cells, swept_values,
)
from fedsim.runs.results import read_rounds
from fedsim.runs.seeds import SEED_KEY

ATTACK_KEYS = ("attack", "attacks", "threat")
NO_ATTACK = "none"


# --- sorting a table's cells -------------------------------------------------------------------

_NUMBER = re.compile(r"^(?:≥\s*)?(-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)")


def sort_value(text: str) -> float | None:
    """The number a cell sorts by: its leading number ('93.1', '≥ 4', '93.1 ± 0.4 [..]' -> 93.1),
    None for '-' or text."""
    match = _NUMBER.match(text.strip())
    return float(match.group(1)) if match else None


# --- the defenses: worst case over attacks -----------------------------------------------------

@dataclass
class Entry:
    run: Path
    defense: str
    attack: str
    attack_free: bool  # the scenario has no attack (or no round had an attacker)
    row: dict  # run_row: the same numbers report.md shows
    rounds: list[dict]


def _is_attack_key(key: str) -> bool:
    return key.split(".")[0] in ATTACK_KEYS


def _scenario(run: Path) -> dict | None:
    path = run / "summary.json"
    try:
        scenario = json.loads(path.read_text()).get("scenario") if path.exists() else None
    except (json.JSONDecodeError, AttributeError):
        return None
    return scenario if isinstance(scenario, dict) else None


def _join(items: dict) -> str:
    """One swept value as it is; several as `key=value, ...`."""
    if len(items) == 1:
        return _short(next(iter(items.values())))
    return ", ".join(f"{k}={_short(v)}" for k, v in sorted(items.items()))


def _attack_of(attack) -> str:
    if not attack:
        return NO_ATTACK
    return attack["name"] + (f" ({attack['mode']})" if attack.get("mode") else "")


def _defense_of(scenario: dict) -> str:
    rule = _short(scenario.get("aggregator") or "fedavg")
    defenses = scenario.get("defenses") or []
    return rule + (" + " + _short(defenses) if defenses else "")


def classify(run: Path, label: str) -> Entry:
    """The run's defense and attack (see the module's doc) and its report row."""
    swept, scenario, rounds = swept_values(run), _scenario(run), read_rounds(run)
    attack_keys = {k: v for k, v in swept.items() if _is_attack_key(k)}
    defense_keys = {k: v for k, v in swept.items() if not _is_attack_key(k) and k != SEED_KEY}
    if defense_keys:
        defense = _join(defense_keys)
    else:
        defense = _defense_of(scenario) if scenario is not None else label
    if attack_keys:  # a swept `attack: null` reads "none", as the scenario's no-attack does
        attack = _join({k: NO_ATTACK if v is None else v for k, v in attack_keys.items()})
    else:
        attack = _attack_of(scenario.get("attack")) if scenario is not None else "-"
    if scenario is not None:
        attack_free = not scenario.get("attack")
    else:
        attack_free = not any(r.get("attackers") for r in rounds)
    return Entry(run, defense, attack, attack_free, run_row(run, label), rounds)


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def cells(entries: list[Entry]) -> dict[tuple[str, str], list[Entry]]:
    """Runs grouped by (defense, attack), in the runs' order: the runs of one cell differ only by
    their seed (or by nothing swept)."""
    groups: dict[tuple[str, str], list[Entry]] = {}
    for e in entries:
        groups.setdefault((e.defense, e.attack), []).append(e)
    return groups


def _cell_means(attacks: dict[str, list[Entry]], key: str) -> dict[str, float]:
    """Attack -> the mean of run_row[key] over that cell's runs (attacks where no run measured it left out)."""
    means = {a: _mean([e.row[key] for e in m if e.row[key] is not None]) for a, m in attacks.items()}
    return {a: v for a, v in means.items() if v is not None}


def defense_rows(entries: list[Entry]) -> list[dict]:
    """One row per defense: the worst case over the attacks it faced (its runs without an attack
    are left out of it, and shown as `clean_acc`), each attack's value being the mean over that
    cell's runs (its seeds); the detection audit pooled over all its runs' rounds (the run totals'
    micro average, fedsim/runs/detection.py); cost per round over all its rounds."""
    by_defense: dict[str, dict[str, list[Entry]]] = {}
    for (defense, attack), members in cells(entries).items():
        by_defense.setdefault(defense, {})[attack] = members
    out = []
    for defense, attacks in by_defense.items():
        attacked = {a: m for a, m in attacks.items() if not all(e.attack_free for e in m)}
        acc, bd = _cell_means(attacked, "final_acc"), _cell_means(attacked, "peak_backdoor")
        members = [e for m in attacks.values() for e in m]
        clean = [e.row["final_acc"] for e in members if e.attack_free and e.row["final_acc"] is not None]
        rounds = [r for e in members for r in e.rounds if r["round"] > 0]
        audit = run_detection(rounds) or {}
        worst_acc = min(acc, key=acc.get) if acc else None
        worst_bd = max(bd, key=bd.get) if bd else None
        out.append({
            "defense": defense,
            "runs": len(members),
            "attacks": len(attacked),
            "clean_acc": _mean(clean),
            "worst_acc": acc.get(worst_acc), "worst_acc_attack": worst_acc,
            "worst_backdoor": bd.get(worst_bd), "worst_backdoor_attack": worst_bd,
            "tpr": audit.get("tpr"), "fpr": audit.get("fpr"), "f1": audit.get("f1"),
            "false_alarms": audit.get("false_alarm_rate_without_attackers"),
            "pipeline_ms": _mean_ms([r["pipeline_seconds"] for r in rounds if r.get("pipeline_seconds") is not None]),
            "seconds_per_round": _mean([r["wall_seconds"] for r in rounds if r.get("wall_seconds") is not None]),
            "mb_up_per_round": _mean([r.get("bytes_up", 0) / 1e6 for r in rounds]),
        })
    return out


def _fixed(digits: int):
    return lambda v: "-" if v is None else f"{v:.{digits}f}"


DEFENSE_COLUMNS = (  # (key, header, format, numeric)
    ("defense", "defense", str, False),
    ("runs", "runs", str, True),
    ("attacks", "attacks", str, True),
    ("clean_acc", "final acc, no attack %", _pct, True),
    ("worst_acc", "worst final acc %", _pct, True),
    ("worst_acc_attack", "under", lambda v: v or "-", False),
    ("worst_backdoor", "worst peak backdoor %", _pct, True),
    ("worst_backdoor_attack", "under", lambda v: v or "-", False),
    ("tpr", "TPR %", _pct, True),
    ("fpr", "FPR %", _pct, True),
    ("f1", "F1 %", _pct, True),
    ("false_alarms", "false alarms, no attacker %", _pct, True),
    ("pipeline_ms", "defenses + rule ms/round", _fixed(1), True),
    ("seconds_per_round", "s/round", _fixed(2), True),
    ("mb_up_per_round", "MB up/round", _fixed(2), True),
)


def defense_table(entries: list[Entry]) -> Table:
    rows = defense_rows(entries)
    return Table([c[1] for c in DEFENSE_COLUMNS], [c[3] for c in DEFENSE_COLUMNS],
                 [[fmt(r[key]) for key, _, fmt, _ in DEFENSE_COLUMNS] for r in rows])


# --- figures -----------------------------------------------------------------------------------

def attack_curves_figure(attack: str, groups: dict[str, list[Entry]]):
    """Main accuracy and backdoor success per round under one attack, a line per defense: the mean
    over the cell's runs at each round any of them measured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    metrics = [("main_accuracy", "main-task accuracy")]
    if any(r.get("backdoor_success") is not None for m in groups.values() for e in m for r in e.rounds):
        metrics.append(("backdoor_success", "backdoor success rate"))
    fig, axes = plt.subplots(1, len(metrics), figsize=(6 * len(metrics), 3.6), squeeze=False)
    handles = []
    for i, members in enumerate(groups.values()):
        style = run_style(i)
        for ax, (key, _) in zip(axes[0], metrics):
            per_round: dict[int, list[float]] = {}
            for e in members:
                for r in e.rounds:
                    if r.get(key) is not None:
                        per_round.setdefault(r["round"], []).append(r[key])
            xs = sorted(per_round)
            line, = ax.plot(xs, [sum(per_round[x]) / len(per_round[x]) for x in xs], color=style["color"],
                            linestyle=style["linestyle"], marker=style["marker"], markersize=3)
        handles.append(line)
    for ax, (key, title) in zip(axes[0], metrics):
        ax.set(xlabel="round", ylabel=title, title=f"{title.split(' ')[0]}: attack {attack}")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if key == "backdoor_success":
            ax.set_ylim(-0.02, 1.02)
    legend_below(fig, axes[0], handles, list(groups))
    return fig


def png_data(fig, dpi: int = 90) -> str:
    """The figure as a `data:` URI (base64 PNG); closes it."""
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def curve_figures(entries: list[Entry]) -> list[tuple[str, str]]:
    """(caption, data URI) per attack, attacks in the order the runs first meet them."""
    by_attack: dict[str, dict[str, list[Entry]]] = {}
    for (defense, attack), members in cells(entries).items():
        by_attack.setdefault(attack, {})[defense] = members
    return [(f"attack: {attack} — one line per defense", png_data(attack_curves_figure(attack, groups)))
            for attack, groups in by_attack.items()]


# --- the page ----------------------------------------------------------------------------------

STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 1.5em auto; max-width: 1400px; padding: 0 1em; color: #222; }
h1 { font-size: 1.5em; margin-bottom: .2em; } h2 { font-size: 1.2em; margin-top: 1.6em; }
nav a { margin-right: 1em; } .note { color: #555; max-width: 60em; }
.scroll { overflow-x: auto; max-height: 80vh; border: 1px solid #ddd; }
table { border-collapse: collapse; font-size: 13px; }
th, td { padding: 3px 8px; border-bottom: 1px solid #eee; } td { white-space: nowrap; }
th { position: sticky; top: 0; background: #f4f4f4; cursor: pointer; user-select: none; text-align: left;
     vertical-align: bottom; min-width: 3em; max-width: 9em; }
th:focus { outline: 2px solid #4a7; } th.num, td.num { text-align: right; }
th[aria-sort=ascending]::after { content: " \\25B2"; } th[aria-sort=descending]::after { content: " \\25BC"; }
tbody tr:nth-child(even) { background: #fafafa; } tbody tr:hover { background: #eef6ff; }
figure { margin: 1em 0; } figure img { max-width: 100%; height: auto; border: 1px solid #eee; }
figcaption { color: #555; font-size: 13px; }
"""

# Sort a table by the clicked header; numbers numerically, '-' (no data-value) last either way.
SCRIPT = """
"use strict";
function sortTable(table, col) {
  const th = table.tHead.rows[0].cells[col];
  const ascending = th.getAttribute("aria-sort") !== "ascending";
  for (const h of table.tHead.rows[0].cells) h.removeAttribute("aria-sort");
  th.setAttribute("aria-sort", ascending ? "ascending" : "descending");
  const numeric = th.classList.contains("num");
  const sign = ascending ? 1 : -1;
  const body = table.tBodies[0];
  const rows = Array.from(body.rows);
  const key = (row) => {
    const cell = row.cells[col];
    if (!numeric) return cell.textContent;
    return cell.dataset.value === undefined ? null : Number(cell.dataset.value);
  };
  rows.sort((a, b) => {
    const x = key(a), y = key(b);
    if (x === null || y === null) return (x === null) - (y === null);
    if (numeric) return sign * (x - y);
    return sign * x.localeCompare(y, undefined, {numeric: true});
  });
  for (const row of rows) body.appendChild(row);
}
for (const table of document.querySelectorAll("table.sortable")) {
  Array.from(table.tHead.rows[0].cells).forEach((th, col) => {
    th.tabIndex = 0;
    th.title = "sort";
    th.addEventListener("click", () => sortTable(table, col));
    th.addEventListener("keydown", (e) => {
      if (e.key === "Enter" || e.key === " ") { e.preventDefault(); sortTable(table, col); }
    });
  });
}
"""

CSP = "default-src 'none'; img-src data:; style-src 'unsafe-inline'; script-src 'unsafe-inline'"


def table_html(table: Table, table_id: str) -> str:
    """A sortable table: a column sorts numerically when report.md right-aligns it and every
    cell of it is a number or '-'; each number cell carries the value it sorts by."""
    numeric = [num and all(sort_value(row[i]) is not None or row[i] in ("-", "") for row in table.rows)
               for i, num in enumerate(table.numeric)]
    esc = html.escape
    head = "".join(f'<th scope="col"{" class=num" if n else ""}>{esc(h)}</th>' for h, n in zip(table.headers, numeric))
    body = []
    for row in table.rows:
        tds = []
        for text, n in zip(row, numeric):
            value = sort_value(text) if n else None
            attrs = (" class=num" if n else "") + (f' data-value="{value!r}"' if value is not None else "")
            tds.append(f"<td{attrs}>{esc(text)}</td>")
        body.append("<tr>" + "".join(tds) + "</tr>")
    return (f'<div class="scroll"><table class="sortable" id="{table_id}"><thead><tr>{head}</tr></thead>'
            f'<tbody>\n' + "\n".join(body) + "\n</tbody></table></div>")


def figure_html(caption: str, uri: str, alt: str) -> str:
    return (f'<figure><img src="{uri}" alt="{html.escape(alt)}">'
            f"<figcaption>{html.escape(caption)}</figcaption></figure>")


def page(paths: list[Path]) -> str:
    """The whole page for the run folders at or below `paths`."""
    paths = [Path(p) for p in paths]
    runs = find_runs(paths)
    if not runs:
        raise FileNotFoundError(f"no run folders (with rounds.jsonl) under {', '.join(map(str, paths))}")
    labels = run_labels(runs, paths)
    entries = [classify(run, labels[run]) for run in runs]
    sections, nav = [], []

    def section(anchor: str, title: str, body: str) -> None:
        nav.append(f'<a href="#{anchor}">{html.escape(title)}</a>')
        sections.append(f'<section id="{anchor}-section"><h2 id="{anchor}">{html.escape(title)}</h2>{body}</section>')

    section("defenses", "Defenses: worst case over attacks",
            '<p class="note">One row per defense. <b>worst final acc</b>: its lowest final main-task accuracy '
            "over the attacks it faced, <b>worst peak backdoor</b>: its highest peak backdoor success, each the "
            "mean over that attack's runs (seeds) and naming the attack (<b>under</b>). TPR, FPR and F1 pool "
            "the detection audit over all its runs' rounds (a client is flagged when its upload did not reach "
            "the aggregate as sent); <b>false alarms</b>: the FPR of the rounds without attackers. Cost: the "
            "defenses and the rule's milliseconds per round, wall seconds and MB uploaded per round.</p>"
            + table_html(defense_table(entries), "defenses-table"))
    figures = [figure_html(caption, uri, caption) for caption, uri in curve_figures(entries)]
    heat = heatmap_figure(runs)
    if heat is not None:
        figures.append(figure_html("peak backdoor success over the first two swept keys", png_data(heat), "heatmap"))
    section("curves", "Curves per round", "".join(figures))
    seeds = seeds_table_cells(runs)
    if seeds is not None:
        section("seeds", "Over seeds", '<p class="note">report.md\'s table: mean ± std [95% interval].</p>'
                + table_html(seeds, "seeds-table"))
    section("runs", "Runs", '<p class="note">report.md\'s table, one row per run; click a header to sort.</p>'
            + table_html(runs_table(runs, labels), "runs-table"))
    where = ", ".join(str(p) for p in paths)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="{CSP}">
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="icon" href="data:,">
<title>fedsim leaderboard: {html.escape(where)}</title>
<style>{STYLE}</style></head>
<body><h1>fedsim leaderboard</h1>
<p class="note">{len(runs)} runs under {html.escape(where)}. Percentages as in report.md.</p>
<nav>{"".join(nav)}</nav>
{"".join(sections)}
<script>{SCRIPT}</script>
</body></html>
"""


def write_html(paths: list[Path], out: Path | None = None) -> Path:
    """`report.html` beside report.md (`out` as write_report takes it); returns its path."""
    paths = [Path(p) for p in paths]
    out = default_out(paths) if out is None else Path(out)
    if out is None:
        where = ", ".join(map(str, paths))
        raise ValueError(f"{where} share no folder but the root: say where the report goes with --out")
    text = page(paths)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.html").write_text(text, encoding="utf-8")
    return out / "report.html"
