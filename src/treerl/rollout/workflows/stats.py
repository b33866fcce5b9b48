"""What one rollout step produced and lost: counters the trainer logs, so nothing is silently dropped.

Steps 1 and 2 (docs/architecture.md): what the rollout kept and dropped, for the trainer's metrics.
"""

from __future__ import annotations

import logging
import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from treerl.rollout.sampling.sampler import Completion
from treerl.tree import TokenSequence

if TYPE_CHECKING:
    from treerl.rollout.sampling.prefix_sharing import PrefixCounts

log = logging.getLogger("treerl.rollout")

REPORTED_SAMPLES = 8  # dropped samples kept (with their text) per step; all are counted


@dataclass
class DroppedSample:
    """A sample whose reward could not be computed, with the text needed to debug the reward function."""

    reason: str  # e.g. "reward function raised ValueError: ..."
    group: str
    prompt: str
    completion: str

    def __str__(self) -> str:
        return f"[{self.group}] {self.reason}; prompt={self.prompt!r} completion={self.completion!r}"


@dataclass
class RolloutStats:
    """Counters of one rollout step. A sample is one trajectory: one reply (single-turn) or one root-to-leaf path."""

    prompts: int = 0  # prompts (single-turn) or episodes (multi-turn) started
    samples: int = 0  # trajectories finished, kept or dropped
    sequences: int = 0  # training sequences returned (one per model call per trajectory)
    model_calls: int = 0  # completions sampled
    generated_tokens: int = 0
    truncated_replies: int = 0  # replies cut off at max_new_tokens
    context_limit: int = 0  # trajectories ended (kept, truncated) because the context would exceed max_context_tokens
    history_mismatches: int = 0  # agent calls whose history held earlier replies but extended no recorded call (cut)
    shared_tokens: int = 0  # agent prompt tokens reused from the recorded calls they extend
    sharing_lost_tokens: int = 0  # tokens of the call before a cut history that the call after it no longer shares
    tool_choice_failures: int = 0  # agent replies refused: tool_choice="required" and no tool call written
    prompt_tokens: int = 0  # prompt tokens asked of the embedded sampler (what prefilling each prompt whole runs)
    prefill_tokens: int = 0  # tokens its prefills ran (each shared prefix once)
    cached_tokens: int = 0  # distinct prefix tokens it read from its prefix cache instead
    unshared_calls: int = 0  # its calls that prefilled each prompt whole (a model or images it cannot share)
    padded_chunks: int = 0  # its chunks that could share but prefilled each prompt whole: sharing would not pay
    seconds: float = 0.0
    rewards: list[float] = field(default_factory=list)  # one per kept trajectory
    dropped: Counter[str] = field(default_factory=Counter)  # reason -> count
    dropped_samples: list[DroppedSample] = field(default_factory=list)  # the first REPORTED_SAMPLES, with text

    def count_reply(self, completion: Completion) -> None:
        """Count one sampled reply."""
        self.model_calls += 1
        self.generated_tokens += len(completion.tokens)
        self.truncated_replies += completion.finish_reason == "length"

    def count_prefills(self, counts: PrefixCounts | None) -> None:
        """Add what the embedded sampler prefilled and reused meanwhile (`PrefixCounts` differences; None: a
        sampler that does not count them)."""
        if counts is not None:
            self.prompt_tokens += counts.prompt_tokens
            self.prefill_tokens += counts.prefill_tokens
            self.cached_tokens += counts.cached_tokens
            self.unshared_calls += counts.unshared_calls
            self.padded_chunks += counts.padded_chunks

    def drop(self, sample: DroppedSample, kind: str) -> None:
        """Count a lost sample under `kind` and report it (log warning, kept for the trainer)."""
        self.samples += 1
        self.dropped[kind] += 1
        if len(self.dropped_samples) < REPORTED_SAMPLES:
            self.dropped_samples.append(sample)
            log.warning("dropped sample: %s", sample)

    def drop_over_context(self, prompt_id: str, text: str, tokens: int, budget: int, limit: int | None,
                          samples: int) -> bool:
        """True, with the prompt's `samples` counted as dropped (context_limit), when its `tokens` + the reply
        budget exceed `limit` (rollout.max_context_tokens): no sequence longer than the limit the trainer checked
        the model for at start is ever sampled or trained."""
        if limit is None or tokens + budget <= limit:
            return False
        reason = (f"the prompt has {tokens} tokens; with max_new_tokens {budget} it exceeds "
                  f"rollout.max_context_tokens={limit}")
        for j in range(samples):
            self.drop(DroppedSample(reason, f"{prompt_id}/{j}", text, ""), "context_limit")
        return True

    def keep(self, reward: float) -> None:
        self.samples += 1
        self.rewards.append(reward)

    @property
    def kept(self) -> int:
        return len(self.rewards)

    @property
    def reward_mean(self) -> float:
        return statistics.fmean(self.rewards) if self.rewards else float("nan")

    @property
    def sharing_lost_ratio(self) -> float:
        """Of the tokens later agent calls would reuse from earlier ones, the share cut histories lost."""
        total = self.shared_tokens + self.sharing_lost_tokens
        return self.sharing_lost_tokens / total if total else 0.0

    def metrics(self) -> dict[str, float]:
        """Flat scalars for TensorBoard / JSONL, names prefixed `rollout/`."""
        rewards = self.rewards or [float("nan")]
        out = {
            "rollout/reward_mean": self.reward_mean,
            "rollout/reward_std": statistics.pstdev(rewards) if self.rewards else float("nan"),
            "rollout/reward_min": min(rewards),
            "rollout/reward_max": max(rewards),
            "rollout/prompts": self.prompts,
            "rollout/samples": self.samples,
            "rollout/kept": self.kept,
            "rollout/dropped": sum(self.dropped.values()),
            "rollout/sequences": self.sequences,
            "rollout/model_calls": self.model_calls,
            "rollout/generated_tokens": self.generated_tokens,
            "rollout/truncated_replies": self.truncated_replies,
            "rollout/context_limit": self.context_limit,
            "rollout/history_mismatches": self.history_mismatches,
            "rollout/sharing_lost_tokens": self.sharing_lost_tokens,
            "rollout/sharing_lost_ratio": self.sharing_lost_ratio,
            "rollout/tool_choice_failures": self.tool_choice_failures,
            "rollout/seconds": self.seconds,
            "rollout/tokens_per_second": self.generated_tokens / self.seconds if self.seconds > 0 else 0.0,
        }
        if self.prompt_tokens or self.unshared_calls:  # the embedded sampler's prefills
            needed = self.prefill_tokens + self.cached_tokens
            out.update({"rollout/prompt_tokens": self.prompt_tokens, "rollout/prefill_tokens": self.prefill_tokens,
                        "rollout/cached_tokens": self.cached_tokens,
                        "rollout/prefix_hit_rate": self.cached_tokens / needed if needed else 0.0,
                        "rollout/unshared_calls": self.unshared_calls, "rollout/padded_chunks": self.padded_chunks})
        out.update({f"rollout/dropped_{kind}": count for kind, count in self.dropped.items()})
        return {k: float(v) for k, v in out.items()}


def environment_metrics(sequences: list[TokenSequence]) -> dict[str, float]:
    """Per environment (a sequence's info["env"], rollout.env) over its trajectories: env/<env>/reward_mean,
    env/<env>/samples and the mean of each named metric, env/<env>/<metric>; a task's own named metrics without an
    environment as metrics/<metric>. Each trajectory counts once (a multi-turn one has a sequence per model call)."""
    rewards: dict[str, list[float]] = defaultdict(list)
    values: dict[str, list[float]] = defaultdict(list)
    seen = set()
    for seq in sequences:
        trajectory = seq.info.get("trajectory", seq.name)
        if trajectory in seen or ("env" not in seq.info and not seq.info.get("env_metrics")):
            continue
        seen.add(trajectory)
        env = seq.info.get("env")
        prefix = f"env/{env}/" if env is not None else "metrics/"
        if env is not None:
            rewards[env].append(seq.info["reward"])
        for name, value in seq.info.get("env_metrics", {}).items():
            values[prefix + name].append(value)
    out = {}
    for env, each in rewards.items():
        out[f"env/{env}/reward_mean"] = statistics.fmean(each)
        out[f"env/{env}/samples"] = float(len(each))
    out.update({key: statistics.fmean(each) for key, each in values.items()})
    return out

