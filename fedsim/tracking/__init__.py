"""Tracking sinks: a run's rounds, scenario and summary copied into TensorBoard, MLflow or W&B.

Configured by the scenario's `tracking` list (docs/tracking.md). The sinks register in
fedsim.registry.TRACKING_SINKS (fedsim/tracking/sinks.py); `trackers.Trackers` drives them for a
run. Each tracking library is imported only by its sink on the server, when a run that names it
starts. Imports nothing at package level, so registering the sinks stays light.
"""
