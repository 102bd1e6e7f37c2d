"""`fedsim deploy` without a cluster: which app `flwr run` ships and how the scenario travels in it,
what `--dry-run` prints (and that it writes nothing), the SuperLink side finding the scenario in
an unpacked FAB; and the exit status of a run that trained nothing (every round skipped) in
`fedsim run`, `fedsim sweep` and the ServerApp under `flwr run`, with the ServerApp's per-round
log line. The same against a real SuperLink and SuperNodes: tests/test_deployment.py (slow)."""

from __future__ import annotations

import json
import logging
import shlex
from pathlib import Path

import pytest
from flwr.app import Context, RecordDict

from fedsim.cli import main
from fedsim.deploy import commands as deploy
from fedsim.deploy.run_config import scenario_from_context
from fedsim.runs.results import read_rounds
from fedsim.scenario import ScenarioError

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "scenarios/quickstart.yaml"
APP_TOML = """[project]
name = "myapp"
version = "1.0.0"

[tool.flwr.app]
publisher = "me"

[tool.flwr.app.components]
serverapp = "fedsim.server.app:app"
clientapp = "fedsim.client.app:app"

[tool.flwr.app.config]
scenario = ""
overrides = ""
output-dir = ""
"""


@pytest.fixture
def app(tmp_path, monkeypatch):
    """A user's Flower app (fedsim's components, the run config keys) holding a scenario, as the
    current directory; FLWR_HOME an empty folder."""
    root = tmp_path / "myapp"
    (root / "scenarios").mkdir(parents=True)
    (root / "pyproject.toml").write_text(APP_TOML)
    (root / "scenarios" / "mine.yaml").write_text(QUICKSTART.read_text())
    monkeypatch.setenv("FLWR_HOME", str(tmp_path / "flwr_home"))
    (tmp_path / "flwr_home").mkdir()
    monkeypatch.chdir(root)
    return root


def dry_run(capsys, *argv) -> tuple[int, str, str]:
    code = main(["deploy", *argv, "--insecure", "--dry-run"])
    out = capsys.readouterr()
    return code, out.out, out.err


def flwr_run_line(out: str) -> list[str]:
    return shlex.split(next(line for line in out.splitlines() if line.startswith("flwr run ")))


# --- which app, which scenario path --------------------------------------------------------------
def test_run_ships_the_current_directory_and_names_the_scenario_relative_to_it(app, tmp_path, capsys):
    code, out, _ = dry_run(capsys, "run", "scenarios/mine.yaml", "--set", "federation.rounds=2", "--output", "results")
    assert code == 0
    cmd = flwr_run_line(out)
    assert cmd[:4] == ["flwr", "run", str(app), "fedsim"] and cmd[-1] == "--stream"
    assert cmd[5] == 'scenario="scenarios/mine.yaml" overrides="federation.rounds=2" output-dir="results"'
    # the connection entry is shown, not written: a dry run leaves FLWR_HOME as it was
    assert "[superlink.fedsim]" in out and 'address = "127.0.0.1:8000"' in out
    assert list((tmp_path / "flwr_home").iterdir()) == []
    # an absolute path inside the app travels as the same relative path
    _, out, _ = dry_run(capsys, "run", str(app / "scenarios/mine.yaml"))
    assert 'scenario="scenarios/mine.yaml"' in flwr_run_line(out)[5]


def test_run_with_app_builds_that_directory_from_anywhere(app, tmp_path, capsys, monkeypatch):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    code, out, _ = dry_run(capsys, "run", "scenarios/mine.yaml", "--app", str(app))  # relative to the app
    assert code == 0 and flwr_run_line(out)[2] == str(app)
    assert 'scenario="scenarios/mine.yaml"' in flwr_run_line(out)[5]


def test_run_outside_an_app_says_what_to_pass(app, tmp_path, capsys, monkeypatch):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    code, out, err = dry_run(capsys, "run", str(app / "scenarios/mine.yaml"))
    assert code == 2 and "flwr run" not in out
    assert "holds no Flower app" in err and "--app DIR" in err and f"--app {REPO}" in err  # fedsim's tree is one


def test_a_scenario_outside_the_app_is_refused(app, tmp_path, capsys):
    outside = tmp_path / "outside.yaml"
    outside.write_text(QUICKSTART.read_text())
    code, out, err = dry_run(capsys, "run", str(outside))
    assert code == 2 and "flwr run" not in out
    assert "outside the app directory" in " ".join(err.split()) and "Put the scenario under" in " ".join(err.split())


def test_an_app_without_fedsims_run_config_keys_is_refused(app, capsys):
    (app / "pyproject.toml").write_text(APP_TOML.replace('output-dir = ""\n', ""))
    code, _, err = dry_run(capsys, "run", "scenarios/mine.yaml")
    assert code == 2 and "lacks output-dir" in " ".join(err.split())


def test_health_server_address_reaches_supernode_and_superlink(capsys):
    code, out, _ = dry_run(capsys, "supernode", "--partition", "1", "--num-partitions", "3", "--health", "127.0.0.1:5555")
    assert code == 0
    node = shlex.split(next(line for line in out.splitlines() if line.startswith("flower-supernode")))
    assert node[node.index("--health-server-address") + 1] == "127.0.0.1:5555"
    _, out, _ = dry_run(capsys, "superlink", "--health", "0.0.0.0:5556")
    assert "--health-server-address 0.0.0.0:5556" in out
    _, out, _ = dry_run(capsys, "supernode")
    assert "--health-server-address" not in out  # none unless asked: Flower then starts no health server
    assert dry_run(capsys, "run", str(QUICKSTART), "--health", "1.2.3.4:5")[0] == 2


def test_local_data_reaches_the_supernodes_node_config(capsys, tmp_path):
    code, out, _ = dry_run(capsys, "supernode", "--partition", "2", "--num-partitions", "3", "--local-data", str(tmp_path / "imgs"))
    assert code == 0
    node = shlex.split(next(line for line in out.splitlines() if line.startswith("flower-supernode")))
    config = node[node.index("--node-config") + 1]
    assert config == f'partition-id=2 num-partitions=3 local-data="{tmp_path / "imgs"}"'


def test_flower_supernode_takes_the_health_flag():
    """The flag fedsim passes is the one the installed flwr's SuperNode and SuperLink document."""
    import subprocess
    import sys

    bindir = Path(sys.executable).parent
    for program in ("flower-supernode", "flower-superlink"):
        help_text = subprocess.run([str(bindir / program), "--help"], capture_output=True, text=True, timeout=120).stdout
        assert "--health-server-address" in help_text, program


# --- the SuperLink / SuperNode side: the scenario inside the unpacked FAB -----------------------
def test_a_relative_scenario_is_found_in_the_unpacked_fab_not_the_working_directory(tmp_path, monkeypatch):
    """Flower unpacks the FAB under $FLWR_HOME/apps/ and puts that folder on sys.path before it
    imports the apps; fedsim may be imported from elsewhere (an installed package)."""
    fab = tmp_path / "flwr_home" / "apps" / "me.myapp.1.0.0.abc"
    (fab / "scenarios").mkdir(parents=True)
    (fab / "pyproject.toml").write_text(APP_TOML)
    (fab / "scenarios" / "quickstart.yaml").write_text(QUICKSTART.read_text().replace("name: quickstart", "name: from-the-fab"))
    assert "name: from-the-fab" in (fab / "scenarios" / "quickstart.yaml").read_text()
    monkeypatch.syspath_prepend(str(fab))
    monkeypatch.chdir(tmp_path)
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                      run_config={"scenario": "scenarios/quickstart.yaml", "overrides": "federation.rounds=2"})
    scenario = scenario_from_context(context)
    assert scenario.name == "from-the-fab" and scenario.federation.rounds == 2
    context.run_config["scenario"] = "scenarios/not-shipped.yaml"
    with pytest.raises(ScenarioError, match="not in the app directory"):
        scenario_from_context(context)


def test_the_forking_executor_drops_only_the_apps_packages(tmp_path, monkeypatch):
    """From a source tree: its top-level packages. After a regular install the folder above fedsim
    is site-packages: dropping its packages (torch, numpy) from a forked child would break it."""
    from fedsim.deploy.executor import _app_packages

    assert {"fedsim", "aggregators", "attacks", "defenses"} <= _app_packages()
    site = tmp_path / "site-packages"
    for name in ("fedsim", "torch", "numpy"):
        (site / name).mkdir(parents=True)
        (site / name / "__init__.py").write_text("")
    monkeypatch.setattr(deploy, "SOURCE_TREE", site)
    assert _app_packages() == {"fedsim"}


# --- a run that trained nothing ------------------------------------------------------------------
SMALL = ["federation.rounds=2", "federation.num_clients=3", "federation.clients_per_round=3", "attack=null"]


@pytest.mark.simulation
def test_fedsim_run_of_clients_that_all_fail_exits_1_with_the_reason(tmp_path, monkeypatch, capsys):
    """Every client's ClientApp raises (Ray simulation, through the CLI): exit 1, the rounds'
    reason and the clients' error on stderr, and summary.json says the run trained nothing."""
    import fedsim.engine.simulate as simulation
    from failing_app import client_app_with_failures

    real = simulation.simulate

    def failing(pid, rnd):
        raise RuntimeError(f"device {pid} out of memory")

    def simulate(scenario, **kw):
        return real(scenario, client_app=client_app_with_failures(scenario, failing), **kw)

    monkeypatch.setattr(simulation, "simulate", simulate)
    code = main(["run", str(QUICKSTART), *sum((["--set", s] for s in SMALL), []), "--output", str(tmp_path)])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 1
    assert "every round was skipped (2 of 2)" in err and "out of memory" in err
    summary = json.loads(next(tmp_path.glob("*/summary.json")).read_text())
    assert summary["all_rounds_skipped"] is True and "out of memory" in summary["failure"]


SWEEP = """
base: {base}
name: tiny
federation: {{num_clients: 3, clients_per_round: 3, rounds: 2}}
attack: null
sweep:
  seed: [1, 2]
"""


def test_a_sweep_run_that_trained_nothing_is_not_done_and_runs_again(tmp_path, monkeypatch, capsys):
    """Rule: a run whose every round was skipped ends with summary.json saying so
    (`all_rounds_skipped`); the sweep neither counts nor reports it as done and exits 1, and the
    next `fedsim sweep` runs it again from the start, leaving the finished runs alone."""
    import fedsim.engine.simulate as simulation
    from fedsim.client.app import make_client_app
    from fedsim.flower.local_grid import LocalGrid
    from fedsim.server.app import run_server

    failing_seeds = {1}

    def simulate(scenario, run_dir, progress=None, **_):  # the in-process grid instead of Ray
        n = scenario.federation.num_clients
        fail = range(n) if scenario.seed in failing_seeds else ()
        run_server(LocalGrid(make_client_app(scenario), n, fail=fail), scenario, run_dir, progress,
                   checkpoints=scenario.output.checkpoints)
        return run_dir

    monkeypatch.setattr(simulation, "simulate", simulate)
    sweep = tmp_path / "tiny.yaml"
    sweep.write_text(SWEEP.format(base=QUICKSTART))
    argv = ["sweep", str(sweep), "--output", str(tmp_path / "out")]
    assert main(argv) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert "1 of 2 runs trained nothing" in err and "seed_1:" in err and "device out of memory" in err
    failed, good = tmp_path / "out/tiny/seed_1", tmp_path / "out/tiny/seed_2"
    assert json.loads((failed / "summary.json").read_text())["all_rounds_skipped"] is True
    assert json.loads((good / "summary.json").read_text())["all_rounds_skipped"] is False
    stamp = (good / "summary.json").stat().st_mtime_ns

    failing_seeds.clear()  # whatever broke the clients is fixed
    assert main(argv) == 0
    assert "1 that trained nothing last time run again" in " ".join(capsys.readouterr().out.split())
    rounds = read_rounds(failed)
    assert [r["round"] for r in rounds if r["round"] > 0] == [1, 2] and not any(r.get("skipped") for r in rounds)
    assert json.loads((failed / "summary.json").read_text())["all_rounds_skipped"] is False
    assert (good / "summary.json").stat().st_mtime_ns == stamp  # not run again
    assert main(argv) == 0  # nothing left to do


def test_the_serverapp_under_flwr_run_fails_a_run_that_trained_nothing_and_logs_each_round(tmp_path, caplog):
    """The deployment ServerApp (scenario from the run config) raises, so that Flower ends the run
    as failed (`fedsim deploy run` then exits 1: deploy.run_and_check); before that it logs each
    round's row through Flower's logger, which `flwr run --stream` shows."""
    from fedsim.client.app import make_client_app
    from fedsim.flower.local_grid import LocalGrid
    from fedsim.scenario import load_scenario
    from fedsim.server.app import make_server_app

    overrides = SMALL + ["evaluation.initial=true"]
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                      run_config={"scenario": "scenarios/quickstart.yaml", "overrides": ";".join(overrides),
                                  "output-dir": str(tmp_path)})
    grid = LocalGrid(make_client_app(load_scenario(QUICKSTART, overrides)), 3, fail=[0, 1, 2])
    with caplog.at_level(logging.INFO, logger="flwr"), pytest.raises(RuntimeError, match="every round was skipped") as info:
        make_server_app()(grid, context)
    assert "device out of memory" in str(info.value)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("fedsim round")]
    assert [line.split(":")[0] for line in lines] == ["fedsim round 0/2", "fedsim round 1/2", "fedsim round 2/2"]
    assert lines[1].startswith("fedsim round 1/2: acc ") and "| rejected 3 (skipped) |" in lines[1] and "| MB up " in lines[1]
    summary = json.loads(next(tmp_path.glob("*/summary.json")).read_text())
    assert summary["all_rounds_skipped"] is True and summary["rounds_skipped"] == [1, 2]
