"""TensorBoard: event files written with torch's SummaryWriter (the `tensorboard` package behind it).

One folder of event files per run folder. A resumed run appends to the same folder with
`purge_step` set to its first round, so TensorBoard drops what an earlier start had logged for
rounds that are being redone (lines written after the last checkpoint of a killed run).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field

from fedsim.registry import TRACKING_SINKS
from fedsim.tracking.base import Sink, SinkParams, param_text


class TensorBoardParams(SinkParams):
    dir: str | None = Field(
        None, description="a folder shared by runs: this run's events go to <dir>/<run folder name>/ "
        "(default: the run folder's tensorboard/)")


@TRACKING_SINKS.register("tensorboard", TensorBoardParams, requires=("tensorboard",))
class TensorBoardSink(Sink):
    """TensorBoard event files: per-round scalars, the scenario as text and hparams, the report's figure as an image."""

    def logdir(self) -> Path:
        return Path(self.spec.dir) / self.name if self.spec.dir else self.run_dir / "tensorboard"

    def open(self, params: dict[str, Any], first_step: int, resumed: bool = False) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.params = params
        self.writer = SummaryWriter(log_dir=str(self.logdir()), purge_step=first_step)
        if not resumed:  # a resumed run's folder already has it
            rows = "\n".join(f"| {k} | {param_text(v)} |" for k, v in params.items())
            self.writer.add_text("scenario", "| parameter | value |\n|---|---|\n" + rows, 0)
            self.writer.flush()

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()  # visible in a running TensorBoard now, not at the 2-minute flush

    def finish(self, summary: dict[str, float], step: int, plots: list[Path]) -> None:
        from matplotlib.image import imread

        # hparams (HParams dashboard: runs compared by parameter) with the summary as its metrics;
        # run_name "." keeps them in this run's folder instead of a timestamped subfolder
        hparams = {k: v if isinstance(v, (int, float, str, bool)) or v is None else param_text(v) for k, v in self.params.items()}
        self.writer.add_hparams(hparams, {f"summary/{k}": v for k, v in summary.items()}, run_name=".", global_step=step)
        for plot in plots:
            self.writer.add_image(f"plots/{plot.stem}", imread(plot), step, dataformats="HWC")
        self.writer.close()

    def close(self) -> None:
        self.writer.close()
