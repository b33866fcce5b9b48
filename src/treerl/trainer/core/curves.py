"""The run's curves as a picture: output_dir/curves.png, drawn from its metrics at each checkpoint and at the end.

After step 6 (docs/architecture.md): what the run shows (written by `treerl.trainer.core.reporter.Reporter`).

Drawn from metrics.jsonl, so a resumed run's picture holds the steps before its resume too. One panel a curve the
run logged: training and evaluation reward, loss, KL, token compression T/U and step time,
against the step. A panel whose metrics the run never logged (no evaluation, no KL) is left out.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

FILE = "curves.png"
PANELS = (  # title, then the metrics drawn in it (label, key)
    ("reward", (("training", "rollout/reward_mean"), ("evaluation", "eval/reward_mean"))),
    ("loss", (("loss", "train/loss"),)),
    ("KL", (("KL to the reference", "train/kl"), ("approx. KL to the old policy", "train/approx_kl"))),
    ("token compression T/U", (("T/U", "batch/compression"),)),
    ("step time (s)", (("step", "time/step"),)),
)


def series(rows: list[tuple[int, dict[str, float]]], key: str) -> tuple[list[int], list[float]]:
    """The finite values of `key` in the logged rows, by step."""
    points = [(step, float(row[key])) for step, row in rows if isinstance(row.get(key), (int, float))]
    return [s for s, v in points if math.isfinite(v)], [v for s, v in points if math.isfinite(v)]


def logged_rows(metrics: Path) -> list[tuple[int, dict[str, float]]]:
    """The rows of a run's metrics.jsonl, by step (none when it is not there yet)."""
    if not metrics.is_file():
        return []
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return [(int(row["step"]), row) for row in rows if isinstance(row, dict) and "step" in row]


def plot_curves(out: Path) -> Path | None:
    """Draw the panels of PANELS that out/metrics.jsonl has values for into out/curves.png (replaced whole: a reader
    never sees half a file); its path, or None when there is nothing to draw yet."""
    rows = logged_rows(out / "metrics.jsonl")
    panels = [(title, [(label, *series(rows, key)) for label, key in curves]) for title, curves in PANELS]
    panels = [(title, [c for c in curves if c[1]]) for title, curves in panels]
    panels = [(title, curves) for title, curves in panels if curves]
    if not panels:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(len(panels), 1, figsize=(7, 2.2 * len(panels)), sharex=True, squeeze=False)
    for ax, (title, curves) in zip(axes[:, 0], panels):
        for label, steps, values in curves:
            ax.plot(steps, values, marker="o" if len(steps) < 20 else None, markersize=3, label=label)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        if len(curves) > 1 or curves[0][0] != title:
            ax.legend(fontsize=8)
    axes[-1, 0].set_xlabel("step")
    figure.tight_layout()
    path = out / FILE
    partial = out / f".{FILE}.{os.getpid()}.tmp"
    figure.savefig(partial, format="png", dpi=100)
    plt.close(figure)
    os.replace(partial, path)
    return path
