"""Agent workflows: user agent files loaded by path, episodes run concurrently, failing episodes dropped with reasons."""

from __future__ import annotations

import ast
import asyncio
import json
import math
import signal
import sys
import time
from pathlib import Path

import pytest

from treerl.errors import Interrupted, UserError
from treerl.rollout import Rollout, RolloutConfig
from treerl.rollout.agents.agent import AgentExited, AgentWorkflow, contained, load_agent
from treerl.rollout.agents.proxy import ChatProxy
from treerl.rollout.tasks import AgentTools
from treerl.rollout.tasks.base import Prompt
from treerl.rollout.workflows.stats import RolloutStats

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "agent_tools_agent.py"


def _prompts(n: int) -> list[Prompt]:
    return [Prompt(f"t{i}", [{"role": "user", "content": str(i)}], {"kind": i}) for i in range(n)]


def _play(chat, sampler, agent, tasks: int, **options) -> tuple[list, RolloutStats]:
    """The sequences and counters of `tasks` tasks played by `agent` through a proxy over `sampler`."""
    workflow = AgentWorkflow(agent, ChatProxy(sampler, chat), **options)
    stats = RolloutStats()
    try:
        return workflow.run(sampler, _prompts(tasks), stats, seed=0), stats
    finally:
        workflow.proxy.stop()


def test_episodes_run_concurrently_and_each_call_is_a_sequence(chat, scripted):
    """All 3 x 4 episodes are in flight at once (a barrier after the first reply opens only when all 12 reach it;
    run one by one they would time out); each call is one sequence with the episode's reward, group, trajectory."""
    barrier = asyncio.Barrier(12)

    async def agent(client, task):
        messages = [{"role": "user", "content": f"task {task['kind']}"}]
        reply = await client.chat.completions.create(model="p", messages=messages)
        await barrier.wait()
        messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "again"}]
        await client.chat.completions.create(model="p", messages=messages)
        return task["kind"] + 0.5

    sequences, stats = _play(chat, scripted(lambda p, j: "ok"), agent, 3, group_size=4, episode_timeout=30)
    assert (stats.prompts, stats.samples, stats.kept, stats.model_calls, len(sequences)) == (3, 12, 12, 24, 24)
    assert sorted(stats.rewards) == sorted([0.5] * 4 + [1.5] * 4 + [2.5] * 4)
    for seq in sequences:
        assert seq.info["reward"] == int(seq.info["group"][1:]) + 0.5
        assert seq.info["turns"] == 2 and seq.info["turn"] in (0, 1)
        assert seq.fields["loss_mask"].sum() == 3  # "ok" + <eos>
    second = [s for s in sequences if s.info["turn"] == 1]
    assert all(s.info["parent"] == 0 for s in second)


def test_failing_episodes_are_dropped_and_counted_with_their_reason(chat, scripted):
    """An agent that raises, returns NaN or a string, or never calls the model loses that episode (counted
    under rollout/dropped_<reason>, reported with its task); the others are trained."""

    async def agent(client, task):
        kind = task["kind"]
        if kind != 4:
            await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "x"}])
        if kind == 1:
            raise KeyError("tool exploded")
        return {2: math.nan, 3: "high"}.get(kind, 1.0)

    sequences, stats = _play(chat, scripted(lambda p, j: "y"), agent, 5, group_size=2)
    assert dict(stats.dropped) == {"agent_raised": 2, "reward_not_finite": 2, "reward_not_a_number": 2,
                                   "agent_no_model_calls": 2}
    assert stats.kept == 2 and len(sequences) == 2 and {s.info["group"] for s in sequences} == {"t0"}
    assert "KeyError: 'tool exploded'" in " ".join(s.reason for s in stats.dropped_samples)
    assert stats.metrics()["rollout/dropped_agent_raised"] == 2


def test_an_agent_that_exits_loses_its_episode_not_the_run(chat, scripted):
    """sys.exit(0), SystemExit or KeyboardInterrupt in an episode, or in a task the episode starts, is that
    episode's failure (dropped as agent_raised, with the exception named); the other episodes are trained. A real
    signal (Interrupted, raised by the CLI's or the trainer's handler) still goes past the episodes."""

    async def in_a_task():
        raise SystemExit(3)

    async def agent(client, task):
        await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "x"}])
        kind = task["kind"]
        if kind == 0:
            sys.exit(0)
        if kind == 1:
            raise KeyboardInterrupt("pressed in the agent")
        if kind == 2:
            await asyncio.gather(in_a_task())
        if kind == 3:
            await asyncio.create_task(in_a_task())
        return 1.0

    sequences, stats = _play(chat, scripted(lambda p, j: "y"), agent, 5, group_size=2)
    assert dict(stats.dropped) == {"agent_raised": 8} and stats.kept == 2
    assert {s.info["group"] for s in sequences} == {"t4"}
    reasons = " ".join(s.reason for s in stats.dropped_samples)
    assert "raised SystemExit: 0" in reasons and "raised SystemExit: 3" in reasons
    assert "raised KeyboardInterrupt: pressed in the agent" in reasons

    async def raises(error):
        raise error

    with pytest.raises(AgentExited, match="SystemExit: 0"):
        asyncio.run(contained(raises(SystemExit(0))))
    with pytest.raises(Interrupted, match="SIGINT received twice"):
        asyncio.run(contained(raises(Interrupted(signal.SIGINT, "SIGINT received twice"))))


def test_an_episode_whose_call_outgrows_the_context_limit_is_dropped(chat, scripted):
    """The proxy refuses a call whose prompt + max_tokens exceeds rollout.max_context_tokens (HTTP 400); the episode
    is dropped as agent_context_limit, even when the agent catches the error and returns a reward."""
    import openai

    async def agent(client, task):
        messages = [{"role": "user", "content": "x" * (40 if task["kind"] else 1)}]
        try:
            await client.chat.completions.create(model="p", messages=messages, max_tokens=4)
        except openai.BadRequestError:
            return 0.5  # carries on as if nothing happened
        return 1.0

    workflow = AgentWorkflow(agent, ChatProxy(scripted(lambda p, j: "y"), chat, max_context_tokens=30))
    stats = RolloutStats()
    try:
        sequences = workflow.run(workflow.proxy.sampler, _prompts(2), stats, seed=0)
    finally:
        workflow.proxy.stop()
    assert dict(stats.dropped) == {"agent_context_limit": 8} and stats.kept == 8
    assert {s.info["group"] for s in sequences} == {"t0"}
    assert "exceeds rollout.max_context_tokens=30" in stats.dropped_samples[0].reason


def test_an_episode_past_its_timeout_is_dropped_and_the_step_goes_on(chat, scripted):
    """An agent that never returns is cut at `episode_timeout` (its model call made or not: the machine's speed
    does not change the outcome) and dropped as agent_timeout; the step ends instead of waiting for it."""

    async def agent(client, task):
        await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "x"}])
        await asyncio.Event().wait()  # hangs for ever

    started = time.monotonic()
    sequences, stats = _play(chat, scripted(lambda p, j: "y"), agent, 1, group_size=2, episode_timeout=1.0)
    assert time.monotonic() - started < 60
    assert dict(stats.dropped) == {"agent_timeout": 2} and stats.kept == 0 and sequences == []
    assert "rollout.episode_timeout" in " ".join(s.reason for s in stats.dropped_samples)


def test_without_the_openai_client_an_agent_task_stops_before_any_episode(tokenizer, scripted, monkeypatch):
    """The `[agents]` extra adds the openai package, the client an agent is handed: without it the rollout is not
    built (one line naming the extra), instead of an ImportError at the first episode."""
    monkeypatch.setitem(sys.modules, "openai", None)  # `import openai` raises ImportError
    with pytest.raises(UserError, match=r"openai.AsyncOpenAI client: pip install 'treerl\[agents\]'"):
        Rollout(RolloutConfig(task="agent_tools"), tokenizer, scripted(lambda p, j: "y"))


def test_agent_loading_errors_name_the_problem(tmp_path):
    path = tmp_path / "bad_agent.py"
    path.write_text("def sync(client, task):\n    return 1\n\nasync def one(client):\n    return 1\n")
    with pytest.raises(ValueError, match="must be an async function"):
        load_agent(f"{path}:sync")
    with pytest.raises(ValueError, match=r"must accept \(client, task\)"):
        load_agent(f"{path}:one")
    with pytest.raises(ValueError, match="has no attribute 'missing'"):
        load_agent(f"{path}:missing")
    with pytest.raises(ValueError, match="cannot import"):
        load_agent(f"{tmp_path / 'nope.py'}:episode")


def test_agent_task_reads_a_jsonl_of_tasks_and_runs_the_user_file(tokenizer, scripted, tmp_path):
    """rollout.task=agent: every JSONL row is handed whole to the user's episode, group_size times."""
    data = tmp_path / "tasks.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q{i}", "target": "ok"}) + "\n" for i in range(3)))
    agent = tmp_path / "my_agent.py"
    agent.write_text(
        "async def episode(client, task):\n"
        "    reply = await client.chat.completions.create(model='m', messages=[{'role': 'user', 'content': task['prompt']}])\n"
        "    return float(reply.choices[0].message.content == task['target'])\n")
    config = RolloutConfig(task="agent", agent=f"{agent}:episode", data_path=str(data), prompts_per_step=2,
                           group_size=3)
    rollout = Rollout(config, tokenizer, scripted(lambda p, j: "ok" if j == 0 else "no"))
    try:
        batch = rollout.collect(0)
    finally:
        rollout.close()
    assert batch.stats.kept == 6 and len(batch.sequences) == 6
    assert {s.info["group"].rsplit("/", 1)[0] for s in batch.sequences} == {"s0/p0", "s0/p1"}
    with pytest.raises(ValueError, match="needs rollout.agent"):
        RolloutConfig(task="agent", data_path=str(data)).check()


def test_agent_tools_world_and_its_agent(tokenizer, scripted):
    """The built-in world: deterministic tasks; its agent scores a perfect policy 1 and a garbled call less than
    0.2 (no record, so no answer); every episode makes two calls, the second extending the first."""
    world = AgentTools(seed=3)
    tasks = [p.answer for p in world.prompts(5, 4)]
    assert tasks == [p.answer for p in world.prompts(5, 4)]
    assert all(str(t["records"][str(t["id"])]["code"]) == t["answer"] and t["question"] == f"code of {t['id']}?"
               for t in tasks)
    answer = {t["question"]: t for t in tasks}

    def perfect(prompt: str, j: int) -> str:
        if prompt.endswith("?<eos><assistant>"):
            question = prompt.rsplit("<user>", 1)[1].split("<eos>")[0]
            wanted = answer[question]["id"]
            return json.dumps({"id": wanted}) if wanted % 2 == 0 else '{"id": x}'
        return prompt.rsplit('"code": ', 1)[1][0] if '"code": ' in prompt else "z"

    config = RolloutConfig(task="agent_tools", prompts_per_step=4, group_size=2, seed=3)
    rollout = Rollout(config, tokenizer, scripted(perfect))
    try:
        batch = rollout.collect(5)
    finally:
        rollout.close()
    even = sum(t["id"] % 2 == 0 for t in tasks)
    assert 0 < even < 4
    rewards = sorted(batch.stats.rewards, reverse=True)
    assert rewards[: 2 * even] == [pytest.approx(1.0)] * (2 * even) and all(r < 0.2 for r in rewards[2 * even :])
    assert len(batch.sequences) == 16 and all(s.info["turns"] == 2 for s in batch.sequences)


def test_the_example_agent_is_plain_python_with_no_treerl_import():
    """examples/agent_tools_agent.py (the built-in task's agent) imports the standard library only, and the
    README shows it unchanged."""
    source = EXAMPLE.read_text()
    imported = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            imported.add((node.module or "").split(".")[0])
    assert imported <= {"json", "openai", "re", "asyncio", "random"}, imported
    readme = (ROOT / "README.md").read_text()
    assert source.strip() in readme
    assert load_agent(f"{EXAMPLE}:episode").__name__ == "episode"


def test_per_turn_rewards_name_their_responses_and_reach_each_calls_sequence(chat, scripted):
    """An episode returns {"reward", "turn_rewards": {response.id: r}}: each call's sequence carries its own turn's
    reward (one per choice of an n=2 request), plus the outcome on the calls nothing continues; the other episode of
    the task (a plain number) gets per-turn rewards too; a task of plain numbers gets none; an unknown id drops."""
    plain_given = []

    async def agent(client, task):
        messages = [{"role": "user", "content": "q"}]
        first = await client.chat.completions.create(model="p", messages=messages)
        messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]
        second = await client.chat.completions.create(model="p", messages=messages, n=2)
        if task["kind"] == 2:
            return {"reward": 1.0, "turn_rewards": {"chatcmpl-nope": 1.0}}
        if task["kind"] == 1 or plain_given:
            return 1.0
        plain_given.append(True)
        return {"reward": 1.0, "turn_rewards": {first.id: 0.5, second.id: [0.25, -0.25]}}

    sequences, stats = _play(chat, scripted(lambda p, j: "ok"), agent, 3, group_size=2, episode_timeout=30)
    by_task = {kind: [s for s in sequences if s.info["group"] == f"t{kind}"] for kind in range(3)}
    assert [sorted(s.info["turn_reward"] for s in by_task[0])] == [sorted([0.5, 1.25, 0.75, 0.0, 1.0, 1.0])]
    assert all("turn_reward" not in s.info for s in by_task[1]) and by_task[2] == []
    assert stats.dropped["agent_turn_rewards"] == 2 and "chatcmpl-nope" in stats.dropped_samples[0].reason
    assert sorted(stats.rewards) == [1.0] * 4 and all(s.info["reward"] == 1.0 for s in sequences)


def test_a_cut_history_is_a_new_subtree_counted_in_the_metrics(chat, scripted):
    """An agent that drops its oldest turns: the call after the cut follows the one before it (info parent, cut)
    and the step's metrics say how many tokens of sharing the cut lost, and what share of the reusable tokens."""
    async def agent(client, task):
        messages = [{"role": "user", "content": "a"}]
        for text in ["b", "c"]:
            reply = await client.chat.completions.create(model="p", messages=messages)
            messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": text}]
        await client.chat.completions.create(model="p", messages=messages[2:])  # the first exchange dropped
        return 1.0

    sequences, stats = _play(chat, scripted(lambda p, j: "ok"), agent, 1, group_size=1)
    assert [(s.info["parent"], s.info["cut"]) for s in sequences] == [(None, False), (0, False), (1, True)]
    full = [len(s.tokens) for s in sequences]
    lost = full[1] - 2  # only "<bos><user>" is still shared: the cut prompt goes on "b", not "a"
    metrics = stats.metrics()
    assert (metrics["rollout/history_mismatches"], metrics["rollout/sharing_lost_tokens"]) == (1, lost)
    assert metrics["rollout/sharing_lost_ratio"] == pytest.approx(lost / (lost + full[0]))


def test_an_agent_file_imports_the_modules_beside_it(tmp_path, chat, scripted, monkeypatch):
    """The agent file's directory is on the import path while it loads and while its episodes run."""
    monkeypatch.setattr("sys.path", list(__import__("sys").path))
    folder = tmp_path / "agent_dir"
    folder.mkdir()
    (folder / "beside_at_load.py").write_text("QUESTION = 'hello'\n")
    (folder / "beside_at_run.py").write_text("def score(text):\n    return float(text == 'ok')\n")
    (folder / "my_file_agent.py").write_text(
        "from beside_at_load import QUESTION\n\n"
        "async def episode(client, task):\n"
        "    import beside_at_run\n"
        "    reply = await client.chat.completions.create(model='p', messages=[{'role': 'user', 'content': QUESTION}])\n"
        "    return beside_at_run.score(reply.choices[0].message.content)\n")
    monkeypatch.chdir(tmp_path)  # not the agent's directory
    agent = load_agent(f"{folder / 'my_file_agent.py'}:episode")
    _, stats = _play(chat, scripted(lambda p, j: "ok"), agent, 1, group_size=2)
    assert stats.rewards == [1.0, 1.0] and not stats.dropped
