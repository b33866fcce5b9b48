"""Metrics sinks beside metrics.jsonl: Weights & Biases (offline in tests; skipped when wandb is not installed)."""

from __future__ import annotations

import json

import pytest

from treerl.trainer.core.metrics import MetricsLogger


@pytest.mark.slow
def test_wandb_offline_run_gets_the_metrics_and_the_config(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="Weights & Biases is an optional extra: pip install 'treerl[wandb]'")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = MetricsLogger(tmp_path, tensorboard=False, wandb_project="treerl-test", wandb_name="t",
                           run_config={"trainer": {"lr": 0.1}})
    logger.log(0, {"rollout/reward_mean": 0.5, "train/loss": float("nan")})
    logger.log(1, {"rollout/reward_mean": 0.7})
    run = logger.wandb
    assert "rollout/reward_mean" in run.summary.keys() and "train/loss" not in run.summary.keys()  # noqa: SIM118 (NaN: not sent)
    assert dict(run.config) == {"trainer": {"lr": 0.1}} and run.project == "treerl-test"
    logger.close()
    records = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(records) == 1 and records[0].stat().st_size > 0
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["rollout/reward_mean"] for line in lines] == [0.5, 0.7]  # the JSONL is written as before
