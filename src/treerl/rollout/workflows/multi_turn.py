"""Multi-turn agent episodes that branch: one episode is a tree of model calls.

Steps 1 and 2 (docs/architecture.md): branching episodes, every model call a training sequence.

An episode starts from a prompt. Every turn, each live trajectory asks the model for a reply
and the environment answers it (tool results, a turn reward, done or not). At turn 0 the model
samples `group_size` replies; at each turn listed in `branch_at` every live trajectory forks into
`branch_factor` replies (the environment is deep-copied per branch); otherwise one. A trajectory
is one root-to-leaf path of that tree; all trajectories of an episode form its group.

An environment that cannot be copied (its `copies` is false: a library's class that does not say it copies, one whose
reset ignores the seed and cannot be replayed) is never forked: each of the group_size trajectories of an episode
gets an environment of its own from the task (its own reset and opening), and at a turn of `branch_at` it samples
one reply; the adapter says so once at the start of a run that branches.

Training data, as in docs/design.md's agentic setting ("Measurement"): every model call is its own sequence, the
context so far (token for token what the model saw) plus that reply, so the sequences of a
trajectory extend each other and the prefix tree shares them. A call is emitted once per
trajectory that contains it: a call made before a fork appears in each branch below it, with
identical tokens and that branch's reward (the prefix tree merges the copies, so they cost
nothing), which gives exactly the policy gradient of training each trajectory on its own.

Reward choice: a sequence's `reward` is its trajectory's return (the sum of the environment's
turn rewards along the path); the environment's reward of the turn is in `env_reward`, for inspection
(a `turn_reward` would make the estimators train on per-turn rewards, `treerl.algo.turn_rewards`). Other info: `group`
(the episode), `trajectory` (the path), `turn`, `turns` (calls in the trajectory),
`finish_reason` of the reply, `truncated` (the trajectory hit max_turns or max_context_tokens
before the environment was done; a library's environment, rollout.env, is never trained so: such a trajectory is
dropped as env_truncated, its reason naming the environment's own limit). An episode whose first prompt + max_new_tokens already exceeds
max_context_tokens is not played: its group_size trajectories are dropped (context_limit). An
environment that raises, or returns a NaN/inf reward, drops that trajectory (counted and reported);
its sibling branches go on. So does a step that takes longer than the workflow's `user_code` timeout
(`rollout.reward_timeout`).

Images (a vision-language policy): the prompt and each environment answer may show images (content parts, as in
`treerl.rollout.conversations.images`: a GUI environment's screenshot a turn). A trajectory carries its context's images; a branch
shares those before its fork, so each screenshot is one node of the episode's tree. An answer whose image cannot be read
drops its trajectory (environment_image).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace

from treerl.errors import UserError
from treerl.rollout.conversations.chat import ChatFormat
from treerl.rollout.rewards.functions import SCORERS, RewardFailure, UserCode, check_metrics, check_reward
from treerl.rollout.sampling.sampler import Completion, Sampler, SamplingParams, images_kwarg
from treerl.rollout.tasks.base import AgentTask, Environment, Prompt, rng_for
from treerl.rollout.workflows.sequences import environment_info, model_call_sequence
from treerl.rollout.workflows.stats import DroppedSample, RolloutStats
from treerl.tree import ImageSpan, TokenSequence


@dataclass(frozen=True)
class ModelCall:
    """One reply of the model in an episode, and the context it was sampled from."""

    context: list[int]
    completion: Completion
    turn: int
    turn_reward: float
    images: tuple[ImageSpan, ...] = ()  # the images the context shows


@dataclass
class Trajectory:
    """A path through the episode tree, in progress or finished."""

    prompt: Prompt
    env: Environment
    context: list[int]  # what the model sees at the next turn
    id: str
    images: tuple[ImageSpan, ...] = ()  # the images the context shows (the prompt's, then the environment's)
    calls: list[ModelCall] = field(default_factory=list)
    reward: float = 0.0
    truncated: bool = False
    metrics: dict[str, float] = field(default_factory=dict)  # the environment's named info, latest value of each

    def fork(self, branch: int) -> Trajectory:
        """A branch that shares the calls so far and owns a copy of the environment."""
        return replace(self, env=copy.deepcopy(self.env), calls=list(self.calls), id=f"{self.id}/{branch}",
                       metrics=dict(self.metrics))


@dataclass
class MultiTurnWorkflow:
    """Plays a batch of episodes turn by turn, all live trajectories in one sampler call per turn."""

    task: AgentTask
    chat: ChatFormat
    sampling: SamplingParams  # n and seed are set per turn
    group_size: int = 4
    branch_at: tuple[int, ...] = (1,)
    branch_factor: int = 2
    max_turns: int = 4
    max_context_tokens: int = 4096
    user_code: UserCode = field(default_factory=UserCode)  # runs the environment's steps (time limit per call)
    drop_prefix: str = "reward"  # the reasons of dropped trajectories: reward_raised ... ("env" for rollout.env's)
    library: bool = False  # rollout.env's environments: a trajectory cut by max_turns or max_context_tokens before
    # the environment ended it is dropped (env_truncated), never trained as if its reward so far were the episode's

    def run(
        self, sampler: Sampler, prompts: list[Prompt], stats: RolloutStats, seed: int | None = None
    ) -> list[TokenSequence]:
        """The training sequences of the episodes that start with `prompts`; `stats` counts what happened."""
        stats.prompts += len(prompts)
        live = [start for p in prompts for start in self._starts(p, stats)]
        finished: list[Trajectory] = []
        for turn in range(self.max_turns):
            if not live:
                break
            counts = [self._replies(t, turn) for t in live]
            groups = self._generate(sampler, live, counts, turn, seed)
            next_live = []
            for parent, n, group in zip(live, counts, groups):
                for j, completion in enumerate(group):
                    child = parent.fork(j) if n > 1 else parent
                    outcome = self._play(child, completion, turn, stats)
                    if outcome == "continues":
                        next_live.append(child)
                    elif outcome == "ended":
                        finished.append(child)
            live = next_live
        for trajectory in live:  # max_turns reached before the environment was done
            if self.library:
                self._drop_cut(trajectory, f"rollout.max_turns={self.max_turns} replies", stats)
                continue
            trajectory.truncated = True
            finished.append(trajectory)
        sequences = []
        for trajectory in finished:
            stats.keep(trajectory.reward)
            sequences.extend(self._sequences(trajectory))
        stats.sequences += len(sequences)
        return sequences

    def _starts(self, prompt: Prompt, stats: RolloutStats) -> list[Trajectory]:
        """The live trajectories an episode starts with: one, forked into group_size by copies of its environment at
        turn 0; or, where the environment cannot be copied (`copies` false), group_size, each with an environment of
        its own from the task (its own reset, its own opening)."""
        env = self.user_code.call(lambda: self.task.environment(prompt))  # a failure if it raised or timed out
        if isinstance(env, RewardFailure):
            self._drop_episode(prompt, f"{SCORERS[self.drop_prefix]} reset {env.message}", env.kind, stats)
            return []
        if getattr(env, "copies", True):
            start = self._start(prompt, env, prompt.id, self.group_size, stats)
            return [start] if start is not None else []
        starts = []
        for j in range(self.group_size):
            own = env if j == 0 else self.user_code.call(lambda: self.task.environment(prompt))
            if isinstance(own, RewardFailure):
                reason = f"{SCORERS[self.drop_prefix]} reset {own.message}"
                stats.drop(DroppedSample(reason, f"{prompt.id}/{j}", prompt.text, ""), f"{self.drop_prefix}_{own.kind}")
            elif (start := self._start(prompt, own, f"{prompt.id}/{j}", 1, stats)) is not None:
                starts.append(start)
        return starts

    def _start(self, prompt: Prompt, env: Environment, name: str, samples: int,
               stats: RolloutStats) -> Trajectory | None:
        """A trajectory at its first reply, whose context is the prompt and what the environment says at reset; None
        (its `samples` dropped, context_limit) when that context leaves no room for a reply."""
        shown = with_opening(prompt, env)
        context, images = self.chat.prompt_with_images(shown.messages, who=f"prompt {name}")
        if stats.drop_over_context(name, shown.text, len(context), self.sampling.max_new_tokens,
                                   self.max_context_tokens, samples):
            return None
        return Trajectory(shown, env, context, name, images=images)

    def _replies(self, trajectory: Trajectory, turn: int) -> int:
        """How many replies a live trajectory samples at `turn`: group_size at an episode's shared start, branch_factor
        at a turn of branch_at where its environment can be copied, else one."""
        if turn == 0:
            return self.group_size if trajectory.id == trajectory.prompt.id else 1
        copies = getattr(trajectory.env, "copies", True)
        return self.branch_factor if turn in self.branch_at and copies else 1

    def _generate(self, sampler: Sampler, live: list[Trajectory], counts: list[int], turn: int,
                  seed: int | None) -> list[list[Completion]]:
        """Each live trajectory's replies at `turn` (`counts[i]` of them): one sampler call per distinct count."""
        groups: list[list[Completion]] = [[] for _ in live]
        for n in sorted(set(counts)):
            which = [i for i, count in enumerate(counts) if count == n]
            keys = ("turn", seed, turn) if len(set(counts)) == 1 else ("turn", seed, turn, n)
            turn_seed = None if seed is None else rng_for(*keys).getrandbits(62)  # not seed + turn: the next call's
            # seed would be this one's shifted by one, its prompts' streams the same ones again
            answers = sampler.generate([live[i].context for i in which], replace(self.sampling, n=n, seed=turn_seed),
                                       **images_kwarg([live[i].images for i in which]))
            for i, group in zip(which, answers):
                groups[i] = group
        return groups

    def _play(self, trajectory: Trajectory, completion: Completion, turn: int, stats: RolloutStats) -> str:
        """Show the reply to the environment: the trajectory "continues", has "ended", or was "dropped"."""
        stats.count_reply(completion)
        text = self.chat.reply_text(completion.tokens)
        reply = self.user_code.call(lambda: trajectory.env.step(text))  # a failure if it raised or timed out
        reward = reply if isinstance(reply, RewardFailure) else check_reward(getattr(reply, "reward", None))
        metrics = reward if isinstance(reward, RewardFailure) else check_metrics(getattr(reply, "metrics", {}))
        if isinstance(metrics, RewardFailure):
            sample = DroppedSample(f"environment {metrics.message}", trajectory.id, trajectory.prompt.text, text)
            stats.drop(sample, f"{self.drop_prefix}_{metrics.kind}")
            return "dropped"
        trajectory.calls.append(ModelCall(trajectory.context, completion, turn, reward, trajectory.images))
        trajectory.reward += reward
        trajectory.metrics.update(metrics)
        if reply.done:
            return "ended"
        context = trajectory.context + completion.tokens
        try:
            continuation, images = self.chat.continuation_with_images(
                reply.messages, reply_stopped=completion.finish_reason == "stop", offset=len(context),
                who=f"the environment's answer at turn {turn}")
        except UserError as e:  # an image it shows cannot be read, or the model takes none: the trajectory is lost
            stats.drop(DroppedSample(str(e), trajectory.id, trajectory.prompt.text, text), "environment_image")
            return "dropped"
        context += continuation
        if len(context) + self.sampling.max_new_tokens > self.max_context_tokens:
            stats.context_limit += 1
            if self.library:
                self._drop_cut(trajectory, f"rollout.max_context_tokens={self.max_context_tokens} (its context with "
                               "the next reply's budget)", stats)
                return "dropped"
            trajectory.truncated = True
            return "ended"
        trajectory.context, trajectory.images = context, trajectory.images + images
        return "continues"

    def _drop_cut(self, trajectory: Trajectory, bound: str, stats: RolloutStats) -> None:
        """Count a library environment's trajectory that treerl's own bound cut before the environment ended it: it
        has no reward of the environment's to train on (env_truncated), and the reason names the environment's own
        limit where it has one (`limit`)."""
        limit = getattr(trajectory.env, "limit", None)
        reason = f"environment episode cut at {bound} before it ended" + (f" ({limit})" if limit else "")
        reply = self.chat.reply_text(trajectory.calls[-1].completion.tokens) if trajectory.calls else ""
        stats.drop(DroppedSample(reason, trajectory.id, trajectory.prompt.text, reply), f"{self.drop_prefix}_truncated")

    def _drop_episode(self, prompt: Prompt, reason: str, kind: str, stats: RolloutStats) -> None:
        """Count the `group_size` trajectories of an episode that could not start (its environment failed)."""
        for j in range(self.group_size):
            stats.drop(DroppedSample(reason, f"{prompt.id}/{j}", prompt.text, ""), f"{self.drop_prefix}_{kind}")

    def _sequences(self, trajectory: Trajectory) -> list[TokenSequence]:
        """One sequence per model call of the trajectory, each carrying the trajectory's reward."""
        return [
            model_call_sequence(
                call.context,
                call.completion,
                info={"reward": trajectory.reward, "env_reward": call.turn_reward, "group": trajectory.prompt.id,
                      "trajectory": trajectory.id, "turn": call.turn, "turns": len(trajectory.calls),
                      "finish_reason": call.completion.finish_reason, "truncated": trajectory.truncated,
                      **environment_info(trajectory.prompt.env, trajectory.metrics)},
                name=f"{trajectory.id}/turn{call.turn}",
                images=call.images,
            )
            for call in trajectory.calls
        ]


def with_opening(prompt: Prompt, env: Environment) -> Prompt:
    """The prompt followed by what the environment says before the first reply, if it says anything: its `opening`
    messages (a game's first observation, set when it is reset)."""
    opening = getattr(env, "opening", None)
    return replace(prompt, messages=[*prompt.messages, *opening]) if opening else prompt

