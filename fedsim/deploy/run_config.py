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

    The federation clock (`systems:`) simulates devices, networks and time; on real devices the
    clock is the real one, so the section is refused rather than half applied (its deadline and
    over-selection would have to be Flower's own round timeout and sampling: use
    federation.round_timeout for a reporting deadline there). One use of it runs on real devices:
    `systems.round` choosing an asynchronous protocol (fedasync, fedbuff), with nothing else in the
    section; its steps then follow the replies as they really come (fedsim/server/live.py)."""
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
