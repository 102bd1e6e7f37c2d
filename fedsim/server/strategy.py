"""ScenarioStrategy: the scenario's rounds as a Flower Message-API strategy, and nothing more.

Flower's own `Strategy.start` runs the round loop. Each round the strategy opens the round in the
driver (fedsim/server/driver.py: sampling, instructions, the record), lets the scenario's round
protocol exchange messages (its registered `exchange`: fedsim/server/exchange.py for `plain`,
fedsim/server/secure.py, fedsim/fedma/exchange.py), and closes the round
(fedsim/server/closing.py: checkpoint, central evaluation, the line in rounds.jsonl). No protocol
subclasses it; what a round is made of lives in those modules, testable without Flower.
"""

from __future__ import annotations

import logging
from typing import Callable, Iterable

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fedsim.flower.options import EngineOptions
from fedsim.registry import protocol_for
from fedsim.runs.folder import RunFolder
from fedsim.server.closing import RoundCloser
from fedsim.server.driver import RoundDriver
from fedsim.server.nodes import NodeDirectory, discover_nodes
from fedsim.wire import pack_model

log = logging.getLogger("fedsim")


class ScenarioStrategy(Strategy):
    def __init__(
        self, runtime, on_round: Callable[[dict], None] | None = None, checkpoint_to: RunFolder | None = None,
        options: EngineOptions = EngineOptions(), node_map: Callable | None = None, defer_last_round: bool = False,
        real_clock: bool = False, run_folder: RunFolder | None = None,
    ) -> None:
        self.scenario = runtime.scenario
        self.protocol = protocol_for(self.scenario)  # the registered round protocol: its exchange does the messages
        self.driver = RoundDriver(runtime, checkpoint_to, largest_first=options.largest_first,
                                  update_pipeline=self.protocol.traits.update_pipeline, real_clock=real_clock,
                                  run_folder=run_folder)
        self.node_of = NodeDirectory()  # partition id -> node id (filled by discover_nodes)
        self.exchange = self.protocol.load("exchange")(self.driver, self.node_of)
        self.closer = RoundCloser(self.driver, on_round, options.overlap_evaluation, defer_last_round)
        self.node_map = node_map  # fedsim's simulation: (grid, timeout) -> {partition id: node id}

    def discover_nodes(self, grid: Grid, timeout: float) -> None:
        self.node_of.use(discover_nodes(grid, self.scenario.federation.num_clients, timeout, self.node_map))

    def resume_from(self, state: dict) -> None:
        self.driver.resume_from(state)

    def arrays(self) -> ArrayRecord:
        """The global model as Flower hands it from round to round (the exchanges send their own messages)."""
        return pack_model(self.driver.global_vec, self.driver.layout)

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        rnd = server_round + self.driver.offset
        plan = self.exchange.open_round(rnd) if self.protocol.traits.opens_rounds else self.driver.open_round(rnd)
        return self.exchange.configure(plan, grid)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        aggregated = self.exchange.aggregate(list(replies))
        if aggregated is None:  # skipped: the record says why, the global model stays
            return None, None
        return self.arrays(), MetricRecord({"num-updates": aggregated})

    # --- no federated evaluation: the server evaluates centrally ------------------------------
    def configure_evaluate(self, server_round, arrays, config, grid):
        return []

    def aggregate_evaluate(self, server_round, replies):
        return None

    def summary(self) -> None:
        log.info("ScenarioStrategy: %s, protocol %s, aggregator %s, defenses %s", self.scenario.name, self.protocol.name,
                 self.scenario.aggregator.name, [d.name for d in self.scenario.defenses])

    # --- end of round: checkpoint, central evaluation and the round's line --------------------
    def end_round(self, server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        if server_round == 0 and self.driver.offset:
            return None  # a resumed run: round 0 was evaluated the first time
        metrics = self.closer.close(server_round + self.driver.offset)
        return None if metrics is None else MetricRecord(metrics)

    def wait_for_lines(self) -> None:
        """Block until every round's line is written (the last evaluation may still be running)."""
        self.closer.wait()
