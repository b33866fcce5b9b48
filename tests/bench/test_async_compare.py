"""`treerl.bench.async_compare`: both modes on one tiny config, rows, time to target, and its files."""

from __future__ import annotations

import json

import pytest

from treerl.bench.async_compare import compare, time_to


def test_time_to_target_is_the_first_time_the_smoothed_reward_reaches_it():
    curve = [(1.0, 0.1), (2.0, 0.5), (3.0, 0.4), (4.0, 0.7)]
    assert time_to(curve, 0.5) == 2.0 and time_to(curve, 0.6) == 4.0 and time_to(curve, 0.8) is None


@pytest.mark.slow
def test_compare_runs_sync_and_async_on_the_same_config(tmp_path):
    overrides = ["trainer.steps=3", "trainer.eval_prompts=2", "rollout.prompts_per_step=2", "rollout.group_size=2",
                 "trainer.warmup_steps=0"]
    rows = compare("arithmetic", overrides, seeds=[0], out=tmp_path)
    assert [r["mode"] for r in rows] == ["sync", "async"]
    sync, asynchronous = rows
    assert sync["steps"] == asynchronous["steps"] == 3 and sync["reward_start"] == asynchronous["reward_start"]
    assert len(sync["curve"]) == len(asynchronous["curve"]) == 3 and sync["target"] == asynchronous["target"]
    assert asynchronous["counters"]["trained"] == 3 * 2 and sync["counters"] is None
    saved = json.loads((tmp_path / "async_compare.json").read_text())
    assert saved["runs"][1]["mode"] == "async" and (tmp_path / "async_compare.png").stat().st_size > 0
    assert "| 0 | async |" in (tmp_path / "async_compare.md").read_text()
