"""fedsim: simulate federated learning under attack, and defend it."""

from pathlib import Path as _Path

__version__ = "0.1.0"

# The component folders aggregators/, attacks/, defenses/ and leakage/ sit at the repository's top
# level (the project's published layout) and are installed as fedsim.aggregators, fedsim.attacks,
# fedsim.defenses and fedsim.leakage (pyproject.toml: package-dir). Run from a source tree, or from the Flower app
# bundle `flwr run` ships to the SuperLink (the same layout), they are found beside this package.
_HERE = _Path(__file__).resolve().parent
if not (_HERE / "aggregators").is_dir() and (_HERE.parent / "aggregators" / "__init__.py").is_file():
    __path__.append(str(_HERE.parent))  # noqa: F821 - a package's __path__
