"""The device install's files in deploy/: requirements, Dockerfile and systemd unit (issue #21).

Neither docker nor hadolint runs here, so the Dockerfile's essentials are checked by a small
parser; every flower-supernode flag the Dockerfile and the unit pass is checked against the
installed flower-supernode's own `--help`.
"""

from __future__ import annotations

import configparser
import json
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
REQUIREMENTS = "deploy/device-requirements.txt"
RECIPE = (f"pip install -r {REQUIREMENTS}", "pip install --no-deps .")
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
NOT_ON_A_DEVICE = {"ray", "flwr-datasets", "datasets", "scikit-learn", "scipy", "pandas", "pyarrow", "matplotlib"}


def device_requirements() -> list[Requirement]:
    lines = (REPO / REQUIREMENTS).read_text().splitlines()
    return [Requirement(line) for line in lines if line.strip() and not line.lstrip().startswith("#")]


def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(line for line in (DEPLOY / "Dockerfile").read_text().splitlines()
                                            if not line.lstrip().startswith("#")))
    out = []
    for line in text.splitlines():
        if line.strip():
            keyword, _, args = line.strip().partition(" ")
            out.append((keyword.upper(), args.strip()))
    return out


def instructions(keyword: str) -> list[str]:
    return [args for k, args in dockerfile() if k == keyword]


def unit() -> configparser.ConfigParser:
    parser = configparser.ConfigParser(interpolation=None, strict=True)
    parser.optionxform = str  # systemd keys are case-sensitive
    parser.read_string((DEPLOY / "fedsim-supernode.service").read_text())
    return parser


@pytest.fixture(scope="module")
def supernode_flags() -> set[str]:
    exe = Path(sys.executable).parent / "flower-supernode"
    out = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return set(re.findall(r"(?<![\w-])--[a-z][a-z-]+", out.stdout))


def flags(argv: list[str]) -> set[str]:
    return {a for a in argv if a.startswith("--")}


def node_config(argv: list[str]) -> str:
    return argv[argv.index("--node-config") + 1]


# ----------------------------------------------------------------------------- requirements


def test_device_requirements_are_the_projects_own_pins_without_the_heavy_ones():
    deps = {canonicalize_name(r.name): r for r in map(Requirement, pyproject()["project"]["dependencies"])}
    reqs = device_requirements()
    names = {canonicalize_name(r.name) for r in reqs}
    assert {"torch", "flwr", "numpy", "pydantic", "pyyaml"} <= names
    assert not names & NOT_ON_A_DEVICE
    for req in reqs:
        assert not req.extras, f"{req}: no extras on a device (flwr[simulation] is Ray)"
        name = canonicalize_name(req.name)
        assert name in deps, f"{req.name} is not a dependency in pyproject.toml"
        assert req.specifier == deps[name].specifier, f"{req} differs from pyproject.toml's {deps[name]}"
    torch = [line for line in (REPO / REQUIREMENTS).read_text().splitlines() if line.startswith("torch==")]
    assert len(torch) == 1, "the Dockerfile installs torch from the one `torch==` line (grep)"


# ----------------------------------------------------------------------------- Dockerfile


def test_dockerfile_starts_from_a_tagged_python_3_11_slim_image():
    (base,) = instructions("FROM")
    image, _, tag = base.partition(":")
    assert image == "python" and tag.startswith("3.11-slim") and tag != "latest"


def pip_installs() -> list[list[str]]:
    """Every `pip install` the Dockerfile runs, as words, in order, without `--no-cache-dir` (image size only)."""
    commands = [shlex.split(part) for run in instructions("RUN") for part in run.split("&&")]
    return [[w for w in words if w != "--no-cache-dir"] for words in commands if words[:2] == ["pip", "install"]]


def test_dockerfile_installs_the_documented_recipe_after_torchs_cpu_wheel():
    installs = pip_installs()
    steps = [step.split() for step in RECIPE]
    torch = ["pip", "install", "--index-url", TORCH_CPU_INDEX, f"$(grep '^torch==' {REQUIREMENTS})"]
    assert installs == [torch, *steps], f"the Dockerfile's pip commands differ from the recipe: {installs}"


def test_dockerfile_copies_what_the_install_needs_and_it_exists():
    copied = set()
    for args in instructions("COPY"):
        *sources, _ = args.split()
        for src in sources:
            assert (REPO / src).exists(), f"COPY {src}: no such file in the build context (the repository root)"
            copied.add(src.rstrip("/"))
    project = pyproject()
    needed = {REQUIREMENTS, "pyproject.toml", project["project"]["readme"], "fedsim",
              *project["tool"]["setuptools"]["package-dir"].values()}
    assert needed <= copied, f"not copied: {sorted(needed - copied)}"


def test_dockerfile_runs_flower_supernode_as_a_non_root_user_with_volumes(supernode_flags):
    order = [k for k, _ in dockerfile()]
    users = instructions("USER")
    assert users and users[-1] not in {"root", "0"} and order.index("USER") < order.index("ENTRYPOINT")
    (entrypoint,) = instructions("ENTRYPOINT")
    argv = json.loads(entrypoint) + json.loads(instructions("CMD")[-1])
    assert argv[0] == "flower-supernode"
    assert flags(argv) <= supernode_flags, f"unknown to flower-supernode: {flags(argv) - supernode_flags}"
    volumes = {v for args in instructions("VOLUME") for v in json.loads(args)}
    for key in ("state-dir", "data-dir"):
        folder = re.search(rf'{key}="([^"]+)"', node_config(argv)).group(1)
        assert folder in volumes, f"{key} {folder} is not a volume"
    env = " ".join(instructions("ENV"))
    assert re.search(r"FEDSIM_CACHE_DIR=(\S+)", env).group(1) in volumes, "the partition cache is not a volume"


# ----------------------------------------------------------------------------- systemd unit


def test_unit_file_parses_with_the_required_keys(supernode_flags):
    u = unit()
    assert u["Unit"]["Description"] and u["Install"]["WantedBy"] == "multi-user.target"
    service = u["Service"]
    assert service["Restart"] == "on-failure"
    assert service["User"] not in {"root", "0"} and service["EnvironmentFile"]
    argv = shlex.split(service["ExecStart"])
    assert Path(argv[0]).name == "flower-supernode"
    assert flags(argv) <= supernode_flags, f"unknown to flower-supernode: {flags(argv) - supernode_flags}"
    assert "--health-server-address" in argv
    assert re.search(r"partition-id=\S+", node_config(argv)) and 'state-dir="' in node_config(argv)
    path = re.search(r"PATH=(\S+)", service["Environment"]).group(1)
    assert path.split(":")[0] == str(Path(argv[0]).parent), "flower-supernode starts flwr-clientapp from PATH"


def test_unit_file_variables_are_all_in_the_example_environment_file():
    used = set(re.findall(r"\$\{(\w+)\}", unit()["Service"]["ExecStart"]))
    lines = (DEPLOY / "fedsim-supernode.env").read_text().splitlines()
    defined = {line.split("=", 1)[0] for line in lines if "=" in line and not line.startswith("#")}
    assert used and used <= defined, f"not in deploy/fedsim-supernode.env: {sorted(used - defined)}"


def test_the_doc_gives_the_same_recipe():
    doc = (REPO / "docs" / "device_install.md").read_text()
    for step in RECIPE:
        assert step in doc
