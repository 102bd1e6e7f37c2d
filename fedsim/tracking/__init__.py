"""Tracking sinks: a run's rounds, scenario and summary copied into TensorBoard, MLflow or W&B.

Configured by the scenario's `tracking` list (docs/tracking.md). Importing this package registers
the sinks and their parameter models (the scenario schema needs them, on clients too); each
tracking library is imported only by its sink on the server, when a run that names it starts.
"""

from fedsim.tracking import mlflow_sink, tensorboard_sink, wandb_sink  # noqa: F401  (register the sinks)
from fedsim.tracking.base import SINKS, TrackingUnavailable
from fedsim.tracking.trackers import Trackers, require_libraries

__all__ = ["SINKS", "Trackers", "TrackingUnavailable", "require_libraries"]
