"""The `rollout` section of the training config: what to sample, how, and from where.

Beside the steps (docs/architecture.md): the choices step 1 reads.
"""

from __future__ import annotations

import threading
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

from treerl.rollout.agents.tool_parsers import PARSER_NAMES
from treerl.rollout.environments.spec import parse_env_specs
from treerl.rollout.sampling.client import SERVER_TYPES
from treerl.rollout.sampling.prefix_cache import DEFAULT_TOKENS
from treerl.rollout.tasks.heldout import check_fraction
from treerl.rollout.tasks.shapes import MAX_SHAPES
from treerl.tree.io import MAX_LINE_BYTES

TASKS = ("arithmetic", "arithmetic_chat", "shapes", "guess_number", "dataset", "agent", "agent_tools", "env")
DEFAULT_TASK = "arithmetic"
AGENT_TASKS = ("agent", "agent_tools")


@dataclass
class RolloutConfig:
    """Every rollout option. Built-in tasks need nothing else; `dataset` needs `data_path` and `reward_fn`."""

    # What to sample.
    task: str = DEFAULT_TASK  # arithmetic | arithmetic_chat (the sums asked in words, for pretrained chat models) | shapes (images: a vision-language model.shape) | guess_number (multi-turn) | dataset (yours) | agent (your agent) | agent_tools | env (rollout.env's; set by it)
    prompts_per_step: int = 16  # prompts (single-turn) or episodes (multi-turn) per training step
    group_size: int = 8  # samples per prompt; for multi-turn tasks the replies sampled at turn 0
    seed: int = 0  # seeds the prompt order and the sampling (same seed + step + weights -> same rollout)
    eval_fraction: float = 0.1  # share of the task's items held out of training for evaluation (a generated task's items, a dataset's distinct prompts); 0: evaluation asks training's items. Environments that generate items from a seed evaluate on seeds training never uses (docs/training.md#held-out-evaluation)
    eval_data_path: str | None = None  # dataset and agent tasks: evaluation's rows from this file instead (every row of data_path is then trained on; its rows that data_path also has are left out of evaluation)

    # How to sample.
    max_new_tokens: int | None = None  # reply budget in tokens; None: the task's default
    temperature: float = 1.0  # > 0; the trainer must recompute log-probs at the same temperature
    top_p: float = 1.0  # nucleus sampling (< 1: truncated; behaviour log-probs are then those of the truncated, renormalised distribution, and the loss is trained as decoupled PPO to correct for it)
    top_k: int = 0  # sample among the k most likely tokens only (0: all; truncated as top_p)
    min_p: float = 0.0  # sample among tokens at least min_p x the most likely one's probability (0: all; truncated as top_p)
    stop_tokens: list[str] = field(default_factory=list)  # extra tokens that end a reply (besides the eos token)
    prefix_cache_tokens: int = DEFAULT_TOKENS  # the embedded sampler (and treerl serve) keeps the K/V of prefixes it computed, up to this many tokens (least recently used out first; never more than a quarter of free memory; emptied at each weight update), so a multi-turn episode's next turn, a branch's sibling or an agent's next request prefills only its new tokens; 0: none (the prompts of one call still share their prefixes)
    prefix_sharing: bool = True  # the embedded sampler computes each prefix its prompts share once (a trie prefilled node by node, shared-prefix decoding) where that pays: always when a call reads or keeps the prefix cache (multi-turn, agents, async workers), else where the prefill it saves outweighs its extra model calls (a tiny model with short prompts goes the padded way; counted in rollout/padded_chunks); false: each prompt always prefilled whole in a left-padded batch, its cache repeated n-fold (the same tokens and log-probs: the tests' reference)
    return_routed_experts: bool = False  # an MoE policy: record the experts each layer routed every token to, with each sample (for trainer.routing_replay; the embedded sampler)

    # Multi-turn episodes.
    max_turns: int | None = None  # model calls per trajectory at most; None: the task's default
    branch_at: list[int] = field(default_factory=lambda: [1])  # turns (>= 1) where each trajectory forks
    branch_factor: int = 2  # replies sampled at each turn in branch_at
    max_context_tokens: int = 4096  # context + reply budget of any model call, at most the model's positions: a multi-turn trajectory ends before it would exceed this; a longer prompt or agent call is dropped (context_limit)

    # Built-in tasks.
    max_operand: int = 4  # arithmetic, arithmetic_chat: operands in [0, max_operand] (4: one-digit sums, learnt in minutes)
    max_number: int = 9  # guess_number: the secret is in [1, max_number]
    max_shapes: int = 3  # shapes: each image shows 1..max_shapes shapes (at most 4), the reply is their count

    # Your data (task = "dataset").
    data_path: str | None = None  # .jsonl, .json, .parquet, .csv, or a datasets.save_to_disk directory; local only
    prompt_key: str = "prompt"  # field holding the prompt: a string or a list of chat messages
    answer_key: str = "answer"  # field holding the reference answer passed to the reward (optional per row)
    image_key: str | None = "image"  # field holding a row's image(s) (path, bytes, datasets Image), shown at the prompt's <image> markers or before its text; null: none
    system_prompt: str | None = None  # the system message before each prompt of rollout.data_path (a string, or chat messages without a system message of their own: with one, refused) or of rollout.env's library (docs/environments.md); refused where nothing reads it (a built-in task, verifiers)
    reward_fn: str | None = None  # "module:function" or "file.py:function"; fn(prompt, completion, answer); with a TRL environment class (rollout.env=trl:...), called as TRL calls its reward_funcs (docs/environments.md)
    # (task = "agent": data_path holds the tasks, one JSON object each, handed whole to the agent)
    reward_timeout: float | None = 60.0  # seconds one reward (or environment) call may take, else its sample is dropped; null: no limit
    max_line_bytes: int = MAX_LINE_BYTES  # longest line of a JSONL data_path; a longer one is an error naming it
    shuffle: bool = True  # visit rows in a seeded random order, reshuffled every epoch

    # Environments of the ecosystem's libraries (docs/environments.md); setting rollout.env makes the task env.
    env: Any = None  # library:name, e.g. reasoning_gym:leg_counting, textarena:GuessTheNumber-v0, openenv:my_pkg.env:MyEnv, openenv+http://127.0.0.1:8000, trl:my_pkg.mod:MyEnvClass, verifiers:ENV_ID; a list mixes them by weight ([reasoning_gym:leg_counting@2, reasoning_gym:basic_arithmetic]) or holds {env, weight, env_args, name} entries
    env_args: dict[str, Any] = field(default_factory=dict)  # passed to the environment's constructor (reasoning-gym's dataset config, TextArena's make); each entry's own env_args win
    env_timeout: float | None = 60.0  # seconds one environment call (reset, step, score) may take, else its episode or sample is dropped (env_timeout); null: no limit

    # Agents (task = "agent": your `async def episode(client, task)`; "agent_tools": the built-in tool world).
    agent: str | None = None  # "file.py:function" or "module:function"; agent_tools: its built-in agent
    tool_parser: str = "auto"  # tool-call format: auto (the chat template's) | hermes (qwen2.5, qwen3) | qwen3_coder (qwen3.5) | llama3_json | none
    episode_timeout: float = 600.0  # seconds one episode may take; a slower one is dropped (agent_timeout)
    max_concurrent_episodes: int = 256  # episodes running at once (each waits on the model most of the time)

    # Inference servers (None: sample in process with the trainer's model). docs/training.md#training-with-a-vllm-server
    server_url: str | list[str] | None = None  # a vLLM / SGLang / treerl serve server, e.g. http://127.0.0.1:8000, or a list of them (requests balanced, weights pushed to every one)
    server_model: str = "default"  # the model name the servers serve (vLLM: --served-model-name)
    server_type: str = "auto"  # auto (read from each server) | vllm (started with VLLM_SERVER_DEV_MODE=1) | sglang
    request_timeout: float = 600.0  # seconds per request
    weights_dir: str | None = None  # where each step's weights are written for the servers to load (a path they read); null: under /dev/shm when every server is on this machine, else output_dir/server_weights

    @property
    def server_urls(self) -> list[str]:
        """`server_url` as a list (empty: sample in process)."""
        if self.server_url is None:
            return []
        return [self.server_url] if isinstance(self.server_url, str) else list(self.server_url)

    @property
    def truncates(self) -> bool:
        """Samples are drawn from a cut-down distribution (top_p, top_k or min_p)."""
        return self.top_p < 1 or self.top_k > 0 or self.min_p > 0

    def check(self) -> None:
        """Reject bad values with the option's name, before anything runs."""
        if self.task not in TASKS:
            raise ValueError(f"rollout.task: unknown task {self.task!r}; known: {', '.join(TASKS)}")
        check_env(self)
        check_numbers(self)
        if self.system_prompt and (self.task not in ("dataset", "env") or self.env is not None and any(
                spec.library == "verifiers" for spec in parse_env_specs(self.env, self.env_args))):
            what = "verifiers' tasksets (their own prompts)" if self.task == "env" else f"rollout.task={self.task}"
            raise ValueError(f"rollout.system_prompt is set, and {what} would not show it: unset it (it is read by "
                             "rollout.task=dataset and by rollout.env's reasoning-gym, TextArena, OpenEnv and TRL)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"rollout.top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"rollout.min_p must be in [0, 1) (0: no limit), got {self.min_p}")
        if not 1 <= self.max_shapes <= MAX_SHAPES:
            raise ValueError(f"rollout.max_shapes={self.max_shapes} must be in [1, {MAX_SHAPES}] (one shape a cell of "
                             "the shapes task's image)")
        if any(turn < 1 for turn in self.branch_at):
            raise ValueError(f"rollout.branch_at: turns must be >= 1 (turn 0 samples group_size): {self.branch_at}")
        if self.task == "dataset" and (not self.data_path or not self.reward_fn):
            raise ValueError("rollout.task = 'dataset' needs rollout.data_path and rollout.reward_fn (module:function)")
        check_fraction(self.eval_fraction)
        if self.eval_data_path is not None and self.task not in ("dataset", "agent"):
            raise ValueError(f"rollout.eval_data_path is for rollout.task=dataset or agent (rows of your own), not "
                             f"{self.task}: its held-out items are chosen by rollout.eval_fraction")
        if self.task == "agent" and (not self.data_path or not self.agent):
            raise ValueError("rollout.task = 'agent' needs rollout.agent (my_agent.py:episode) and rollout.data_path "
                             "(a JSONL of tasks)")
        if self.tool_parser not in PARSER_NAMES:
            raise ValueError(f"rollout.tool_parser: {self.tool_parser!r} is not one of {', '.join(PARSER_NAMES)}")
        if self.server_url is not None and not self.server_urls:
            raise ValueError("rollout.server_url is an empty list: give one URL or several, or null to sample in "
                             "process")
        for server in self.server_urls:
            check_server_url(server, "rollout.server_url")
        if self.server_type not in SERVER_TYPES:
            raise ValueError(f"rollout.server_type: {self.server_type!r} is not one of {', '.join(SERVER_TYPES)}")


# The rollout's counts, sizes and timeouts, checked in one place: the key (under rollout.) and its least value.
AT_LEAST = {"prompts_per_step": 1, "group_size": 1, "branch_factor": 1, "max_context_tokens": 1, "max_number": 1,
            "max_concurrent_episodes": 1, "max_line_bytes": 1, "max_operand": 0, "top_k": 0, "prefix_cache_tokens": 0}
AT_LEAST_ONE_OR_NULL = ("max_new_tokens", "max_turns")  # null: the task's default
POSITIVE = ("temperature", "request_timeout", "episode_timeout", "reward_timeout", "env_timeout")  # timeouts in seconds; null: no limit
TIMEOUTS = ("request_timeout", "episode_timeout", "reward_timeout", "env_timeout")  # at most the longest wait Python times


def check_env(config: RolloutConfig) -> None:
    """`rollout.env` names what to train on, so the task is `env` (set here); another task beside it is refused, as
    are a task `env` without it and a bad spec (its syntax: the library's names are checked when it is built)."""
    if config.env is None:
        if config.task == "env":
            raise ValueError("rollout.task=env needs rollout.env, e.g. rollout.env=reasoning_gym:leg_counting")
        if config.env_args:
            raise ValueError("rollout.env_args is set but rollout.env is not: name the environment they configure")
        return
    if config.task not in (DEFAULT_TASK, "env"):
        raise ValueError(f"rollout.env={config.env!r} and rollout.task={config.task} both say what to train on: set "
                         "one of the two")
    specs = parse_env_specs(config.env, config.env_args)
    if not any(spec.library == "trl" for spec in specs):  # TRL classes reset with data_path's rows, score with reward_fn
        for key in ("data_path", "reward_fn"):
            if getattr(config, key):
                raise ValueError(f"rollout.{key}={getattr(config, key)!r} is set beside rollout.env={config.env!r}, "
                                 f"whose environments bring their own {'data' if key == 'data_path' else 'scorer'}: "
                                 f"it would be ignored (only a TRL environment class, trl:..., takes rollout.{key}); "
                                 "unset one of the two")
    config.task = "env"


def check_numbers(config: RolloutConfig) -> None:
    """Every count, size and timeout of the section against its table above (a ValueError naming the key)."""
    for name, least in AT_LEAST.items():
        if getattr(config, name) < least:
            raise ValueError(f"rollout.{name}={getattr(config, name)} must be >= {least}")
    for name in AT_LEAST_ONE_OR_NULL:
        if getattr(config, name) is not None and getattr(config, name) < 1:
            raise ValueError(f"rollout.{name}={getattr(config, name)} must be >= 1 (or null for the task's default)")
    for name in POSITIVE:
        if getattr(config, name) is not None and not getattr(config, name) > 0:
            raise ValueError(f"rollout.{name}={getattr(config, name)} must be > 0")
    for name in TIMEOUTS:
        if getattr(config, name) is not None and getattr(config, name) > threading.TIMEOUT_MAX:
            null = " (null: no limit)" if name in ("reward_timeout", "env_timeout") else ""
            raise ValueError(f"rollout.{name}={getattr(config, name):g} is longer than Python can wait "
                             f"({threading.TIMEOUT_MAX:.3g} s){null}")


def check_server_url(url: str, key: str) -> None:
    """An inference server's address: http(s), a host, and a TCP port if one is given (`urllib` would take 99999 as
    port 34463, and a port that is no number would fail at the first request)."""
    parts = urllib.parse.urlsplit(url)
    example = "e.g. http://127.0.0.1:8000"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{key}={url!r} must be an http:// or https:// URL with a host, {example}")
    try:
        port = parts.port
    except ValueError:
        port = -1
    if port is not None and not 1 <= port <= 65535:
        raise ValueError(f"{key}={url!r}: the port must be a number from 1 to 65535, {example}")
