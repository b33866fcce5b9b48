"""Rollouts: sample from the policy, score the samples, and turn them into training sequences.

Steps 1 and 2 (docs/architecture.md): samples, rewards, training sequences.

Samplers (`EmbeddedSampler` in process, `CompletionsClient` for vLLM / SGLang /
`treerl serve`), tasks (built-in arithmetic and number guessing, a user's data), workflows
(single-turn groups, branching multi-turn episodes, agents written with the OpenAI SDK and recorded by
the chat proxy) and the `Rollout` the trainer calls once per step.
"""

from treerl.rollout.agents.agent import AgentWorkflow, load_agent
from treerl.rollout.agents.proxy import ChatProxy
from treerl.rollout.collect import Rollout, RolloutBatch, build_sampler, tool_format_warning
from treerl.rollout.config import RolloutConfig
from treerl.rollout.conversations.chat import ChatFormat
from treerl.rollout.conversations.tokenizer import builtin_tokenizer, load_tokenizer
from treerl.rollout.rewards.functions import load_reward_fn
from treerl.rollout.sampling.client import CompletionsClient, ServerError
from treerl.rollout.sampling.embedded import EmbeddedSampler
from treerl.rollout.sampling.sampler import Completion, Sampler, SamplingParams
from treerl.rollout.workflows.multi_turn import MultiTurnWorkflow
from treerl.rollout.workflows.single_turn import SingleTurnWorkflow
from treerl.rollout.workflows.stats import DroppedSample, RolloutStats

__all__ = [
    "AgentWorkflow", "ChatFormat", "ChatProxy", "Completion", "CompletionsClient", "DroppedSample", "EmbeddedSampler",
    "MultiTurnWorkflow", "Rollout", "RolloutBatch", "RolloutConfig", "RolloutStats", "Sampler", "SamplingParams",
    "ServerError", "SingleTurnWorkflow", "build_sampler", "builtin_tokenizer", "load_agent", "load_reward_fn",
    "load_tokenizer", "tool_format_warning",
]
