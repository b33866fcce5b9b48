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
