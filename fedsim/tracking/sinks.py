"""Importing this registers the tracking sinks (fedsim.registry.TRACKING_SINKS) and their parameter
models, which the scenario's schema needs on clients too: no tracking library is imported here."""

from fedsim.tracking import mlflow_sink, tensorboard_sink, wandb_sink  # noqa: F401  (registers)
