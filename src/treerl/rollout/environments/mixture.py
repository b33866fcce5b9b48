"""Several environments as one task: each prompt drawn from one of them by weight, tagged with its name.

Step 1 (docs/architecture.md): the prompts of a step when `rollout.env` lists several environments.

Every environment of `rollout.env` becomes a task of one of treerl's kinds (single-turn, multi-turn with an
`Environment`, or an agent driven through the recording proxy); all of one run must be of one kind (one workflow
samples a step). Each prompt of step s is drawn from an environment with probability weight / total (seeded by s,
so a step's prompts are the same on resume); an environment asked for k of the step's n prompts gives the first k
of its own n prompts of step s, so each keeps its own stream. The prompt's `env` names its environment, and its
`answer` is wrapped in a `Routed` that sends the reward, environment or agent call back to it. A single environment
is a mixture of one: its samples carry its name all the same.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import Any

from treerl.errors import UserError
from treerl.rollout.agents.agent import agent_of
from treerl.rollout.environments.spec import EnvSpec
from treerl.rollout.tasks.base import Environment, Prompt, rng_for
from treerl.rollout.tasks.heldout import HeldOut


@dataclass(frozen=True)
class Routed:
    """A mixed prompt's answer: the environment it belongs to and that environment's own answer."""

    env: str
    answer: Any


@dataclass
class Member:
    """One environment of the mixture: its spec (name, weight) and the task its adapter built."""

    spec: EnvSpec
    task: Any


def task_kind(task: Any) -> str:
    """Which workflow runs `task`: "agent" (the proxy), "multi_turn" (an Environment per episode) or "single_turn"."""
    if hasattr(task, "agent"):
        return "agent"
    return "multi_turn" if hasattr(task, "environment") else "single_turn"


class Mixture:
    """The prompts of several environments (of one kind), each tagged with its environment."""

    name = "env"

    def __init__(self, members: list[Member], seed: int = 0):
        self.members = {member.spec.name: member for member in members}
        self.weights = [member.spec.weight for member in members]
        self.seed = seed
        self.max_new_tokens = max(member.task.max_new_tokens for member in members)

    def prompts(self, step: int, count: int) -> list[Prompt]:
        """The `count` prompts of step `step`, each from an environment drawn by weight (the same for the same step)."""
        picks = self.picks(rng_for("env_mixture", self.seed, step), count)
        own = {name: iter(self.members[name].task.prompts(step, count)) for name in set(picks)}
        return [self.tagged(name, next(own[name])) for name in picks]

    def held_out_prompts(self, count: int) -> list[Prompt]:
        """The evaluation set: `count` prompts, each from an environment drawn by weight, of its held-out items."""
        picks = self.picks(rng_for("env_mixture", self.seed, "held_out"), count)
        own = {name: iter(self.members[name].task.held_out_prompts(picks.count(name))) for name in set(picks)}
        return [self.tagged(name, next(own[name])) for name in picks]

    def picks(self, rng: random.Random, count: int) -> list[str]:
        """Which environment each of `count` prompts comes from, drawn by weight."""
        return rng.choices(list(self.members), weights=self.weights, k=count)

    @property
    def held_out(self) -> HeldOut:
        """Every environment's held-out items (held out only if every one holds some out)."""
        parts = {name: member.task.held_out for name, member in self.members.items()}
        if len(parts) == 1:
            return next(iter(parts.values()))
        return HeldOut(all(part.held_out for part in parts.values()),
                       "; ".join(f"{name}: {part.how}" for name, part in parts.items()))

    @staticmethod
    def tagged(name: str, prompt: Prompt) -> Prompt:
        """`prompt` of environment `name`: its id made unique in the step, its answer routed back to the environment."""
        return replace(prompt, id=f"{prompt.id}/{name}", env=name, answer=Routed(name, prompt.answer))

    def member(self, answer: Routed) -> tuple[Any, Any]:
        """The task a routed answer belongs to, and the answer it gave."""
        return self.members[answer.env].task, answer.answer


class SingleTurnMixture(Mixture):
    """Single-turn environments: the reward is the prompt's own environment's."""

    def reward_fn(self, prompt: str, completion: str, answer: Routed) -> Any:
        """The environment's own reward (a number or a Scored) for this completion."""
        task, own = self.member(answer)
        return task.reward_fn(prompt=prompt, completion=completion, answer=own)


class MultiTurnMixture(Mixture):
    """Multi-turn environments: each episode is played by its own environment's Environment."""

    def __init__(self, members: list[Member], seed: int = 0):
        super().__init__(members, seed)
        self.max_turns = max(member.task.max_turns for member in members)

    def environment(self, prompt: Prompt) -> Environment:
        """A fresh environment of the prompt's own library, for its episode."""
        task, own = self.member(prompt.answer)
        return task.environment(replace(prompt, answer=own))


class AgentMixture(Mixture):
    """Agent environments (driven through the recording proxy): each episode is played by its own agent."""

    def __init__(self, members: list[Member], seed: int = 0):
        super().__init__(members, seed)
        self.max_turns = max(getattr(member.task, "max_turns", 0) or 0 for member in members) or None

        self.agents = {name: agent_of(member.task.agent) for name, member in self.members.items()}

    async def agent(self, client: Any, task: Routed) -> Any:
        """The episode of the task's own environment, with its own task."""
        return await self.agents[task.env](client, task.answer)


MIXTURES = {"single_turn": SingleTurnMixture, "multi_turn": MultiTurnMixture, "agent": AgentMixture}


def mixture(members: list[Member], seed: int = 0) -> Mixture:
    """The mixture of `members` as a task of their kind (refused in one line if they are of several kinds)."""
    kinds = {member.spec.name: task_kind(member.task) for member in members}
    if len(set(kinds.values())) > 1:
        shown = ", ".join(f"{name} ({kind})" for name, kind in kinds.items())
        raise UserError(f"rollout.env mixes environments of different kinds: {shown}; one run trains one kind "
                        "(single-turn, multi-turn or agent): mix only environments of one kind")
    return MIXTURES[task_kind(members[0].task)](members, seed)
