"""Rollouts: sample from the policy, score the samples, and turn them into training sequences.

Steps 1 and 2 (docs/architecture.md): samples, rewards, training sequences.

Samplers (`EmbeddedSampler` in process, `CompletionsClient` for vLLM / SGLang /
`treerl serve`), tasks (built-in arithmetic and number guessing, a user's data), workflows
(single-turn groups, branching multi-turn episodes, agents written with the OpenAI SDK and recorded by
the chat proxy) and the `Rollout` the trainer calls once per step.
"""

from treerl.rollout.agent import AgentWorkflow, load_agent
from treerl.rollout.chat import ChatFormat
from treerl.rollout.client import CompletionsClient, ServerError
from treerl.rollout.collect import Rollout, RolloutBatch, build_sampler, tool_format_warning
from treerl.rollout.config import RolloutConfig
from treerl.rollout.embedded import EmbeddedSampler
from treerl.rollout.multi_turn import MultiTurnWorkflow
from treerl.rollout.proxy import ChatProxy
from treerl.rollout.rewards import load_reward_fn
from treerl.rollout.sampler import Completion, Sampler, SamplingParams
from treerl.rollout.single_turn import SingleTurnWorkflow
from treerl.rollout.stats import DroppedSample, RolloutStats
from treerl.rollout.tokenizer import builtin_tokenizer, load_tokenizer

__all__ = [
    "AgentWorkflow", "ChatFormat", "ChatProxy", "Completion", "CompletionsClient", "DroppedSample", "EmbeddedSampler",
    "MultiTurnWorkflow", "Rollout", "RolloutBatch", "RolloutConfig", "RolloutStats", "Sampler", "SamplingParams",
    "ServerError", "SingleTurnWorkflow", "build_sampler", "builtin_tokenizer", "load_agent", "load_reward_fn",
    "load_tokenizer", "tool_format_warning",
]
