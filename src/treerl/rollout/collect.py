"""The rollout of one training step: prompts -> samples -> rewards -> training sequences, plus counters.

Steps 1 and 2 (docs/architecture.md): one step's rollout, from prompts to training sequences.

The trainer's whole interface:

    sampler = build_sampler(config, model)           # embedded, or a client of config.server_url
    rollout = Rollout(config, tokenizer, sampler)
    batch = rollout.collect(step)                    # RolloutBatch(sequences, stats)
    ...train on batch.sequences, log batch.stats.metrics()...
    sampler.version = step + 1                       # after the optimizer step (embedded sampler)

`collect(step)` depends only on (config, step, weights): the prompts of a step and the sampling
seed are derived from them, so resuming at step k repeats step k exactly, with no state to save.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from treerl.errors import UserError
from treerl.rollout.agents.agent import AgentWorkflow, agent_of
from treerl.rollout.agents.proxy import ChatProxy
from treerl.rollout.agents.tool_parsers import detect_tool_parser, no_parser_hint
from treerl.rollout.config import AGENT_TASKS, RolloutConfig
from treerl.rollout.conversations.chat import ChatFormat, template_shows_tools
from treerl.rollout.conversations.images import ImageProcessor
from treerl.rollout.environments.spec import PROXIED, parse_env_specs
from treerl.rollout.rewards.functions import UserCode, load_reward_fn
from treerl.rollout.sampling.client import API_KEY_ENV, CompletionsClient
from treerl.rollout.sampling.embedded import EmbeddedSampler
from treerl.rollout.sampling.prefix_sharing import PrefixCounts
from treerl.rollout.sampling.sampler import Sampler, SamplingParams
from treerl.rollout.tasks import AgentTask, SingleTurnTask, build_task
from treerl.rollout.tasks.base import Prompt, rng_for
from treerl.rollout.workflows.multi_turn import MultiTurnWorkflow
from treerl.rollout.workflows.single_turn import SingleTurnWorkflow
from treerl.rollout.workflows.stats import RolloutStats
from treerl.tree import TokenSequence


@dataclass
class RolloutBatch:
    """One step's training sequences and what happened while making them."""

    sequences: list[TokenSequence]  # may be empty if every sample was dropped: skip the step
    stats: RolloutStats = field(default_factory=RolloutStats)


def build_sampler(config: RolloutConfig, model: PreTrainedModel | None = None,
                  autocast: torch.dtype | None = None) -> Sampler:
    """A client of the `config.server_url` servers if set, connected (a server that cannot be reached or cannot serve
    RL is a UserError; the API key from the environment variable TREERL_API_KEY, never from the config, which
    checkpoints store), else the embedded sampler sampling with `model` (under autocast to `autocast`, as the
    trainer's engines compute: bf16-mixed)."""
    if config.server_urls:
        client = server_client(config)
        client.connect()
        return client
    if model is None:
        raise ValueError("rollout: no rollout.server_url, so the embedded sampler needs the model")
    return EmbeddedSampler(model, autocast=autocast, return_routed_experts=config.return_routed_experts,
                           prefix_sharing=config.prefix_sharing, prefix_cache_tokens=config.prefix_cache_tokens)


def server_client(config: RolloutConfig) -> CompletionsClient:
    """The client of the configured servers, not yet connected (a rollout worker's: connecting is its first call)."""
    return CompletionsClient(config.server_urls, model=config.server_model, timeout=config.request_timeout,
                             server_type=config.server_type, api_key=os.environ.get(API_KEY_ENV))


def tool_format_warning(config: RolloutConfig, tokenizer: PreTrainedTokenizerBase) -> str | None:
    """What an agent run says at its start when its chat template writes no tools (every request offering tools is
    refused), or when rollout.tool_parser=auto finds no tool-call format in it (its agents' tool calls would come back
    as plain text); None when all is well."""
    proxied = config.env is not None and any(spec.library in PROXIED for spec in parse_env_specs(config.env, config.env_args))
    if config.task not in AGENT_TASKS and not proxied:
        return None
    if not template_shows_tools(tokenizer):
        return ("the policy's chat template writes no tools into the prompt: every request offering tools is refused "
                "(template_without_tools); give the policy a template that shows tools with model.tokenizer_path")
    if config.tool_parser != "auto" or detect_tool_parser(tokenizer.chat_template) != "none":
        return None
    return f"{no_parser_hint('auto')} (a request with tool_choice='required' or a named function is refused)"


class Rollout:
    """Makes the training sequences of each step from the configured task."""

    def __init__(self, config: RolloutConfig, tokenizer: PreTrainedTokenizerBase, sampler: Sampler,
                 images: ImageProcessor | None = None, held_out: bool = False):
        """`images`: the policy's image processor (`image_processor(model.config)`), for prompts that show images;
        `held_out`: every step samples the task's held-out evaluation prompts (`held_out_prompts`), not a step's."""
        config.check()
        self.held_out = held_out
        if config.task == "shapes" and images is None:
            raise UserError("rollout.task = 'shapes' shows images: it needs a vision-language model whose images "
                            "treerl feeds, e.g. model.shape=tiny-qwen2.5-vl")
        self.config = config
        self.sampler = sampler
        self.chat = ChatFormat(tokenizer, config.stop_tokens, images)
        reward_fn = load_reward_fn(config.reward_fn) if config.task == "dataset" else None
        self.task: SingleTurnTask | AgentTask = build_task(config, reward_fn, vision=images is not None)
        sampling = SamplingParams(
            n=config.group_size,
            max_new_tokens=config.max_new_tokens or self.task.max_new_tokens,
            temperature=config.temperature,
            top_p=config.top_p,
            top_k=config.top_k,
            min_p=config.min_p,
            stop_token_ids=tuple(self.chat.stop_token_ids),
        )
        # rewards and environments, with a time limit (rollout.env's environments: rollout.env_timeout)
        self.user_code = (UserCode(config.env_timeout, "rollout.env_timeout") if config.task == "env"
                          else UserCode(config.reward_timeout))
        drop_prefix = "env" if config.task == "env" else "reward"
        self.proxy: ChatProxy | None = None
        if config.task in AGENT_TASKS or hasattr(self.task, "agent"):  # an agent's episodes, recorded by the proxy
            self.proxy = ChatProxy(sampler, self.chat, tool_parser=config.tool_parser, temperature=config.temperature,
                                   top_p=config.top_p, top_k=config.top_k, min_p=config.min_p,
                                   max_new_tokens=sampling.max_new_tokens,
                                   max_context_tokens=config.max_context_tokens)
            self.workflow: SingleTurnWorkflow | MultiTurnWorkflow | AgentWorkflow = AgentWorkflow(
                agent_of(config.agent or self.task.agent), self.proxy, group_size=config.group_size,  # type: ignore[union-attr]
                episode_timeout=config.episode_timeout, max_concurrent_episodes=config.max_concurrent_episodes,
                max_calls=config.max_turns or getattr(self.task, "max_turns", None),
            )
        elif hasattr(self.task, "environment"):
            self.workflow = MultiTurnWorkflow(
                self.task, self.chat, sampling, group_size=config.group_size, branch_at=tuple(config.branch_at),
                branch_factor=config.branch_factor, max_turns=config.max_turns or self.task.max_turns,
                max_context_tokens=config.max_context_tokens, user_code=self.user_code, drop_prefix=drop_prefix,
                library=config.task == "env",
            )
        else:
            self.workflow = SingleTurnWorkflow(self.task, self.chat, sampling, self.user_code,
                                               max_context_tokens=config.max_context_tokens, drop_prefix=drop_prefix)

    def watch(self, beat: Callable[[], None]) -> None:
        """Call `beat` before every reward or environment call and every second while agent episodes run (an
        asynchronous rollout worker's sign of life while it waits on user code)."""
        self.user_code.on_call = beat
        if isinstance(self.workflow, AgentWorkflow):
            self.workflow.heartbeat = beat

    def collect(self, step: int) -> RolloutBatch:
        """The training sequences of step `step` (held out: the evaluation set, sampled with the step's seed) and
        their counters."""
        count = self.config.prompts_per_step
        prompts = self.task.held_out_prompts(count) if self.held_out else self.task.prompts(step, count)
        return self.sample(prompts, rng_for("sampling", self.config.seed, step).getrandbits(62))

    def sample(self, prompts: list[Prompt], seed: int) -> RolloutBatch:
        """The sequences of `prompts`, sampled with `seed`, and their counters."""
        stats = RolloutStats()
        started = time.perf_counter()
        counts = PrefixCounts.of(self.sampler)
        sequences = self.workflow.run(self.sampler, prompts, stats, seed=seed)
        stats.count_prefills(counts and PrefixCounts.of(self.sampler) - counts)
        stats.seconds = time.perf_counter() - started
        return RolloutBatch(sequences, stats)

    def close(self) -> None:
        """Stop the agent proxy's server, if this rollout runs one."""
        if self.proxy is not None:
            self.proxy.stop()
