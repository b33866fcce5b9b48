"""`treerl train agent_tools`: agent files trained end to end through the proxy, synchronously and in the rollout
workers of trainer.mode=async."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from treerl.trainer import train

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


FLAKY_AGENT = """
async def episode(client, task):
    messages = [{"role": "user", "content": task["question"]}]
    reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=3)
    if task["id"] == 4:
        raise RuntimeError("the tool server is down")
    messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "sure?"}]
    second = await client.chat.completions.create(model="policy", messages=messages, max_tokens=3)
    return float(second.choices[0].message.content == task["answer"])
"""


@pytest.mark.slow
def test_async_agent_training_drops_and_shares_as_the_synchronous_loop_does(tiny_config, tmp_path, capsys):
    """trainer.mode=async with an agent: rollout workers play the episodes (max_staleness 0: the synchronous
    loop's prompts); the same episodes kept and dropped with the same reason, the same calls and sequences per
    step, each batch a compressed tree; the console shows each step's compression."""
    agent = tmp_path / "flaky_agent.py"
    agent.write_text(FLAKY_AGENT)  # the task with id 4 (step 0's second) fails: its whole group is dropped
    common = [f"rollout.agent={agent}:episode", "trainer.steps=2"]
    train(tiny_config(*common, name="sync", config="agent_tools"))
    result = train(tiny_config(*common, "trainer.mode=async", "trainer.max_staleness=0", "trainer.progress=true",
                               name="async", config="agent_tools"))
    rows = {name: [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()
                   if "batch/compression" in line] for name in ("sync", "async")}
    assert len(rows["async"]) == 2
    for want, got in zip(rows["sync"], rows["async"], strict=True):
        for key in ("rollout/kept", "rollout/dropped", "rollout/model_calls", "batch/sequences",
                    "rollout/history_mismatches"):
            assert got[key] == want[key], key
        assert got.get("rollout/dropped_agent_raised") == want.get("rollout/dropped_agent_raised")
        assert got["batch/compression"] > 2 and got["async/lag_max"] == 0
    assert rows["async"][0]["rollout/dropped_agent_raised"] == 4 and rows["async"][1]["rollout/kept"] == 8
    assert result.counters["dropped_failed"] == 1 and result.counters["trained"] == 3
    assert "the tool server is down" in (tmp_path / "async" / "dropped.jsonl").read_text()
    assert "compression=" in capsys.readouterr().err


SLOW_TOOL_AGENT = """
import asyncio

async def episode(client, task):
    await asyncio.sleep(2.5)  # a slow tool: no model call for longer than trainer.worker_timeout
    messages = [{"role": "user", "content": task["question"]}]
    await client.chat.completions.create(model="policy", messages=messages, max_tokens=2)
    return 1.0
"""


@pytest.mark.slow
def test_an_async_worker_waiting_on_a_slow_agent_tool_is_not_taken_for_hung(tiny_config, tmp_path):
    """The worker beats while its episodes' event loop runs, so 2.5 s of tool time with no model forward does not
    trip a 1.5 s worker_timeout (no restart allowed here)."""
    agent = tmp_path / "slow_tool_agent.py"
    agent.write_text(SLOW_TOOL_AGENT)
    result = train(tiny_config(f"rollout.agent={agent}:episode", "trainer.steps=1", "trainer.mode=async",
                               "trainer.worker_timeout=1.5", "rollout.reward_timeout=1", "trainer.max_worker_restarts=0",
                               config="agent_tools"))
    assert result.counters["restarts"] == 0 and result.counters["trained"] == 2 and result.dropped_samples == 0
