"""Finding the scenario when the apps run under `flwr run` (no Python closure to carry it).

The run config key `scenario` names a YAML file. `fedsim deploy run` ships it inside the Flower
app bundle (FAB) and names it by its path relative to the app directory; on the SuperLink and on
every SuperNode the FAB is unpacked elsewhere (`$FLWR_HOME/apps/<app>/`), so a relative path is
resolved against the app directory *there* (see `app_dirs`), then as `fedsim run` resolves one
(the working directory, then the ready scenarios). An absolute path names a file on the machine
that runs the app (a plain `flwr run` may pass one). `overrides` holds `--set` style `a.b=value`
pairs separated by `;` (values may contain spaces, as YAML flow mappings do).
"""

from __future__ import annotations

import sys
from pathlib import Path

from flwr.app import Context

from fedsim.clock.asynchrony import ASYNCHRONOUS
from fedsim.deploy.commands import flower_app_config, source_app_dir
from fedsim.scenario import ScenarioError, load_scenario


def app_dirs() -> list[Path]:
    """Where this run's app files may lie, most likely first.

    flwr 1.41 puts the directory it unpacked the FAB into on `sys.path` (first, unless already
    there) before it imports the ServerApp or ClientApp named in `[tool.flwr.app.components]`
    (`load_app(..., project_dir)`), and passes the apps no other trace of it. fedsim itself may
    come from that directory (fedsim's own tree is the app) or from an installed package (the app
    is a project of the user's that names fedsim's components). So: the Flower apps on
    `sys.path`, in its order, then fedsim's own source tree.
    """
    found: list[Path] = []
    for entry in sys.path:
        try:
            directory = Path(entry or ".").resolve()
            if directory not in found and flower_app_config(directory) is not None:
                found.append(directory)
        except (OSError, ValueError):  # an unreadable entry or pyproject: not an app
            continue
    source = source_app_dir()
    if source is not None and source not in found:
        found.append(source)
    return found


def scenario_path(value: str) -> Path:
    """The file the run config's `scenario` names, on this machine."""
    from fedsim.scenario_files import resolve_scenario_path

    path = Path(value)
    if path.is_absolute():
        return path
    dirs = app_dirs()
    for directory in dirs:
        if (directory / path).is_file():
            return directory / path
    fallback = resolve_scenario_path(path)  # the working directory, then the ready scenarios
    if fallback.is_file():
        return fallback
    raise ScenarioError("run config", [("scenario", "not in the app directory the FAB was unpacked into, nor a ready "
                                        f"scenario; looked in {', '.join(map(str, dirs)) or 'no app directory'}. "
                                        "A file the FAB leaves out (.gitignore, fab-exclude, not .yaml) never arrives", value)])


def deployable(scenario, source: str):
    """The scenario, if it can run on real devices; else ScenarioError naming the field.

    Privacy attacks are refused: the server's probe scores what it recovers against the clients'
    true data, which a deployment's server does not have.

    The federation clock (`systems:`) simulates devices, networks and time; on real devices the
    clock is the real one, so the section is refused rather than half applied (its deadline and
    over-selection would have to be Flower's own round timeout and sampling: use
    federation.round_timeout for a reporting deadline there). One use of it runs on real devices:
    `systems.round` choosing an asynchronous protocol (fedasync, fedbuff), with nothing else in the
    section; its steps then follow the replies as they really come (fedsim/server/live.py)."""
    if scenario.privacy_attacks:  # they score what they recover against the clients' true data
        raise ScenarioError(source, [("privacy_attacks", "score reconstructions against the clients' own data, which "
                                      "only a simulation holds: drop privacy_attacks for a deployment (docs/leakage.md)",
                                      [a.name for a in scenario.privacy_attacks])])
    systems = scenario.systems
    if systems is None:
        return scenario
    if isinstance(systems.round, ASYNCHRONOUS):
        simulated = sorted(systems.model_fields_set - {"round"})
        if simulated:
            raise ScenarioError(source, [(f"systems.{simulated[0]}", "simulates devices, networks or time; a "
                                          f"deployment runs on real devices and the real clock, where systems: may only "
                                          f"choose an asynchronous round (systems.round={systems.round.name}): drop "
                                          f"{', '.join('systems.' + f for f in simulated)}", simulated[0])])
        return scenario
    raise ScenarioError(source, [("systems", "simulates devices, networks and a clock; a deployment runs on real "
                                  "devices and the real clock: drop the section (federation.round_timeout is the "
                                  "reporting deadline there), or keep only an asynchronous systems.round "
                                  "(fedasync, fedbuff)", "systems")])


def scenario_from_context(context: Context):
    cfg = context.run_config
    if "scenario" not in cfg:
        raise ValueError("run config has no 'scenario' key naming the scenario YAML file")
    overrides = [item.strip() for item in str(cfg.get("overrides", "")).split(";") if item.strip()]
    path = scenario_path(str(cfg["scenario"]))
    return deployable(load_scenario(path, overrides), str(path))


# --- resuming a deployed run (`fedsim deploy run --resume DIR`) -------------------------------------
# What the ServerApp was started with, kept in its run folder so that `fedsim deploy run --resume
# DIR` (on the ServerApp's machine) can start the same run again without the scenario and `--set`s.
RUN_CONFIG_FILE = "run_config.json"


def record_run_config(folder, context: Context) -> None:
    """Write the run config's scenario and overrides into the run folder (RUN_CONFIG_FILE)."""
    import json

    from fedsim.runs.atomic import write_text_atomic

    cfg = context.run_config
    data = {"scenario": str(cfg.get("scenario", "")), "overrides": str(cfg.get("overrides", ""))}
    write_text_atomic(Path(folder.path) / RUN_CONFIG_FILE, json.dumps(data, indent=1) + "\n")


def read_run_config(run_dir: Path) -> tuple[str, list[str]]:
    """The scenario (relative to the app directory) and the overrides a deployed run was started
    with, from its run folder; DeployError when the folder holds none (not on this machine, or
    not a deployed run)."""
    import json

    from fedsim.deploy.commands import DeployError

    path = Path(run_dir) / RUN_CONFIG_FILE
    try:
        data = json.loads(path.read_text())
        scenario, overrides = str(data["scenario"]), str(data["overrides"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise DeployError(f"{path} cannot be read ({type(err).__name__}: {err}): --resume DIR needs the run folder "
                          "of a deployed run on this machine; elsewhere pass the scenario and the --set options "
                          "of the first run as well: fedsim deploy run FILE --set ... --resume DIR") from None
    return scenario, [item.strip() for item in overrides.split(";") if item.strip()]


def resumed_folder(run_dir: str, scenario):
    """The run folder a deployed ServerApp continues (run config `resume-dir`), checked against the
    scenario the run config names: the SuperNodes train on that one, so it must be the scenario the
    folder's rounds were trained on (its scenario.yaml; `output` aside, which says where results go)."""
    from fedsim.runs.folder import RunFolder
    from fedsim.scenario import read_yaml, scenario_dict, validate_scenario

    folder = RunFolder(Path(run_dir))
    if not folder.scenario_file.is_file():
        raise ScenarioError("run config", [("resume-dir", "is not a run folder on the ServerApp's machine (no "
                                            "scenario.yaml there)", run_dir)])
    kept = validate_scenario(read_yaml(folder.scenario_file), str(folder.scenario_file))
    before, now = scenario_dict(kept), scenario_dict(scenario)
    differs = sorted(k for k in before.keys() | now.keys() if k != "output" and before.get(k) != now.get(k))
    if differs:
        raise ScenarioError("run config", [("resume-dir", f"its scenario.yaml differs from the scenario and overrides "
                                            f"of this run in {', '.join(differs)}: resume with the scenario and --set "
                                            "options the run was started with", run_dir)])
    if not kept.output.checkpoints:
        raise ScenarioError("run config", [("resume-dir", "the run was started with output.checkpoints off: it kept "
                                            "no checkpoint to resume from", run_dir)])
    if isinstance(getattr(kept.systems, "round", None), ASYNCHRONOUS):
        raise ScenarioError("run config", [("resume-dir", f"an asynchronous round (systems.round="
                                            f"{kept.systems.round.name}) cannot resume on a SuperLink: its messages in "
                                            "flight were the link's and are gone; start the run again", run_dir)])
    return folder
