"""Agent workflows as users write them: `async def episode(client, task) -> reward`, with the OpenAI SDK.

Steps 1 and 2 (docs/architecture.md): a user's agent episode, every model call a training sequence.

    async def episode(client, task: dict) -> float:       # my_agent.py: imports nothing from treerl
        reply = await client.chat.completions.create(model="policy", messages=[...], tools=[...])
        ...                                               # run tools, call the model again, branch, retry
        return reward

`rollout.task=agent rollout.agent=my_agent.py:episode rollout.data_path=tasks.jsonl` runs it:
each task (a JSONL row, as a dict) is played `group_size` times, every episode with its own
`openai.AsyncOpenAI` client whose base_url is the recording proxy (`treerl.rollout.agents.proxy`), all
episodes of a step concurrently on one asyncio loop (at most `max_concurrent_episodes` at once).

Training data: every recorded model call is a sequence, the exact prompt token ids plus the
sampled completion (loss mask on the completion, behaviour log-probs there), with the episode's
reward in `info["reward"]`; `group` is the task, `trajectory` the episode (counted once in the
group baseline), `turn` the call's index, `parent` the call it continues, `cut` whether its history
was cut (it starts a new subtree, see `treerl.rollout.agents.proxy`). Calls that extend each other token
for token (the proxy reuses recorded tokens) share their prefix in the tree.

Per-turn rewards. An episode may return `{"reward": outcome, "turn_rewards": {response.id: r}}`
instead of a number: `r` is the reward of the turn that response answered (a list: one per choice
of an `n` > 1 request), the id being the one the OpenAI SDK gives (`chatcmpl-...` or `resp_...`).
Each call's sequence then carries `info["turn_reward"]`: its own reward (0 if none was given) plus
the outcome on the calls no later call continues, and the advantage estimators train each turn on
the rewards from it on (`treerl.algo.turn_rewards`). The other episodes of the task get per-turn
rewards too (the outcome on their last turns), so one group is all of one kind.

An episode that raises (anything: `sys.exit()` and KeyboardInterrupt too, in the episode or in a task it
starts), times out (`episode_timeout`), returns something that is not a finite number, makes no model
call, or makes a call that `rollout.max_context_tokens` refuses (its prompt + max_tokens too long; the
proxy answers HTTP 400, and the episode is dropped as agent_context_limit whatever the agent does next) is
dropped: counted under `rollout/dropped_<reason>` and reported with its task and error, like a
failing reward function; its calls are not trained. Only a real SIGINT / SIGTERM (`treerl.errors.Interrupted`,
raised by the CLI's or the trainer's signal handlers) goes past an episode.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import itertools
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from treerl.errors import Interrupted, UserError
from treerl.rollout.agents.proxy import ChatProxy, EpisodeLog, RecordedCall
from treerl.rollout.rewards.functions import NamedFailure, RewardFailure, check_metrics, check_reward, import_object
from treerl.rollout.sampling.sampler import Sampler
from treerl.rollout.tasks.base import Prompt
from treerl.rollout.workflows.sequences import environment_info, model_call_sequence
from treerl.rollout.workflows.stats import DroppedSample, RolloutStats
from treerl.tree import TokenSequence

AgentFn = Callable[[Any, dict[str, Any]], Awaitable[Any]]
HEARTBEAT_SECONDS = 1.0


def load_agent(spec: str) -> AgentFn:
    """The `async def episode(client, task)` named by `module:function` or `path/to/file.py:function`."""
    fn = import_object(spec, "agent", "my_agent.py:episode")
    if not inspect.iscoroutinefunction(fn):
        raise UserError(f"agent {spec!r} must be an async function: async def episode(client, task) -> float")
    try:
        inspect.signature(fn).bind(None, {})
    except TypeError:
        raise UserError(f"agent {spec!r} has signature {inspect.signature(fn)}; it must accept (client, task)") from None
    return fn


def agent_of(agent: str | AgentFn) -> AgentFn:
    """An agent task's episode function: given as one, or named by "module:function" (`load_agent`)."""
    return load_agent(agent) if isinstance(agent, str) else agent


def import_openai() -> Any:
    """The OpenAI Python client, the one package the `[agents]` extra adds (the proxy is in treerl's core)."""
    try:
        import openai
    except ImportError:
        raise UserError("agent tasks (rollout.task=agent, agent_tools) hand each episode an openai.AsyncOpenAI "
                        "client: pip install 'treerl[agents]' (the extra adds the openai package)") from None
    return openai


def openai_client(base_url: str, timeout: float) -> Any:
    """An `openai.AsyncOpenAI` for one episode: no retries (a retried call would be sampled and recorded twice)."""
    return import_openai().AsyncOpenAI(base_url=base_url, api_key="treerl", max_retries=0, timeout=timeout)


class AgentExited(Exception):
    """A SystemExit or KeyboardInterrupt raised by an agent, as an ordinary error of its episode."""

    def __init__(self, original: BaseException):
        super().__init__(f"{type(original).__name__}: {original}")
        self.original = original


async def contained(coroutine: Awaitable[Any]) -> Any:
    """Await `coroutine`, turning its SystemExit / KeyboardInterrupt into AgentExited: asyncio would otherwise let
    them end the event loop, every episode of the step and the run with it (a real signal's Interrupted passes)."""
    try:
        return await coroutine
    except Interrupted:
        raise
    except (SystemExit, KeyboardInterrupt) as e:
        raise AgentExited(e) from None


def contained_task(loop: asyncio.AbstractEventLoop, coroutine: Any, **options: Any) -> asyncio.Task:
    """The event loop's task factory while episodes run: every task, the ones an agent starts too, is `contained`."""
    return asyncio.Task(contained(coroutine), loop=loop, **options)


@dataclass(frozen=True)
class EpisodeReward:
    """What an episode returned: its outcome, and the rewards of single turns by response id (possibly none)."""

    reward: float
    turns: dict[str, list[float]] = field(default_factory=dict)  # response id -> a reward per choice, or one for all
    metrics: dict[str, float] = field(default_factory=dict)  # named metrics of the episode (logged, not trained on)


@dataclass
class Episode:
    """One play of a task: its outcome and the calls the proxy recorded."""

    prompt: Prompt
    sample: int  # which of the task's group_size plays
    log: EpisodeLog
    reward: EpisodeReward | RewardFailure


def episode_reward(value: Any) -> EpisodeReward | RewardFailure:
    """An episode's return value: a number, or {"reward": number, "turn_rewards": {response id: number | [number]},
    "metrics": {name: number}} (each key but "reward" optional; the metrics are logged per environment)."""
    if not isinstance(value, dict):
        reward = check_reward(value)
        return reward if isinstance(reward, RewardFailure) else EpisodeReward(reward)
    expected = ('a number or {"reward": number, "turn_rewards": {response id: number or [number per choice]}, '
                '"metrics": {name: number}}')
    unknown = set(value) - {"reward", "turn_rewards", "metrics"}
    turns = value.get("turn_rewards", {})
    if unknown or not isinstance(turns, dict):
        return RewardFailure("not_a_number", f"returned {str(value)[:200]}, not {expected}")
    reward = check_reward(value.get("reward", 0.0))
    if isinstance(reward, RewardFailure):
        return reward
    metrics = check_metrics(value.get("metrics", {}))
    if isinstance(metrics, RewardFailure):
        return metrics
    checked: dict[str, list[float]] = {}
    for response_id, given in turns.items():
        values = [check_reward(v) for v in (given if isinstance(given, (list, tuple)) else [given])]
        failure = next((v for v in values if isinstance(v, RewardFailure)), None)
        if failure is not None:
            return RewardFailure(failure.kind, f"turn_rewards[{response_id!r}]: {failure.message}")
        checked[str(response_id)] = values  # type: ignore[assignment]
    return EpisodeReward(reward, checked, metrics)


def turn_rewards(calls: list[RecordedCall], outcome: EpisodeReward) -> dict[int, float] | RewardFailure:
    """Each call's own reward: the agent's for its response (0 if none), plus the outcome on the calls no call
    continues; or why the agent's turn rewards do not fit its calls."""
    rewards = dict.fromkeys((call.index for call in calls), 0.0)
    for response_id, values in outcome.turns.items():
        answered = [call for call in calls if call.response_id == response_id]
        if not answered:
            return RewardFailure("agent_turn_rewards", f"turn_rewards names response {response_id!r}, which this "
                                                       "episode did not get")
        if len(values) not in (1, len(answered)):
            return RewardFailure("agent_turn_rewards", f"turn_rewards[{response_id!r}] has {len(values)} rewards "
                                                       f"for its {len(answered)} choices")
        for call, value in zip(answered, values * len(answered) if len(values) == 1 else values):
            rewards[call.index] = value
    continued = {call.follows for call in calls}
    for call in calls:
        if call.index not in continued:
            rewards[call.index] += outcome.reward
    return rewards


@dataclass
class AgentWorkflow:
    """Plays `group_size` episodes of every task through the proxy, concurrently."""

    agent: AgentFn
    proxy: ChatProxy
    group_size: int = 8
    episode_timeout: float = 600.0  # seconds for one episode, its model calls included
    max_concurrent_episodes: int = 256
    max_calls: int | None = None  # model calls per episode at most (rollout.max_turns)
    heartbeat: Callable[[], None] | None = None  # called every second while episodes run (an async worker's pulse)

    def __post_init__(self) -> None:
        import_openai()  # missing: an error when the rollout is built, not at the first episode
        self._ids = itertools.count()

    def run(self, sampler: Sampler, prompts: list[Prompt], stats: RolloutStats,
            seed: int | None = None) -> list[TokenSequence]:
        """The training sequences of the episodes of `prompts`; `stats` counts what happened."""
        if sampler is not self.proxy.sampler:
            raise ValueError("the agent workflow samples with its proxy's sampler")
        self.proxy.start()
        self.proxy.batcher.seed = seed
        self.proxy.batcher.server_error = None
        stats.prompts += len(prompts)
        episodes = run_coroutine(self._play_all(prompts))
        if self.proxy.batcher.server_error is not None:  # the episodes failed because a server did: say so, once
            raise self.proxy.batcher.server_error
        per_turn = {e.prompt.id for e in episodes if isinstance(e.reward, EpisodeReward) and e.reward.turns}
        sequences: list[TokenSequence] = []
        for episode in episodes:
            count_calls(episode.log, stats)
            outcome = self._outcome(episode, per_turn=episode.prompt.id in per_turn)
            if isinstance(outcome, RewardFailure):
                name = f"{episode.prompt.id}/{episode.sample}"
                last = self.proxy.chat.reply_text(episode.log.calls[-1].completion.tokens) if episode.log.calls else ""
                stats.drop(DroppedSample(f"agent episode {outcome.message}", name, episode.prompt.text, last),
                           outcome.kind)
                continue
            stats.keep(outcome[0])
            sequences.extend(self._sequences(episode, *outcome))
        stats.sequences += len(sequences)
        return sequences

    @staticmethod
    def _outcome(episode: Episode, per_turn: bool) -> tuple[float, dict[int, float]] | RewardFailure:
        """The episode's reward and (`per_turn`) each call's own reward; or why the episode is dropped."""
        if episode.log.over_context:  # whatever the agent made of the refusal, the episode did not fit
            return RewardFailure("agent_context_limit", f"outgrew its context: {episode.log.over_context}")
        if isinstance(episode.reward, RewardFailure):
            return episode.reward
        if not episode.log.calls:
            return RewardFailure("agent_no_model_calls", "made no model call (nothing to train)")
        rewards = turn_rewards(episode.log.calls, episode.reward) if per_turn else {}
        return rewards if isinstance(rewards, RewardFailure) else (episode.reward.reward, rewards)

    async def _play_all(self, prompts: list[Prompt]) -> list[Episode]:
        asyncio.get_running_loop().set_task_factory(contained_task)
        limit = asyncio.Semaphore(self.max_concurrent_episodes)
        shared = openai_client(self.proxy.url + "/v1", self.episode_timeout)  # one connection pool for the step

        async def bounded(prompt: Prompt, sample: int) -> Episode:
            async with limit:
                return await self._play(shared, prompt, sample)

        beating = asyncio.create_task(self._beat()) if self.heartbeat is not None else None
        try:
            return list(await asyncio.gather(*(bounded(p, j) for p in prompts for j in range(self.group_size))))
        finally:
            if beating is not None:
                beating.cancel()
            await shared.close()

    async def _beat(self) -> None:
        """Call `heartbeat` every second for as long as the episodes' event loop runs (a blocked loop stops it)."""
        while True:
            self.heartbeat()  # type: ignore[misc]
            await asyncio.sleep(HEARTBEAT_SECONDS)

    async def _play(self, shared: Any, prompt: Prompt, sample: int) -> Episode:
        """One episode; whatever the agent does, its calls are collected and its outcome classified."""
        episode_id = f"e{next(self._ids)}"
        self.proxy.recorder.open(episode_id, max_calls=self.max_calls)
        client = shared.with_options(base_url=self.proxy.episode_url(episode_id))  # shares the connection pool
        try:
            playing = contained(self.agent(client, copy.deepcopy(prompt.answer)))
            value = await asyncio.wait_for(playing, self.episode_timeout)
            reward = episode_reward(value)
            if isinstance(reward, RewardFailure):
                reward = RewardFailure(f"reward_{reward.kind}", reward.message)
        except TimeoutError:
            reward = RewardFailure("agent_timeout", f"timed out after {self.episode_timeout} s (rollout.episode_timeout)")
        except Exception as e:  # the user's agent may raise anything; the episode is dropped and reported
            error = e.original if isinstance(e, AgentExited) else e
            reward = (RewardFailure(error.reason, str(error)) if isinstance(error, NamedFailure)  # an environment's
                      else RewardFailure("agent_raised", f"raised {type(error).__name__}: {error}"))
        finally:
            log = self.proxy.recorder.close(episode_id)
        return Episode(prompt, sample, log, reward)

    def _sequences(self, episode: Episode, reward: float, own: dict[int, float]) -> list[TokenSequence]:
        """One training sequence per recorded call, each carrying the episode's reward (and its own turn's)."""
        name = f"{episode.prompt.id}/{episode.sample}"
        calls = episode.log.calls
        sequences = []
        for call in calls:
            info = {"reward": reward, "group": episode.prompt.id, "trajectory": name, "turn": call.index,
                    "turns": len(calls), "parent": call.follows, "finish_reason": call.completion.finish_reason,
                    "cut": call.parent is None and call.follows is not None,
                    **environment_info(episode.prompt.env, episode.reward.metrics)}  # type: ignore[union-attr]
            if own:
                info["turn_reward"] = own[call.index]
            sequences.append(model_call_sequence(call.prompt, call.completion, info, f"{name}/call{call.index}",
                                                 images=call.images))
        return sequences


def count_calls(log: EpisodeLog, stats: RolloutStats) -> None:
    """Add an episode's calls, cut histories and the sharing they kept or lost to the step's counters."""
    for call in log.calls:
        stats.count_reply(call.completion)
    stats.history_mismatches += log.history_mismatches
    stats.shared_tokens += log.shared_tokens
    stats.sharing_lost_tokens += log.sharing_lost_tokens
    stats.tool_choice_failures += log.tool_choice_failures


def run_coroutine(coroutine: Awaitable[Any]) -> Any:
    """Run to completion on a fresh event loop (in a helper thread if this thread already runs one)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)  # type: ignore[arg-type]
    box: list[Any] = []
    thread = threading.Thread(target=lambda: box.append(asyncio.run(coroutine)))  # type: ignore[arg-type]
    thread.start()
    thread.join()
    return box[0]
