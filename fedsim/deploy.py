"""Real deployment on Flower's deployment engine: a SuperLink, SuperNodes on devices, `flwr run`.

These helpers only build the standard Flower command lines (printed by `fedsim deploy ... --dry-run`)
and the connection entry `flwr run` needs; the ServerApp and ClientApp are the very ones the
simulation runs. Security: TLS with SuperNode authentication unless `--insecure` is given, which
is meant for loopback tests only.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

APP_DIR = Path(__file__).resolve().parent.parent
QUIET_ENV = {
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",  # never `uv sync` a different torch at run time
}


@dataclass(frozen=True)
class Tls:
    """Certificates for a TLS SuperLink: the CA that signed the server certificate, and that certificate."""

    ca_cert: Path
    server_cert: Path | None = None
    server_key: Path | None = None


def superlink_cmd(host: str = "127.0.0.1", port: int = 8000, tls: Tls | None = None, auth: bool = True,
                  database: Path | None = None) -> list[str]:
    cmd = ["flower-superlink", "--host", host, "--port", str(port), "--disable-runtime-dependency-installation"]
    if tls is None:
        cmd.append("--insecure")
    else:
        cmd += ["--ssl-ca-certfile", str(tls.ca_cert), "--ssl-certfile", str(tls.server_cert), "--ssl-keyfile", str(tls.server_key)]
        if auth:
            cmd.append("--enable-supernode-auth")
    if database is not None:
        cmd += ["--database", str(database)]
    return cmd


def supernode_cmd(partition: int, num_partitions: int, superlink: str = "127.0.0.1:8000", port: int | None = None,
                  root_cert: Path | None = None, auth_key: Path | None = None, data_dir: Path | None = None,
                  max_retries: int | None = None) -> list[str]:
    """A SuperNode holding partition `partition` of `num_partitions` (its node config)."""
    node_config = f"partition-id={partition} num-partitions={num_partitions}"
    if data_dir is not None:
        node_config += f' data-dir="{data_dir}"'
    cmd = ["flower-supernode", "--superlink", superlink, "--port", str(port if port is not None else 9094 + partition),
           "--node-config", node_config]
    cmd += ["--insecure"] if root_cert is None else ["--root-certificates", str(root_cert)]
    if auth_key is not None:
        cmd += ["--auth-supernode-private-key", str(auth_key)]
    if max_retries is not None:
        cmd += ["--max-retries", str(max_retries)]
    return cmd


def write_connection(flwr_home: Path, name: str, address: str, root_cert: Path | None = None) -> Path:
    """Add (or replace) `[superlink.<name>]` in `$FLWR_HOME/config.toml`, the way `flwr run` finds a SuperLink."""
    if not re.fullmatch(r"[A-Za-z0-9_-]+", name):
        raise ValueError(f"connection name {name!r} must be letters, digits, '-' or '_'")
    path = Path(flwr_home) / "config.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    text = path.read_text() if path.exists() else ""
    text = re.sub(rf"(?ms)^\[superlink\.{name}\]\n.*?(?=^\[|\Z)", "", text).rstrip()
    entry = f'\n\n[superlink.{name}]\naddress = "{address}"\n'
    entry += "insecure = true\n" if root_cert is None else f'root-certificates = "{Path(root_cert).resolve()}"\n'
    path.write_text((text + entry).lstrip())
    return path


def run_cmd(connection: str, scenario: Path, overrides: list[str] | None = None, output_dir: Path | None = None,
            stream: bool = True) -> list[str]:
    """`flwr run` of this app against a connection, with the scenario chosen by run config."""
    joined = ";".join(overrides or []).replace('"', "'")
    config = f'scenario="{Path(scenario).resolve()}" overrides="{joined}"'
    if output_dir is not None:
        config += f' output-dir="{Path(output_dir).resolve()}"'
    cmd = ["flwr", "run", str(APP_DIR), connection, "--run-config", config]
    return cmd + (["--stream"] if stream else [])


def deploy_env(flwr_home: Path | None = None) -> dict[str, str]:
    env = dict(os.environ, **QUIET_ENV)
    if flwr_home is not None:
        env["FLWR_HOME"] = str(flwr_home)
    return env
