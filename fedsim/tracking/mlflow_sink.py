"""MLflow: a run in a tracking store, written through `MlflowClient` (never the fluent API, whose
one active run per process would tie runs in one process, such as tests, to each other).

The default store is a SQLite database in the run folder: MLflow 3 refuses a plain `file:` store
unless MLFLOW_ALLOW_FILE_STORE is set (it is in maintenance mode), and a database shared by the
parallel runs of a sweep could lock. To compare many runs in one MLflow UI, point `uri` (or
MLFLOW_TRACKING_URI) at one `mlflow server`. The run's id is kept in the run folder's
tracking.json: a resumed run continues the same MLflow run.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from pydantic import Field

from fedsim.registry import TRACKING_SINKS
from fedsim.tracking.base import Sink, SinkParams, param_text

CUT = "...[cut]"


class MLflowParams(SinkParams):
    uri: str | None = Field(
        None, description="tracking URI (an `mlflow server`'s http://host:port, sqlite:///file.db); default: "
        "$MLFLOW_TRACKING_URI, else sqlite:///<run folder>/mlflow.db")
    experiment: str | None = Field(None, description="experiment name (default: the scenario's name)")


def param_value(value: Any, limit: int) -> str:
    """A parameter as MLflow stores it: text of at most `limit` characters (MLflow refuses longer ones)."""
    text = param_text(value)
    return text if len(text) <= limit else text[: limit - len(CUT)] + CUT


def batches(items: list, size: int):
    for start in range(0, len(items), size):
        yield items[start : start + size]


@TRACKING_SINKS.register("mlflow", MLflowParams, requires=("mlflow",))
class MLflowSink(Sink):
    """An MLflow run: per-round metrics, the scenario as params, the summary metrics, the report's figure as an artifact."""

    def uri(self) -> tuple[str, bool]:
        """The tracking URI, and whether it is the default store inside the run folder."""
        given = self.spec.uri or os.environ.get("MLFLOW_TRACKING_URI")
        return (given, False) if given else (f"sqlite:///{(self.run_dir / 'mlflow.db').resolve()}", True)

    def open(self, params: dict[str, Any], first_step: int, resumed: bool = False) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        uri, in_run_folder = self.uri()
        self.client = MlflowClient(tracking_uri=uri)
        if resumed and self.state.get("uri") == uri and self.state.get("run_id"):
            self.run_id = self.state["run_id"]  # a resumed run: the same MLflow run goes on
            self.client.update_run(self.run_id, status="RUNNING")
            return
        experiment = self.experiment_id(self.spec.experiment or params["name"], in_run_folder)  # params["name"]: the scenario's
        run = self.client.create_run(experiment, run_name=self.name, tags={"fedsim.run_dir": str(self.run_dir.resolve())})
        self.run_id = run.info.run_id
        self.state.update(uri=uri, run_id=self.run_id)
        values = [Param(k, param_value(v, MAX_PARAM_VAL_LENGTH)) for k, v in params.items()]
        for batch in batches(values, MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(self.run_id, params=batch)

    def experiment_id(self, name: str, in_run_folder: bool) -> str:
        """The experiment's id, made if missing; in the default store its artifacts stay in the run
        folder (MLflow's default for a SQLite store is ./mlartifacts under the current directory)."""
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        location = (self.run_dir / "mlartifacts").resolve().as_uri() if in_run_folder else None
        try:
            return self.client.create_experiment(name, artifact_location=location)
        except Exception:  # another run (a sweep's parallel job) made it meanwhile
            found = self.client.get_experiment_by_name(name)
            if found is None:
                raise
            return found.experiment_id

    def _log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric
        from mlflow.utils.validation import MAX_METRICS_PER_BATCH

        now = int(time.time() * 1000)
        values = [Metric(k, v, now, step) for k, v in metrics.items()]
        for batch in batches(values, MAX_METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=batch)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self._log(metrics, step)

    def finish(self, summary: dict[str, float], step: int, plots: list[Path]) -> None:
        self._log({f"summary/{k}": v for k, v in summary.items()}, step)
        for plot in plots:
            self.client.log_artifact(self.run_id, str(plot), "plots")
        self.client.set_terminated(self.run_id, "FINISHED")

    def close(self) -> None:
        self.client.set_terminated(self.run_id, "KILLED")
