"""The `rollout` section of the training config: what to sample, how, and from where."""

from __future__ import annotations

from dataclasses import dataclass, field

from treerl.tree.io import MAX_LINE_BYTES

TASKS = ("arithmetic", "guess_number", "dataset")


@dataclass
class RolloutConfig:
    """Every rollout option. Built-in tasks need nothing else; `dataset` needs `data_path` and `reward_fn`."""

    # What to sample.
    task: str = "arithmetic"  # "arithmetic" (single-turn), "guess_number" (multi-turn, branching), "dataset" (yours)
    prompts_per_step: int = 16  # prompts (single-turn) or episodes (multi-turn) per training step
    group_size: int = 8  # samples per prompt; for multi-turn tasks the replies sampled at turn 0
    seed: int = 0  # seeds the prompt order and the sampling (same seed + step + weights -> same rollout)

    # How to sample.
    max_new_tokens: int | None = None  # reply budget in tokens; None: the task's default
    temperature: float = 1.0  # > 0; the trainer must recompute log-probs at the same temperature
    top_p: float = 1.0  # nucleus sampling; behaviour log-probs stay those of the untruncated distribution
    stop_tokens: list[str] = field(default_factory=list)  # extra tokens that end a reply (besides the eos token)

    # Multi-turn episodes.
    max_turns: int | None = None  # model calls per trajectory at most; None: the task's default
    branch_at: list[int] = field(default_factory=lambda: [1])  # turns (>= 1) where each trajectory forks
    branch_factor: int = 2  # replies sampled at each turn in branch_at
    max_context_tokens: int = 4096  # a trajectory ends before its context + max_new_tokens would exceed this

    # Built-in tasks.
    max_operand: int = 4  # arithmetic: operands in [0, max_operand] (4: one-digit sums, learnt in minutes)
    max_number: int = 9  # guess_number: the secret is in [1, max_number]

    # Your data (task = "dataset").
    data_path: str | None = None  # .jsonl, .json, .parquet, .csv, or a datasets.save_to_disk directory; local only
    prompt_key: str = "prompt"  # field holding the prompt: a string or a list of chat messages
    answer_key: str = "answer"  # field holding the reference answer passed to the reward (optional per row)
    system_prompt: str | None = None  # prepended as a system message to string prompts
    reward_fn: str | None = None  # "module:function" or "file.py:function"; fn(prompt, completion, answer)
    reward_timeout: float | None = 60.0  # seconds one reward (or environment) call may take, else its sample is dropped; null: no limit
    max_line_bytes: int = MAX_LINE_BYTES  # longest line of a JSONL data_path; a longer one is an error naming it
    shuffle: bool = True  # visit rows in a seeded random order, reshuffled every epoch

    # Inference server (None: sample in process with the trainer's model).
    server_url: str | None = None  # OpenAI-compatible server (vLLM, SGLang, treerl serve), e.g. http://127.0.0.1:8000
    server_model: str = "default"  # the model name the server serves
    request_timeout: float = 600.0  # seconds per request

    def check(self) -> None:
        """Reject bad values with the option's name, before anything runs."""
        if self.task not in TASKS:
            raise ValueError(f"rollout.task: unknown task {self.task!r}; known: {', '.join(TASKS)}")
        for name in ("prompts_per_step", "group_size", "branch_factor", "max_context_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"rollout.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_new_tokens", "max_turns"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"rollout.{name} must be >= 1 (or null for the task's default), got {value}")
        if not self.temperature > 0:
            raise ValueError(f"rollout.temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"rollout.top_p must be in (0, 1], got {self.top_p}")
        if any(turn < 1 for turn in self.branch_at):
            raise ValueError(f"rollout.branch_at: turns must be >= 1 (turn 0 samples group_size): {self.branch_at}")
        if self.task == "dataset" and (not self.data_path or not self.reward_fn):
            raise ValueError("rollout.task = 'dataset' needs rollout.data_path and rollout.reward_fn (module:function)")
