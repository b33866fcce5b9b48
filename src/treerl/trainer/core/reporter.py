"""What a run shows and writes as it trains, on rank 0 only: progress bar, console lines, metrics, summary.json.

After step 6 (docs/architecture.md): what the run shows and writes.

Nothing is written into output_dir while the run sets up: metrics logged before its first step is trained (the
start evaluation's) are held, and written when `open` is called, once that step is done. A run that fails while it
sets up (a model, data row, reward, agent or server it cannot use, or a batch its first step refuses) leaves
output_dir as it was, so the fixed command runs in it as it is.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from tqdm.auto import tqdm

from treerl.distributed import DistEnv
from treerl.trainer.core.config import Config, to_yaml
from treerl.trainer.core.curves import plot_curves
from treerl.trainer.core.metrics import MetricsLogger, import_wandb, json_number


class Reporter:
    """The run's outputs for people: other ranks stay silent, so every line and file is written once."""

    def __init__(self, config: Config, env: DistEnv) -> None:
        self.config, self.env = config, env
        self.start_step = 0  # where the run starts (or resumed): TensorBoard drops the events it logged after it
        self.opened = False  # set by `open`, once the run's first step is trained
        self._bar: Any = None
        self._logger: MetricsLogger | None = None
        self._held: list[Callable[[MetricsLogger], None]] = []  # writes before `open`
        self._compression: list[float] = []  # each trained step's token compression T/U (the bar's `compression`)
        if config.trainer.wandb and env.is_main:
            import_wandb()  # not installed: an error now, not at the first metric

    def open(self) -> None:
        """The run's first step is trained: open metrics.jsonl and TensorBoard (rank 0) and write what was held."""
        if self.opened:
            return
        self.opened = True
        if not self.env.is_main:
            return
        trainer = self.config.trainer
        self._logger = MetricsLogger(trainer.output_dir, trainer.tensorboard, self.start_step,
                                     wandb_project=trainer.wandb_project if trainer.wandb else None,
                                     wandb_name=trainer.wandb_name, run_config=yaml.safe_load(to_yaml(self.config)))
        for write in self._held:
            write(self._logger)
        self._held = []

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """One row of metrics.jsonl (and TensorBoard), rank 0; held until `open`."""
        self._write(lambda logger: logger.log(step, metrics))

    def write_jsonl(self, name: str, rows: list[dict[str, Any]]) -> None:
        """Rows appended to another JSONL file of the run (dropped.jsonl), rank 0; held until `open`."""
        self._write(lambda logger: logger.write_jsonl(name, rows))

    def _write(self, write: Callable[[MetricsLogger], None]) -> None:
        if not self.env.is_main:
            return
        if self._logger is None:
            self._held.append(write)
        else:
            write(self._logger)

    def print(self, message: str) -> None:
        """A line on rank 0's console that does not break the progress bar."""
        if self.env.is_main:
            tqdm.write(message)

    def open_bar(self) -> None:
        """The progress bar over `trainer.steps`, from the start step (rank 0, unless trainer.progress=false)."""
        show = self.env.is_main and self.config.trainer.progress
        self._bar = tqdm(total=self.config.trainer.steps, initial=self.start_step, disable=not show,
                         desc="train", dynamic_ncols=True)

    def advance(self) -> None:
        """One step done on the progress bar."""
        self._bar.update(1)

    def close_bar(self) -> None:
        self._bar.close()

    def step(self, step: int, metrics: dict[str, float], postfix: dict[str, float] | None = None) -> None:
        """A step's metrics, logged every `trainer.log_every` steps and at the last; `postfix` on the progress bar
        (its `compression` kept for the last line)."""
        trainer = self.config.trainer
        if step % trainer.log_every == 0 or step + 1 == trainer.steps:
            self.log(step, metrics)
        if postfix and self._bar is not None:
            self._bar.set_postfix({k: f"{v:.3f}" for k, v in postfix.items()}, refresh=False)
        if not math.isnan(compression := (postfix or {}).get("compression", math.nan)):
            self._compression.append(compression)

    def summarise(self, summary: dict[str, Any], line: str) -> None:
        """The run's last line on the console (naming its curves), output_dir/summary.json (NaN written as null) and
        the curves drawn a last time; rank 0."""
        output = Path(self.config.trainer.output_dir)
        compression = self._compression_item()
        curves = self.plot()
        shown = f", curves in {curves}" if curves is not None else ""
        self.print(f"{line}{compression}; {summary['seconds']:.0f} s; metrics in {output / 'metrics.jsonl'}{shown}")
        if self.env.is_main:
            summary = {key: json_number(value) for key, value in summary.items()}
            output.mkdir(parents=True, exist_ok=True)
            (output / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")

    def plot(self) -> Path | None:
        """output_dir/curves.png drawn from the metrics written so far (rank 0, once the run writes: at each checkpoint
        and at the end); its path, or None."""
        if not (self.env.is_main and self.opened):
            return None
        return plot_curves(Path(self.config.trainer.output_dir))

    def _compression_item(self) -> str:
        """The steps' token compression on the last line, so a run without the progress bar shows it too."""
        if not self._compression:
            return ""
        low, high = min(self._compression), max(self._compression)
        return f"; token compression T/U {statistics.fmean(self._compression):.2f}x a step ({low:.2f}-{high:.2f})"

    def close(self) -> None:
        """Close metrics.jsonl, TensorBoard and W&B, if they were opened."""
        if self._logger is not None:
            self._logger.close()
