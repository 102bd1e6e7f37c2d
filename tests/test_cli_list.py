"""`fedsim list` and the round table as a user meets them (#16 items 6, 7): plural or singular kind
names, schedules, edge sets and ready scenarios listed, tables never cut when output is not a
terminal, the ready scenarios found from any folder, and README's component table and scenario
list as `fedsim list --write-readme` writes them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fedsim.cli import main, round_table

FEDSIM = [sys.executable, "-m", "fedsim.cli"]


@pytest.mark.parametrize("kind,needle", [("attacks", "edge_case"), ("attack", "edge_case"), ("schedules", "fixed_pool"),
                                         ("edge_sets", "southwest"), ("lowrank", "cuttlefish"),
                                         ("protocols", "lightsecagg"), ("protocol", "fedma"),
                                         ("tracking_sinks", "tensorboard"), ("tracking_sink", "mlflow"),
                                         ("scenarios", "scenarios/paper/mnist_ardis_pgd.yaml")])
def test_list_takes_plural_and_singular_kinds(kind, needle):
    out = subprocess.run(FEDSIM + ["list", kind], capture_output=True, text=True)
    assert out.returncode == 0 and needle in out.stdout, out.stderr


def test_where_names_each_components_code(capsys):
    """`--where`: the file a component is defined in, and a protocol's server exchange and client step."""
    assert main(["list", "aggregators", "--where"]) == 0
    listed = capsys.readouterr().out
    assert "aggregators/krum.py" in listed and "aggregators/detox.py" in listed
    assert main(["list", "protocols", "--where"]) == 0
    listed = capsys.readouterr().out
    for code in ("fedsim/server/exchange.py", "fedsim/client/steps.py", "fedsim/server/secure.py",
                 "fedsim/client/secure.py", "fedsim/fedma/exchange.py", "fedsim/fedma/client.py"):
        assert code in listed, code
    assert main(["list", "aggregators"]) == 0 and "aggregators/krum.py" not in capsys.readouterr().out


def test_unknown_kind_lists_the_allowed_ones(capsys):
    assert main(["list", "gizmos"]) == 2
    err = capsys.readouterr().err
    assert "attacks" in err and "schedules" in err and "scenarios" in err
    allowed = err.split("allowed: ")[1].split(" (or singular)")[0].split(", ")
    for word in allowed:  # each as one shell word that `fedsim list` takes
        assert " " not in word and main(["list", word]) == 0, word


def test_round_table_is_not_cut_without_a_terminal():
    rounds = [{"round": r, "main_accuracy": 0.9123, "backdoor_success": 0.5, "main_loss": 0.25,
               "attackers": [11, 12, 13], "rejected": {"4": "x"}, "bytes_up": 3_456_789, "bytes_down": 1_234_567,
               "wall_seconds": 12.5} for r in range(1, 4)]
    out = subprocess.run([sys.executable, "-c", "import json, sys; from fedsim.cli import print_wide, round_table; "
                          "print_wide(round_table(json.loads(sys.argv[1]), 'a run with a long title'))",
                          __import__("json").dumps(rounds)], capture_output=True, text=True,
                         env={k: v for k, v in os.environ.items() if k != "COLUMNS"})
    assert "…" not in out.stdout and "backdoor" in out.stdout and "11,12,13" in out.stdout, out.stdout
    assert round_table(rounds, "t").columns[2].header == "backdoor"


def test_ready_scenarios_resolve_from_any_folder(tmp_path):
    for name in ("scenarios/quickstart.yaml", "quickstart.yaml", "paper/mnist_ardis_blackbox.yaml"):
        out = subprocess.run(FEDSIM + ["validate", name, "--set", "data.dir=/nonexistent"] if "paper" in name
                             else FEDSIM + ["validate", name], cwd=tmp_path, capture_output=True, text=True)
        assert "no such file" not in out.stderr, (name, out.stderr)
    missing = subprocess.run(FEDSIM + ["validate", "nothere.yaml"], cwd=tmp_path, capture_output=True, text=True)
    assert missing.returncode == 2 and "fedsim list scenarios" in missing.stderr


def test_every_package_of_the_tree_is_installed():
    """pyproject.toml lists packages explicitly (the component folders install inside fedsim)."""
    import tomllib

    repo = Path(__file__).resolve().parents[1]
    listed = set(tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(repo).parts) for p in (repo / "fedsim").rglob("__init__.py")}
    found |= {f"fedsim.{d}" for d in ("aggregators", "attacks", "defenses", "leakage", "scenarios")}
    assert found <= listed, f"add to [tool.setuptools] packages: {sorted(found - listed)}"


def test_list_scenarios_says_what_each_one_is():
    out = subprocess.run(FEDSIM + ["list", "scenarios"], capture_output=True, text=True)
    assert "an edge-case backdoor against FedAvg on scikit-learn's digits" in out.stdout, out.stdout
    assert "Variant: attacker mode `pgd`, no defense." in out.stdout  # the paper variants, told apart


def test_a_missing_scenario_names_every_place_looked(tmp_path, monkeypatch):
    from fedsim.scenario_files import missing_file_message, scenarios_dir

    monkeypatch.chdir(tmp_path)
    message = missing_file_message("scenarios/paper/nothere")
    assert str(tmp_path / "scenarios" / "paper" / "nothere") in message
    assert str(scenarios_dir() / "paper" / "nothere.yaml") in message and "fedsim list scenarios" in message


def test_readme_component_table_is_generated_from_the_registries():
    from pathlib import Path

    from fedsim.cli import component_table_markdown

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    table = readme.split("<!-- components:start -->\n")[1].split("<!-- components:end -->")[0]
    assert table == component_table_markdown(), "run `fedsim list --write-readme README.md`"


def test_readme_scenario_list_matches_the_scenarios_folder():
    from pathlib import Path

    from fedsim.cli import scenario_list_markdown

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    listed = readme.split("<!-- scenarios:start -->\n")[1].split("<!-- scenarios:end -->")[0]
    assert listed == scenario_list_markdown(), "run `fedsim list --write-readme README.md`"
