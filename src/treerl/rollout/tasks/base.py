"""What a task is: prompts for a step, and either a reward function (single-turn) or an environment (multi-turn).

Step 1 (docs/architecture.md): what sampling asks of a task.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Protocol

from treerl.rollout.conversations.chat import Message
from treerl.rollout.rewards.functions import RewardFn


@dataclass
class Prompt:
    """One task instance: the conversation the model sees first and what its reward needs.

    `id` names the group: every sample (trajectory) of this prompt shares it.
    """

    id: str
    messages: list[Message]
    answer: Any = None  # reference answer given to the reward function / environment
    env: str | None = None  # the environment it comes from (rollout.env): its samples are logged under env/<env>/

    @property
    def text(self) -> str:
        """The prompt as a reward function sees it: its last user message (the text of it, where it shows images)."""
        users = [m["content"] for m in self.messages if m["role"] == "user"]
        content = users[-1] if users else self.messages[-1]["content"] if self.messages else ""
        if isinstance(content, list):
            return "".join(part.get("text", "") for part in content if isinstance(part, dict))
        return content


class SingleTurnTask(Protocol):
    """prompt -> one reply -> reward(prompt=..., completion=..., answer=...)."""

    name: str
    max_new_tokens: int  # default reply budget
    reward_fn: RewardFn

    def prompts(self, step: int, count: int) -> list[Prompt]:
        """The `count` prompts of training step `step`; the same for the same step (exact resume)."""
        ...


@dataclass
class EnvReply:
    """What an environment answers to one model reply."""

    messages: list[Message] = field(default_factory=list)  # shown to the model next (e.g. tool results)
    reward: float = 0.0  # this turn's reward; a trajectory's reward is the sum over its turns
    done: bool = False
    metrics: dict[str, float] = field(default_factory=dict)  # named episode info so far (logged per environment, not
    # trained on); a trajectory keeps each name's latest value


class Environment(Protocol):
    """One episode's state. Deep-copied where the episode branches, so `step` may mutate it.

    It may also have `opening`: messages shown after the prompt's before the first reply (what an environment says
    when it is reset, e.g. a game's first observation)."""

    def step(self, reply: str) -> EnvReply:
        """React to the model's reply (its text, without the final stop token)."""
        ...


class AgentTask(Protocol):
    """Multi-turn: the model and an environment take turns until the environment is done."""

    name: str
    max_new_tokens: int  # default budget of one reply
    max_turns: int  # model calls per trajectory at most

    def prompts(self, step: int, count: int) -> list[Prompt]:
        """The `count` episodes of training step `step`; the same for the same step (exact resume)."""
        ...

    def environment(self, prompt: Prompt) -> Environment:
        """A fresh environment for the episode that starts with `prompt`."""
        ...


def rng_for(*keys: object) -> random.Random:
    """A random generator determined by `keys` alone (string seeding is stable across runs and processes)."""
    return random.Random(":".join(str(k) for k in keys))
