"""An in-memory link state with one run, set up the way Flower's `run_simulation` sets it up: what
the engine tests (test_engine_adjustments.py, test_unsampled_clients.py) drive fedsim's engine
adjustments against. Test scaffolding that reaches into Flower's link state, as those tests do."""

from __future__ import annotations

from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.proto.task_pb2 import Task  # pylint: disable=E0611
from flwr.server.superlink.linkstate import LinkStateFactory
from flwr.server.superlink.linkstate.in_memory_linkstate import RunRecord
from flwr.supercore.constant import FLWR_IN_MEMORY_DB_NAME, NOOP_FEDERATION_ID
from flwr.supercore.object_store import ObjectStoreFactory
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity
from flwr.superlink.federation import NoOpFederationManager
from flwr.superlink.grid import InMemoryGrid


def empty_link_state(run_id: int, task_id: int):
    """(state, its factory, an in-memory grid on it, the run): no node registered yet."""
    factory = LinkStateFactory(FLWR_IN_MEMORY_DB_NAME, NoOpFederationManager(), ObjectStoreFactory())
    state = factory.state()
    run = Run.create_empty(run_id=run_id)
    run.primary_task_id = task_id
    run.federation_id = NOOP_FEDERATION_ID
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, run.run_id, SUPERLINK_NODE_ID
    state.run_ids[run.run_id] = RunRecord(run=run)
    state.task_store[task_id] = Task(task_id=task_id, run_id=run.run_id)
    grid = InMemoryGrid(state_factory=factory)
    grid.set_run(run)
    return state, factory, grid, run
