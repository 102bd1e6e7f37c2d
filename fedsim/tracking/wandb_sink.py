"""Weights & Biases: a W&B run, offline by default (no account, nothing leaves the machine until
`wandb sync`). Each run is its own `wandb.init(reinit="create_new")` object, logged through its
methods only, so runs in one process never finish each other. W&B's capture of the console is
off: fedsim's own output stays as it is.

The run's id is kept in the run folder's tracking.json; a resumed run starts W&B again with that
id (`resume="allow"`): offline, that is a second offline folder under the same run id.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from fedsim.registry import TRACKING_SINKS
from fedsim.tracking.base import Sink, SinkParams


class WandbParams(SinkParams):
    mode: Literal["offline", "online"] = Field(
        "offline", description="offline: written under <dir>/wandb/ for `wandb sync`; online: needs `wandb login` or $WANDB_API_KEY")
    project: str | None = Field(None, description="W&B project (default: the scenario's name)")
    dir: str | None = Field(None, description="folder W&B writes its wandb/ folder into (default: the run folder)")


@TRACKING_SINKS.register("wandb", WandbParams, requires=("wandb",))
class WandbSink(Sink):
    """A Weights & Biases run (offline by default): per-round history, the scenario as config, the summary, the report's figure."""

    def open(self, params: dict[str, Any], first_step: int, resumed: bool = False) -> None:
        import wandb

        folder = Path(self.spec.dir) if self.spec.dir else self.run_dir
        folder.mkdir(parents=True, exist_ok=True)
        resume = resumed and self.state.get("id")
        self.run = wandb.init(
            mode=self.spec.mode, project=self.spec.project or params["name"], name=self.name, dir=str(folder),
            config=params, id=self.state["id"] if resume else None, resume="allow" if resume else None,
            settings=wandb.Settings(console="off", silent=True, reinit="create_new", save_code=False),
        )
        self.state["id"] = self.run.id
        self.step = first_step

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)
        self.step = step

    def finish(self, summary: dict[str, float], step: int, plots: list[Path]) -> None:
        import wandb

        self.run.summary.update({f"summary/{k}": v for k, v in summary.items()})
        if plots:  # at the last round's step: W&B ignores a step lower than one already logged
            self.run.log({f"plots/{p.stem}": wandb.Image(str(p)) for p in plots}, step=max(step, self.step))
        self.run.finish(exit_code=0)

    def close(self) -> None:
        self.run.finish(exit_code=1)
