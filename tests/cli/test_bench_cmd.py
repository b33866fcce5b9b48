"""`treerl bench --async` passes its options through to `treerl.bench.async_compare.compare`."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from treerl.bench import async_compare
from treerl.cli.main import app


def test_async_options_reach_the_comparison(tmp_path, monkeypatch):
    calls = []

    def compare(config, overrides, seeds, target, threads, out):
        calls.append((config, overrides, seeds, target, threads, out))
        return [{"seed": 0, "mode": mode, "seconds": 1.0, "steps_per_second": 1.0, "reward_start": 0.1,
                 "reward_end": 0.2, "train_reward_last": 0.2, "target": 0.5, "time_to_target": None,
                 "lag_mean": 0.0, "load_before": 0.0, "load_after": 0.0} for mode in ("sync", "async")]

    monkeypatch.setattr(async_compare, "compare", compare)
    result = CliRunner().invoke(app, ["bench", "--async", "--config", "guess_number", "--set", "trainer.steps=5",
                                      "--set", "rollout.max_turns=5", "--seeds", "0,1", "--target", "0.4",
                                      "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert calls == [("guess_number", ["trainer.steps=5", "rollout.max_turns=5"], [0, 1], 0.4, 1, Path(tmp_path) / "async")]
    assert "| 0 | async |" in result.output and "never" in result.output
