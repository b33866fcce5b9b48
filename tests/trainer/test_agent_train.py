"""`treerl train agent_tools`: the example agent file (no treerl import) trained end to end through the proxy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from treerl.trainer import ConfigError, train

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "agent_tools_agent.py"


@pytest.mark.slow
def test_train_agent_tools_with_the_example_agent_file(tiny_config, tmp_path):
    """Two steps with the README's agent file: every episode trained (2 calls each), the batch a compressed tree,
    evaluation at the start and the end, the proxy's server stopped afterwards."""
    config = tiny_config(f"rollout.agent={EXAMPLE}:episode", "trainer.steps=2", "trainer.eval_prompts=2",
                         config="agent_tools")
    assert config.rollout.task == "agent_tools"
    result = train(config)
    rows = [json.loads(line) for line in (Path(config.trainer.output_dir) / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "batch/compression" in row]
    assert len(steps) == 2
    for row in steps:
        assert row["rollout/kept"] == 8 and row["rollout/dropped"] == 0 and row["rollout/model_calls"] == 16
        assert row["batch/sequences"] == 16 and row["batch/compression"] > 3
        assert row["rollout/history_mismatches"] == 0  # every answer call extended its lookup call's tokens
    evaluations = {row["step"]: row["eval/reward_mean"] for row in rows if "eval/reward_mean" in row}
    assert evaluations == {0: result.reward_start, 2: result.reward_end} and result.dropped_samples == 0


def test_async_mode_refuses_agent_tasks(tiny_config):
    with pytest.raises(ConfigError, match="use trainer.mode=sync"):
        tiny_config("trainer.mode=async", config="agent_tools")
