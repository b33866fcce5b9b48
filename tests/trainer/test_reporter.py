"""The Reporter: what a run shows on rank 0's console."""

from __future__ import annotations

import torch

from treerl.distributed import DistEnv
from treerl.trainer.core.reporter import Reporter


def last_line(tiny_config, capsys, postfixes: list[dict[str, float]]) -> str:
    """The last console line of a run without the progress bar whose steps had these progress-bar postfixes."""
    report = Reporter(tiny_config(f"trainer.steps={len(postfixes)}"), DistEnv(0, 1, 0, torch.device("cpu")))
    report.open_bar()
    for step, postfix in enumerate(postfixes):
        report.step(step, {}, postfix)
    report.close_bar()
    report.summarise({"seconds": 1.0}, "training reward: first 3 steps 0.500 -> last 3 steps 0.500")
    return capsys.readouterr().out.strip().splitlines()[-1]


def test_the_last_line_shows_the_steps_token_compression_without_the_progress_bar(tiny_config, capsys):
    """trainer.progress=false hides the bar and its `compression=`: the last line says it instead, as the steps'
    mean and range (a step whose samples were all dropped has none: NaN, left out); an SFT run's steps, which put
    no compression on the bar, add nothing."""
    rl = last_line(tiny_config, capsys, [{"compression": c} for c in (2.0, float("nan"), 4.0)])
    assert rl.startswith("training reward: first 3 steps 0.500 -> last 3 steps 0.500; token compression T/U 3.00x "
                         "a step (2.00-4.00); 1 s; metrics in ")
    sft = last_line(tiny_config, capsys, [{"loss": 1.0}])
    assert "compression" not in sft
    assert sft.startswith("training reward: first 3 steps 0.500 -> last 3 steps 0.500; 1 s")


def test_a_run_draws_its_curves_at_each_checkpoint_and_at_the_end_and_names_them(tiny_config, capsys, monkeypatch):
    """curves.png in output_dir: drawn at the checkpoint of step 1 (from the metrics written by then), again at the
    end with every step, and named on the last line; every curve but the KL to a reference (none here) has values."""
    from pathlib import Path

    from treerl.trainer import train
    from treerl.trainer.core import curves, reporter

    config = tiny_config("trainer.steps=2", "trainer.save_every=1", "trainer.eval_prompts=2")
    drawn: list[list[int]] = []

    def recorded(out: Path) -> Path | None:
        drawn.append(sorted({step for step, _ in curves.logged_rows(out / "metrics.jsonl")}))
        return curves.plot_curves(out)

    monkeypatch.setattr(reporter, "plot_curves", recorded)
    train(config)
    out = Path(config.trainer.output_dir)
    assert drawn == [[0], [0, 1], [0, 1, 2]]  # the checkpoints of steps 1 and 2, the end (its evaluation: step 2)
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert capsys.readouterr().out.strip().splitlines()[-1].endswith(f"curves in {out / 'curves.png'}")
    rows = curves.logged_rows(out / "metrics.jsonl")
    assert all(curves.series(rows, key)[0] for _, shown in curves.PANELS for _, key in shown if key != "train/kl")
