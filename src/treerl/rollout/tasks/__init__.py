"""Tasks: built-in ones a tiny model learns from scratch on CPU, and a user's data with a user's reward.

Step 1 (docs/architecture.md): the prompts and rewards (or environments) sampling starts from.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from treerl.rollout.rewards.functions import RewardFn
from treerl.rollout.tasks.agent_tools import AgentTools
from treerl.rollout.tasks.arithmetic import Arithmetic, ArithmeticChat
from treerl.rollout.tasks.base import AgentTask, Environment, EnvReply, Prompt, SingleTurnTask
from treerl.rollout.tasks.dataset import DatasetTask, load_agent_tasks
from treerl.rollout.tasks.guess_number import GuessEnv, GuessNumber
from treerl.rollout.tasks.shapes import Shapes

if TYPE_CHECKING:
    from treerl.rollout.config import RolloutConfig


def build_task(config: RolloutConfig, reward_fn: RewardFn | None = None,
               vision: bool = True) -> SingleTurnTask | AgentTask | AgentTools:
    """The task `config.task` names, with its options from the config (`vision`: whether the model reads images)."""
    if config.task == "arithmetic":
        return Arithmetic(max_operand=config.max_operand, seed=config.seed, eval_fraction=config.eval_fraction)
    if config.task == "arithmetic_chat":
        return ArithmeticChat(max_operand=config.max_operand, seed=config.seed, eval_fraction=config.eval_fraction)
    if config.task == "shapes":
        return Shapes(max_shapes=config.max_shapes, seed=config.seed, eval_fraction=config.eval_fraction)
    if config.task == "guess_number":
        return GuessNumber(max_number=config.max_number, max_turns=config.max_turns or 4, seed=config.seed,
                           eval_fraction=config.eval_fraction)
    if config.task == "dataset":
        if reward_fn is None:
            raise ValueError("rollout.task = 'dataset' needs rollout.reward_fn")
        return DatasetTask.load(
            config.data_path, reward_fn, prompt_key=config.prompt_key, answer_key=config.answer_key,
            system_prompt=config.system_prompt, seed=config.seed, shuffle=config.shuffle,
            max_line_bytes=config.max_line_bytes, image_key=config.image_key, vision=vision,
            eval_path=config.eval_data_path, eval_fraction=config.eval_fraction,
        )
    if config.task == "agent_tools":
        return AgentTools(seed=config.seed, eval_fraction=config.eval_fraction)
    if config.task == "env":
        from treerl.rollout.environments import build_environments  # the libraries' adapters, loaded when named

        return build_environments(config)
    if config.task == "agent":
        return load_agent_tasks(config.data_path, seed=config.seed, shuffle=config.shuffle,  # type: ignore[arg-type]
                                eval_fraction=config.eval_fraction, eval_path=config.eval_data_path)
    raise ValueError(f"rollout.task: unknown task {config.task!r}")


__all__ = [
    "AgentTask", "AgentTools", "Arithmetic", "ArithmeticChat", "DatasetTask", "EnvReply", "Environment", "GuessEnv", "GuessNumber", "Prompt",
    "Shapes", "SingleTurnTask", "build_task",
]
