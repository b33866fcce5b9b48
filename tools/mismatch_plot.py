"""Runs side by side, reward beside the training-inference mismatch (docs/img/smollm2-bf16-server-mismatch.png).

    python tools/mismatch_plot.py OUT.png LABEL=RUN_DIR [LABEL=RUN_DIR ...] [--title TEXT]

Reads each run's metrics.jsonl (treerl.trainer.core.curves) and draws, against the step: the training reward
(rollout/reward_mean, thin, and its 5-step running mean) with the evaluation reward as points; mismatch/kl_k3 (log
scale); the ratio's p01..p99 band; docs/mismatch.md says how to read them.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from treerl.trainer.core.curves import logged_rows, series

WINDOW = 5


def running_mean(values: list[float], window: int = WINDOW) -> list[float]:
    """The mean of each value and the up to `window - 1` before it: the trend of a noisy per-step reward."""
    return [sum(values[max(0, i - window + 1): i + 1]) / len(values[max(0, i - window + 1): i + 1])
            for i in range(len(values))]


def plot_runs(runs: dict[str, Path], out: Path, title: str | None = None) -> Path:
    """The three panels for every run in `runs` (label -> run directory), written to `out`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (reward, kl, ratio) = plt.subplots(1, 3, figsize=(15, 4))
    for index, (label, directory) in enumerate(runs.items()):
        rows = logged_rows(directory / "metrics.jsonl")
        if not rows:
            raise SystemExit(f"{directory}: no metrics.jsonl rows")
        color = f"C{index}"
        steps, values = series(rows, "rollout/reward_mean")
        reward.plot(steps, values, color=color, alpha=0.25, linewidth=1)
        reward.plot(steps, running_mean(values), color=color, label=f"{label}: training ({WINDOW}-step mean)")
        steps, values = series(rows, "eval/reward_mean")
        reward.plot(steps, values, color=color, marker="s", linestyle="none", label=f"{label}: evaluation")
        kl.plot(*series(rows, "mismatch/kl_k3"), color=color, label=label)
        steps, low = series(rows, "mismatch/ratio_p01")
        ratio.fill_between(steps, low, series(rows, "mismatch/ratio_p99")[1], color=color, alpha=0.25,
                           label=f"{label}: p01..p99")
        ratio.plot(*series(rows, "mismatch/ratio_p50"), color=color, linewidth=1, label=f"{label}: median")
    reward.set_title("reward", fontsize=10)
    kl.set_title("mismatch/kl_k3: KL(behaviour || trainer) per token", fontsize=10)
    kl.set_yscale("log")
    ratio.set_title("mismatch ratio pi_train / pi_behav per token", fontsize=10)
    for ax in (reward, kl, ratio):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        figure.suptitle(title, fontsize=11)
    figure.tight_layout()
    figure.savefig(out, format="png", dpi=100)
    plt.close(figure)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("runs", nargs="+", help="LABEL=RUN_DIR")
    parser.add_argument("--title")
    args = parser.parse_args()
    runs = {}
    for run in args.runs:
        label, sep, directory = run.partition("=")
        if not sep or not label:
            raise SystemExit(f"{run!r}: give a run as LABEL=RUN_DIR")
        runs[label] = Path(directory)
    print(f"written to {plot_runs(runs, args.out, args.title)}")


if __name__ == "__main__":
    main()
