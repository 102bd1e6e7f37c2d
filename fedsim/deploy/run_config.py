"""Finding the scenario when the apps run under `flwr run` (no Python closure to carry it).

The run config key `scenario` names a YAML file (relative paths are resolved against the app
directory, then the working directory); `overrides` holds `--set` style `a.b=value` pairs
separated by `;` (values may contain spaces, as YAML flow mappings do).
"""

from __future__ import annotations

from pathlib import Path

from flwr.app import Context

from fedsim.scenario import load_scenario

APP_DIR = Path(__file__).resolve().parents[2]  # the repository (the Flower app: pyproject.toml)


def scenario_from_context(context: Context):
    cfg = context.run_config
    if "scenario" not in cfg:
        raise ValueError("run config has no 'scenario' key naming the scenario YAML file")
    path = Path(str(cfg["scenario"]))
    if not path.is_absolute() and (APP_DIR / path).exists():
        path = APP_DIR / path
    overrides = [item.strip() for item in str(cfg.get("overrides", "")).split(";") if item.strip()]
    return load_scenario(path, overrides)
