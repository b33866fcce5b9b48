"""`treerl train agent_tools`: agent files trained end to end through the proxy, synchronously and in the rollout
workers of trainer.mode=async."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from treerl.errors import TrainingStopped
from treerl.rollout import builtin_tokenizer
from treerl.rollout.conversations.tokenizer import PLAIN_CHAT_TEMPLATE
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


@pytest.mark.slow
def test_async_agent_training_with_staleness_trains_or_counts_every_episode(tiny_config, tmp_path):
    """trainer.mode=async with max_staleness=1 (the worker samples a step ahead): no trained group is more than one
    version old, and every episode is accounted for: in a trained group, dropped with its reason (task 4's group:
    agent_raised) or in a group counted as dropped or pending; the pool's counters add up."""
    agent = tmp_path / "flaky_agent.py"
    agent.write_text(FLAKY_AGENT)
    config = tiny_config(f"rollout.agent={agent}:episode", "trainer.steps=3", "trainer.mode=async",
                         "trainer.max_staleness=1", config="agent_tools")
    counters = train(config).counters
    rows = [json.loads(line) for line in (Path(config.trainer.output_dir) / "metrics.jsonl").read_text().splitlines()]
    rows = [row for row in rows if "async/lag_max" in row]
    assert len(rows) == 3 and all(row["async/lag_max"] <= 1 for row in rows)
    assert counters["produced"] == (counters["trained"] + counters["dropped_stale"] + counters["dropped_failed"]
                                    + counters["pending"])
    assert counters["admitted"] == counters["produced"] + counters["lost_to_crash"] + counters["in_flight"]
    assert counters["trained"] + counters["dropped_failed"] == 3 * 2 and counters["dropped_failed"] >= 1
    group = config.rollout.group_size  # every episode of a produced group is kept or dropped with a reason
    assert sum(row["rollout/kept"] + row["rollout/dropped"] for row in rows) == group * counters["produced"]
    dropped = sum(row["rollout/dropped"] for row in rows)
    assert dropped == sum(row.get("rollout/dropped_agent_raised", 0) for row in rows)
    assert dropped >= group * counters["dropped_failed"]
    assert sum(row.get("batch/sequences", 0) for row in rows) == 2 * group * counters["trained"]  # 2 calls an episode
    assert "the tool server is down" in (Path(config.trainer.output_dir) / "dropped.jsonl").read_text()


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


@pytest.mark.slow  # ~8 s on 2 cores
def test_an_agent_run_whose_template_writes_no_known_tool_format_says_so(tiny_config, tmp_path, caplog):
    """rollout.tool_parser=auto and a chat template with no tool-call format treerl knows: one warning at the start
    naming the setting (not one per rollout: here the evaluation has its own), and the built-in agent's named tool
    choice is refused with the same advice, which dropped.jsonl shows (and the run, none of whose steps trained,
    stops saying so)."""
    tokenizer = builtin_tokenizer()  # the tools shown, in no format a parser reads
    tokenizer.chat_template = "{% if tools %}Tools: {{ tools | tojson }}\n{% endif %}" + PLAIN_CHAT_TEMPLATE
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    config = tiny_config(f"model.tokenizer_path={tmp_path / 'tokenizer'}", "trainer.steps=1", "trainer.eval_prompts=2",
                         "rollout.prompts_per_step=1", "rollout.group_size=2", config="agent_tools")
    with caplog.at_level(logging.WARNING, logger="treerl"), pytest.raises(TrainingStopped, match="fix the agent"):
        train(config)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("rollout.tool_parser=auto found no")]
    assert len(said) == 1 and "set rollout.tool_parser to the model's format, one of hermes" in said[0]
    dropped = (Path(config.trainer.output_dir) / "dropped.jsonl").read_text()
    assert "needs a tool call, but rollout.tool_parser=auto" in dropped
