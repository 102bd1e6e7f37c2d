"""A scenario's ClientApp with a hook that runs before each training message (to inject failures)."""

from __future__ import annotations

from typing import Callable

from flwr.clientapp import ClientApp

from fedsim.client.app import make_client_app


def client_app_with_failures(scenario, before_train: Callable[[int, int], None]) -> ClientApp:
    """`before_train(partition_id, server_round)` runs first in every train handler; it may raise
    or kill the process, and what it returns (a large tensor, say) is held until the training
    ends. Queries and everything else go to the scenario's own ClientApp."""
    inner = make_client_app(scenario)
    app = ClientApp()

    @app.query()
    def query(msg, context):
        return inner(msg, context)

    @app.train()
    def train(msg, context):
        held = before_train(int(context.node_config["partition-id"]), int(msg.content["config"]["server-round"]))
        try:
            return inner(msg, context)
        finally:
            del held

    return app
