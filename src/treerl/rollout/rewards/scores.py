"""Evaluation scores of a held-out set: per prompt its mean reward, mean@n and unbiased pass@k; over the prompts their
means with standard errors, overall and per environment, and the named metrics; two models' paired differences.

After step 2 (docs/architecture.md): how good a model's samples are, as `treerl eval` reports it.

    scores = prompt_scores(batch.sequences, samples=8, pass_reward=1.0)   # one PromptScore per prompt
    table = summarise(scores, ks=[1, 8])                                   # {"reward_mean": ..., "pass@8": ...}
    diff = paired(scores_a, scores_b, ks=[1, 8])                           # {"reward_mean": {"a", "b", "diff", "se"}}

A sample *passes* when its reward is at least `pass_reward`. Each prompt's n = the samples asked of it: a sample that
was dropped (its reward could not be computed, it outgrew the context ...) counts as failing in mean@n and pass@k
and is left out of the mean reward. mean@n is the share of a prompt's n samples that pass (the expected success of
one sample); pass@k is the unbiased estimate of the chance that at least one of k samples passes, 1 - C(n-c, k) /
C(n, k) with c of the n passing (Chen et al. 2021, "Evaluating Large Language Models Trained on Code"). Every figure
is a mean over prompts, each prompt counting once, with its standard error over the prompts (sample standard
deviation / sqrt(prompts); null with one prompt).
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from treerl.tree import TokenSequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimator of pass@k from n samples of which c pass: 1 - C(n-c, k) / C(n, k), as a product (no
    large binomials)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


@dataclass
class PromptScore:
    """One prompt's samples: how many were asked (n), the kept ones' rewards, how many passed, their named metrics."""

    group: str
    env: str | None
    n: int
    rewards: list[float] = field(default_factory=list)
    passed: int = 0
    metrics: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))

    def reward_mean(self) -> float:
        """The kept samples' mean reward (NaN when every sample was dropped)."""
        return statistics.fmean(self.rewards) if self.rewards else math.nan

    def mean_at_n(self) -> float:
        """The share of the n samples that pass."""
        return self.passed / self.n

    def pass_at(self, k: int) -> float:
        return pass_at_k(self.n, self.passed, k)


def prompt_scores(sequences: list[TokenSequence], samples: int, pass_reward: float,
                  prompts: list[tuple[str, str | None]] | None = None) -> list[PromptScore]:
    """Each prompt's score from its trajectories' sequences (each trajectory once, however many model calls it made);
    `prompts`: every prompt asked, (id, environment), so that one whose every sample was dropped is scored too."""
    scores: dict[str, PromptScore] = {group: PromptScore(group, env, samples) for group, env in prompts or []}
    seen = set()
    for seq in sequences:
        trajectory = seq.info.get("trajectory", seq.name)
        if trajectory in seen:
            continue
        seen.add(trajectory)
        group = seq.info["group"]
        score = scores.setdefault(group, PromptScore(group, seq.info.get("env"), samples))
        if len(score.rewards) == samples:
            raise ValueError(f"prompt {group!r} has more than the {samples} samples asked of it")
        reward = float(seq.info["reward"])
        score.rewards.append(reward)
        score.passed += reward >= pass_reward
        for name, value in seq.info.get("env_metrics", {}).items():
            score.metrics[name].append(float(value))
    return list(scores.values())


def mean_and_error(values: list[float]) -> tuple[float, float]:
    """The mean of `values` (NaN ones left out) and its standard error (NaN with fewer than two)."""
    kept = [v for v in values if not math.isnan(v)]
    if not kept:
        return math.nan, math.nan
    error = statistics.stdev(kept) / math.sqrt(len(kept)) if len(kept) > 1 else math.nan
    return statistics.fmean(kept), error


def per_prompt(score: PromptScore, ks: list[int]) -> dict[str, float]:
    """One prompt's figures, by name: reward_mean, mean@n, pass@k for each k."""
    return {"reward_mean": score.reward_mean(), f"mean@{score.n}": score.mean_at_n(),
            **{f"pass@{k}": score.pass_at(k) for k in ks}}


def summarise(scores: list[PromptScore], ks: list[int]) -> dict[str, Any]:
    """The figures over the prompts (each a mean with "<name>_se"), the counts, and each named metric's mean over the
    kept trajectories (under "metrics")."""
    out: dict[str, Any] = {"prompts": len(scores), "samples": sum(s.n for s in scores),
                           "kept": sum(len(s.rewards) for s in scores)}
    figures = [per_prompt(s, ks) for s in scores]
    for name in figures[0] if figures else ():
        out[name], out[f"{name}_se"] = mean_and_error([f[name] for f in figures])
    metrics: dict[str, list[float]] = defaultdict(list)
    for score in scores:
        for name, values in score.metrics.items():
            metrics[name].extend(values)
    out["metrics"] = {name: statistics.fmean(values) for name, values in sorted(metrics.items())}
    return out


def by_environment(scores: list[PromptScore], ks: list[int]) -> dict[str, dict[str, Any]]:
    """`summarise` for each environment's prompts ({} for a task of treerl's own)."""
    envs = sorted({s.env for s in scores if s.env is not None})
    return {env: summarise([s for s in scores if s.env == env], ks) for env in envs}


def paired(a: list[PromptScore], b: list[PromptScore], ks: list[int]) -> dict[str, dict[str, float]]:
    """Model a against model b on the same prompts: each figure's mean for both, the mean of the per-prompt differences
    a - b and its standard error (paired: a prompt's difficulty cancels)."""
    theirs = {s.group: s for s in b}
    if set(theirs) != {s.group for s in a}:
        raise ValueError("the two evaluations asked different prompts")
    out = {}
    pairs = [(per_prompt(s, ks), per_prompt(theirs[s.group], ks)) for s in a]
    for name in pairs[0][0] if pairs else ():
        ours, other = [p[name] for p, _ in pairs], [q[name] for _, q in pairs]
        diff, error = mean_and_error([x - y for x, y in zip(ours, other)])
        out[name] = {"a": mean_and_error(ours)[0], "b": mean_and_error(other)[0], "diff": diff, "se": error}
    return out
