"""`fedsim report --html` (#37 item 6): the defenses leaderboard page, report.html.

The worst case over attacks and the pooled detection audit against hand computations; then a real
tiny sweep (digits, in process) reported with `--html` and opened in headless Chromium: no console
error, no request, report.md's numbers in its cells, sorting by a header click, the figures loaded.
The browser test skips when Chromium, its driver or selenium is missing."""

from __future__ import annotations

import html
import json
import re
import shutil
import tempfile
from pathlib import Path

import pytest

from fedsim.runs.report import Table, find_runs, run_labels, runs_table, seeds_table_cells
from fedsim.runs.report_html import classify, defense_rows, defense_table, sort_value


def det(tp: int, fp: int, fn: int, tn: int) -> dict:
    return {"tp": tp, "fp": fp, "fn": fn, "tn": tn, "clipped": {"attackers": 0, "honest": 0}}


def fake_run(folder: Path, defense: str, threat: str, seed: int, acc: list[float], bd: list[float] | None,
             detection: list[dict] | None = None, pipeline: list[float] | None = None) -> Path:
    """A run folder as a sweep writes it: sweep.json (its swept values), rounds.jsonl, summary.json."""
    folder.mkdir(parents=True)
    attack = None if threat == "none" else {"name": "edge_case", "mode": "blackbox"}
    lines = []
    for i, a in enumerate(acc):
        line = {"round": i + 1, "main_accuracy": a, "bytes_up": 2_000_000, "wall_seconds": 0.5,
                "attackers": [3] if attack else []}
        if bd is not None:
            line["backdoor_success"] = bd[i]
        if detection is not None:
            line["detection"] = detection[i]
        if pipeline is not None:
            line["pipeline_seconds"] = pipeline[i]
        lines.append(line)
    (folder / "rounds.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    swept = {"defense": {"label": defense}, "threat": {"label": threat, "attack": attack}, "seed": seed}
    (folder / "sweep.json").write_text(json.dumps(swept))
    (folder / "summary.json").write_text(json.dumps({"name": folder.name, "scenario": {"attack": attack}}))
    return folder


def test_worst_case_over_attacks_and_the_pooled_audit_by_hand(tmp_path):
    root = tmp_path / "sweep"
    fake_run(root / "a_none", "A", "none", 1, [0.85, 0.9], None, [det(0, 1, 0, 4), det(0, 0, 0, 5)], [0.001, 0.003])
    fake_run(root / "a_x_1", "A", "x", 1, [0.7, 0.8], [0.5, 0.2], [det(1, 0, 0, 4), det(0, 1, 1, 3)], [0.002, 0.002])
    fake_run(root / "a_x_2", "A", "x", 2, [0.65, 0.6], [0.7, 0.3], [det(1, 0, 0, 4), det(1, 0, 0, 4)], [0.002, 0.002])
    fake_run(root / "a_y_1", "A", "y", 1, [0.7, 0.75], [0.9, 0.4], [det(0, 0, 1, 4), det(0, 0, 1, 4)], [0.002, 0.002])
    fake_run(root / "b_y_1", "B", "y", 1, [0.5, 0.55], [0.1, 0.2])
    runs = find_runs([root])
    labels = run_labels(runs, [root])
    entries = [classify(run, labels[run]) for run in runs]
    assert {(e.defense, e.attack, e.attack_free) for e in entries} == {
        ("A", "none", True), ("A", "x", False), ("A", "y", False), ("B", "y", False)}
    a, b = defense_rows(entries)
    # the worst final accuracy is the worst attack's mean over its seeds (x: (0.8 + 0.6) / 2), not the
    # single worst run (0.6); the run without an attack is shown apart, not in the worst case
    assert a["worst_acc"] == pytest.approx(0.7) and a["worst_acc_attack"] == "x"
    assert a["worst_backdoor"] == pytest.approx(0.9) and a["worst_backdoor_attack"] == "y"
    assert a["clean_acc"] == pytest.approx(0.9) and a["attacks"] == 2 and a["runs"] == 4
    # pooled over the 8 rounds: tp 3, fn 3, fp 2, tn 32; rounds without attackers: fp 1, tn 9
    assert a["tpr"] == pytest.approx(0.5) and a["fpr"] == pytest.approx(2 / 34)
    assert a["f1"] == pytest.approx(6 / 11) and a["false_alarms"] == pytest.approx(0.1)
    assert a["pipeline_ms"] == pytest.approx(2.0) and a["mb_up_per_round"] == pytest.approx(2.0)
    assert b["worst_acc"] == pytest.approx(0.55) and b["clean_acc"] is None and b["tpr"] is None
    table = defense_table(entries)
    row = dict(zip(table.headers, table.rows[0]))
    assert row["worst final acc %"] == "70.0" and row["worst peak backdoor %"] == "90.0"
    assert row["FPR %"] == "5.9" and row["false alarms, no attacker %"] == "10.0"
    assert table.rows[1][table.headers.index("TPR %")] == "-"


def md_cells(line: str) -> list[str]:
    """A pipe-table line's cells as GitHub reads them: split at each '|' no backslash escapes, and
    '\\|' is a '|' inside a cell."""
    inner = line.strip().removeprefix("|").removesuffix("|")
    return [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", inner)]


def md_table(text: str, first_header: str) -> Table:
    """The cells of report.md's table whose first header is `first_header`, read from the markdown."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_header} |"))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    table = [md_cells(line) for line in lines[start:end]]
    assert len({len(cells) for cells in table}) == 1, "a row with more or fewer cells than the header"
    return Table(table[0], [a.endswith(":") for a in table[1]], table[2:])


def html_table(page: str, table_id: str) -> tuple[list[str], list[list[str]]]:
    """A table's header texts and cell texts as the page's HTML holds them."""
    body = re.search(rf'<table class="sortable" id="{table_id}">(.*?)</table>', page, re.S).group(1)
    rows = [[html.unescape(c) for c in re.findall(r"<t[hd][^>]*>(.*?)</t[hd]>", tr, re.S)]
            for tr in re.findall(r"<tr>(.*?)</tr>", body, re.S)]
    return rows[0], rows[1:]


def test_report_md_and_the_page_show_the_same_table_cells(tmp_path):
    """report.md and report.html draw the runs and seeds tables from one Table: a '|' in a run label
    and in a swept value stays in its cell in both, the lifecycle's and the clock's headers are
    cells of their own, and the page shows report.md's cells."""
    from fedsim.cli import main

    root = tmp_path / "sweep"
    fake_run(root / "a|b_x_1", "A|B", "x", 1, [0.7, 0.8], [0.5, 0.2])
    fake_run(root / "a|b_x_2", "A|B", "x", 2, [0.65, 0.6], [0.7, 0.3])
    fake_run(root / "c_y_1", "C", "y", 1, [0.5, 0.55], [0.1, 0.2])
    clocked = root / "c_y_1"  # on the federation clock, and a backdoor lifecycle in its summary
    rounds = [{**json.loads(line), "sim_time": 1.5 * (i + 1), "stragglers": [i]}
              for i, line in enumerate((clocked / "rounds.jsonl").read_text().splitlines())]
    (clocked / "rounds.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rounds))
    lifecycle = {"rounds_to_implant": 1, "lifespan": None, "half_life": None, "auc_after_attack": 0.15, "rounds_after": 1}
    (clocked / "summary.json").write_text(json.dumps({"name": "c_y_1", "backdoor_lifecycle": lifecycle}))
    assert main(["report", str(root), "--out", str(tmp_path / "report"), "--html"]) == 0
    md = (tmp_path / "report" / "report.md").read_text()
    page = (tmp_path / "report" / "report.html").read_text()

    runs = find_runs([root])
    table = runs_table(runs, run_labels(runs, [root]))
    assert md_table(md, "run") == table  # report.md's cells, read back as GitHub would, are the Table's
    assert [row[0] for row in table.rows] == ["a|b_x_1", "a|b_x_2", "c_y_1"]
    assert table.rows[0][table.headers.index("defense")] == "A|B"
    row = dict(zip(table.headers, table.rows[2]))
    assert [row[h] for h in ("rounds to implant", "lifespan", "simulated s", "stragglers")] == ["1", "≥ 1", "3", "2"]
    assert "\n| a\\|b_x_1 | A\\|B | 1 | x | 2 |" in md  # the '|' escaped, so GitHub keeps it in its cell
    header = next(line for line in md.splitlines() if line.startswith("| run |"))
    assert "| s | rounds to implant | lifespan | half-life | backdoor AUC after attack % | simulated s | stragglers |" in header
    assert html_table(page, "runs-table") == (table.headers, table.rows)  # the page's cells are report.md's

    seeds = seeds_table_cells(runs)
    assert md_table(md, "defense") == seeds
    assert seeds.headers[:3] == ["defense", "threat", "seeds"] and [r[:3] for r in seeds.rows] == [
        ["A|B", "x", "2"], ["C", "y", "1"]]
    assert html_table(page, "seeds-table") == (seeds.headers, seeds.rows)


def test_sort_values():
    assert [sort_value(t) for t in ("93.1", "≥ 4", "93.1 ± 0.4 [92.2, 94.0]", "-", "x", "1e-3")] == [
        93.1, 4.0, 93.1, None, None, 0.001]


# ------------------------------------------------------------------ the page in a real browser

SWEEP = """
base: {quickstart}
name: tiny_leaderboard
federation: {{num_clients: 8, clients_per_round: 5, rounds: 3, local_epochs: 1}}
model: {{name: mlp, hidden: [16]}}
evaluation: {{every: 1}}
sweep:
  threat:
    - {{label: none, attack: null}}
    - {{label: tails_blackbox, attack: {{name: edge_case, mode: blackbox, num_attackers: 1, schedule: {{name: every_round}},
        num_edge: 20, num_clean: 20,
        edge_set: {{name: tail, source_class: 7, target_class: 1, transform: rotate, angle_range: [30, 90]}}}}}}
  defense:
    - {{label: fedavg, aggregator: fedavg, defenses: []}}
    - {{label: multikrum, aggregator: {{name: multikrum, num_malicious: 1}}}}
"""


def tiny_sweep(where: Path) -> Path:
    """Four real runs (2 threats x 2 defenses, 3 rounds on digits), in process: ~3 s."""
    from conftest import QUICKSTART, run_local
    from fedsim.runs.folder import RunFolder
    from fedsim.runs.sweep import expand, run_sweep, sweep_dir

    where.mkdir(parents=True, exist_ok=True)
    (where / "sweep.yaml").write_text(SWEEP.format(quickstart=QUICKSTART))
    name, runs = expand(where / "sweep.yaml")
    folder = sweep_dir(name, runs, where / "results")
    run_sweep(folder, runs, lambda scenario, run_dir: run_local(scenario, RunFolder(run_dir)))
    return folder


def chromium_driver():
    """Headless Chromium through selenium, with the machine's chromium and chromedriver (selenium
    downloads nothing when both paths are given); the flags keep it off the network and out of any
    profile. Skips when any of the three is missing."""
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install -e '.[test]')")
    from selenium.webdriver.chrome.service import Service

    browser = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
    driver = shutil.which("chromedriver")
    if browser is None or driver is None:
        pytest.skip("headless browser test: Chromium and chromedriver not found "
                    "(apt-get install chromium chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--window-size=1300,1000", f"--user-data-dir={tempfile.mkdtemp()}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(options=options, service=Service(driver))


def shown(driver, table_id: str) -> tuple[list[str], list[list[str]]]:
    """A table's header texts and cell texts as the browser shows them, rows in their current order."""
    return driver.execute_script(
        "const t = document.getElementById(arguments[0]);"
        "const texts = (row) => Array.from(row.cells).map(c => c.textContent);"
        "return [texts(t.tHead.rows[0]), Array.from(t.tBodies[0].rows).map(texts)];", table_id)


def column(driver, table_id: str, index: int) -> list[str]:
    return [row[index] for row in shown(driver, table_id)[1]]


def numbers(texts: list[str]) -> list[float | None]:
    return [sort_value(t) for t in texts]


def test_leaderboard_page_in_headless_chromium(tmp_path, one_torch_thread):
    driver = chromium_driver()
    try:
        from fedsim.cli import main

        folder = tiny_sweep(tmp_path)
        # and a run of its own beside the sweep, as results folders hold them: 12 rounds, 5% final
        # accuracy (a string sort would put "12" before "3" and "5.0" after "93.8"), a '|' in its name
        old = tmp_path / "results" / "quick|start-20261124-101010"
        old.mkdir()
        lines = [{"round": r, "main_accuracy": 0.05 if r == 12 else 0.6, "bytes_up": 1000, "wall_seconds": 0.1}
                 for r in range(1, 13)]
        (old / "rounds.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
        scenario = {"aggregator": {"name": "fedavg"}, "defenses": [], "attack": None}
        (old / "summary.json").write_text(json.dumps({"name": "quickstart", "scenario": scenario}))
        out = tmp_path / "report"
        assert main(["report", str(tmp_path / "results"), "--out", str(out), "--html"]) == 0
        page = out / "report.html"
        assert "http://" not in page.read_text() and "https://" not in page.read_text()
        driver.get(page.as_uri())

        errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
        assert errors == []
        assert driver.execute_script("return performance.getEntriesByType('resource').length") == 0  # no request

        # report.md's numbers, cell by cell, in the page's runs table
        md = md_table((out / "report.md").read_text(), "run")
        headers, rows = shown(driver, "runs-table")
        assert headers == md.headers and rows == md.rows and len(rows) == 5
        assert rows[0][0] == "quick|start-20261124-101010"  # one cell in both, its '|' escaped in report.md

        # each defense's worst final accuracy is its attacked run's final accuracy from summary.json
        dheaders, defenses = shown(driver, "defenses-table")
        assert [row[0] for row in defenses] == ["fedavg", "multikrum"]  # the run of its own is fedavg too, unattacked
        for row in defenses:
            summary = json.loads((folder / f"threat_tails_blackbox__defense_{row[0]}" / "summary.json").read_text())
            assert row[dheaders.index("worst final acc %")] == f"{100 * summary['final_main_accuracy']:.1f}"
            assert row[dheaders.index("worst peak backdoor %")] == f"{100 * summary['peak_backdoor_success']:.1f}"

        # a click on a header sorts numerically, a second click the other way; text columns by text
        acc = md.headers.index("final acc %")
        th = driver.find_elements("css selector", "#runs-table thead th")
        th[acc].click()
        up = numbers(column(driver, "runs-table", acc))
        assert up == sorted(up) and th[acc].get_attribute("aria-sort") == "ascending"
        th[acc].click()
        assert numbers(column(driver, "runs-table", acc)) == sorted(up, reverse=True)
        expected = sorted(md.rows, key=lambda r: -sort_value(r[acc]))
        assert [r[0] for r in expected] == column(driver, "runs-table", 0)  # whole rows move, not one column
        th[0].click()
        assert column(driver, "runs-table", 0) == sorted(r[0] for r in md.rows)
        peak = md.headers.index("peak backdoor %")  # '-' (no attack) stays last both ways
        th[peak].click()
        assert column(driver, "runs-table", peak)[-3:] == ["-"] * 3
        th[peak].click()
        values = column(driver, "runs-table", peak)
        assert values[-3:] == ["-"] * 3 and numbers(values[:2]) == sorted(numbers(values[:2]), reverse=True)
        rounds = md.headers.index("rounds")
        th[rounds].click()
        assert column(driver, "runs-table", rounds) == ["3", "3", "3", "3", "12"]

        # the figures: one per attack, and the heatmap; every image decoded
        images = driver.execute_script(
            "return Array.from(document.images).map(i => [i.complete, i.naturalWidth, i.naturalHeight])")
        assert len(images) == 3 and all(done and w > 100 and h > 100 for done, w, h in images)
        assert [e for e in driver.get_log("browser") if e["level"] == "SEVERE"] == []
    finally:
        driver.quit()
