"""Metrics of a run: one JSON line per logged step (metrics.jsonl) and TensorBoard scalars, rank 0 only.

After step 6 (docs/architecture.md): what a step logs.

Names are `section/metric`: `rollout/` (rewards and counters of the step's samples), `train/`
(loss terms, grad norm, learning rate), `batch/` (prefix-tree sizes and compression T/U), `time/`,
`perf/` (tokens per second), `eval/` (the fixed-prompt evaluation).
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch.distributed as dist

from treerl.errors import UserError
from treerl.tree import PrefixTree, TokenSequence


class MetricsLogger:
    """Appends `{"step": s, "time": t, metric: value, ...}` lines to metrics.jsonl; mirrors them to TensorBoard and,
    with `wandb_project`, to Weights & Biases (`pip install wandb`; WANDB_MODE=offline writes only locally)."""

    def __init__(self, output_dir: str | Path, tensorboard: bool = True, start_step: int = 0,
                 wandb_project: str | None = None, wandb_name: str | None = None, run_config: dict | None = None):
        wandb = import_wandb() if wandb_project is not None else None  # not installed: an error before any file
        self.dir = Path(output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "metrics.jsonl"
        if start_step == 0 and self.path.exists():
            self.path.unlink()  # a fresh run in an old directory starts a fresh file; a resumed run appends
        self.file = open(self.path, "a")  # noqa: SIM115 (open for the whole run; closed by close())
        self.writer = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(self.dir / "tensorboard"), purge_step=start_step or None)
        self.wandb = None
        if wandb is not None:
            self.wandb = wandb.init(project=wandb_project, name=wandb_name, dir=str(self.dir), config=run_config)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, "time": round(time.time(), 3)}
        row.update({k: json_number(v) for k, v in sorted(metrics.items())})
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        finite = {key: value for key, value in metrics.items() if math.isfinite(value)}
        if self.writer is not None:
            for key, value in finite.items():
                self.writer.add_scalar(key, value, step)
        if self.wandb is not None:
            self.wandb.log(finite, step=step)

    def write_jsonl(self, name: str, rows: list[dict[str, Any]]) -> None:
        """Append rows to another JSONL file of the run (e.g. dropped samples with their text)."""
        with open(self.dir / name, "a") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)

    def close(self) -> None:
        self.file.close()
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()


def import_wandb() -> Any:
    """The wandb module; a UserError naming the setting if it is not installed (the trainer asks at start)."""
    try:
        import wandb
    except ImportError:
        raise UserError("trainer.wandb=true needs Weights & Biases: pip install 'treerl[wandb]' (or set "
                        "trainer.wandb=false)") from None
    return wandb


def json_number(value: Any) -> Any:
    """JSON has no NaN/inf: they are written as null (anything but a float passes unchanged)."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


class Mean:
    """Running means of metrics over the updates of one step (loss, clip fraction, grad norm ...)."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)

    def add(self, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.sums[key] += value
            self.counts[key] += 1

    def result(self) -> dict[str, float]:
        return {key: self.sums[key] / self.counts[key] for key in self.sums}


def sum_over_ranks(metrics: dict[str, float]) -> dict[str, float]:
    """Each key summed over all ranks (a rank that ran no sequence may lack keys); identity in one process."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return dict(metrics)
    gathered: list[dict[str, float]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, metrics)
    total: dict[str, float] = defaultdict(float)
    for rank_metrics in gathered:
        for key, value in rank_metrics.items():
            total[key] += value
    return dict(total)


def summarise_mismatch(steps: list[dict[str, float]]) -> dict[str, float]:
    """A run's mismatch/* in summary.json: each measure's mean over the steps that measured it, the extremes' extreme
    (*_max, *_min) and the tokens' sum; `steps` is the steps' metrics."""
    values: dict[str, list[float]] = defaultdict(list)
    for metrics in steps:
        for key, value in metrics.items():
            values[key.removeprefix("mismatch/")].append(value)
    combine = {"max": max, "min": min, "tokens": sum}
    summary = {key: combine.get(key.rsplit("_", 1)[-1], statistics.fmean)(each) for key, each in values.items()}
    if summary:
        summary["steps"] = len([metrics for metrics in steps if metrics.get("mismatch/tokens")])
    return summary


ENV_METRICS = ("env/", "metrics/")  # the prefixes of `treerl.rollout.workflows.stats.environment_metrics`


def summarise_environments(steps: list[dict[str, float]], evaluated: dict[str, dict[str, float]]
                           ) -> dict[str, dict[str, float]]:
    """summary.json's "environments": per environment (metrics/* under "metrics"), each of its training metrics'
    mean over the steps that had it (samples: their sum), and its evaluation's reward_mean at start and end
    (eval_reward_start, eval_reward_end) from `evaluated` ({"start" | "end": its environment metrics})."""
    values: dict[tuple[str, str], list[float]] = defaultdict(list)
    for metrics in steps:
        for key, value in metrics.items():
            values[environment_key(key)].append(value)
    summary: dict[str, dict[str, float]] = defaultdict(dict)
    for (env, name), each in values.items():
        summary[env][name] = sum(each) if name == "samples" else statistics.fmean(each)
    for label, metrics in evaluated.items():
        for key, value in metrics.items():
            env, name = environment_key(key)
            if name == "reward_mean":
                summary[env][f"eval_reward_{label}"] = value
    return dict(summary)


def environment_key(key: str) -> tuple[str, str]:
    """"env/<name>/<metric>" -> (name, metric); "metrics/<metric>" -> ("metrics", metric)."""
    section, _, rest = key.partition("/")
    return tuple(rest.split("/", 1)) if section == "env" else (section, rest)  # type: ignore[return-value]


def tree_metrics(sequences: list[TokenSequence]) -> dict[str, float]:
    """How much the batch's prefix tree shares: flat tokens T, unique tokens U, compression T/U."""
    stats = PrefixTree.build(sequences).stats()
    return {
        "batch/sequences": stats.sequences, "batch/flat_tokens": stats.flat_tokens,
        "batch/unique_tokens": stats.unique_tokens, "batch/compression": stats.compression,
        "batch/trained_tokens": float(sum(s.fields["loss_mask"].sum() for s in sequences)),
    }
