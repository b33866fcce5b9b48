"""Per-token terms of the policy losses: importance ratios, the clipped surrogate, KL estimators.

Step 5 (docs/architecture.md): the per-token terms inside loss_fn.

Every function takes tensors aligned with a sequence's tokens and returns one value per token;
positions outside the loss mask hold harmless values (log-ratios are zeroed there before any
`exp`, so an untrained token can never produce inf or NaN) and are dropped by the aggregation.
"""

from __future__ import annotations

import math

import torch

from treerl.algo.config import IMPORTANCE_LEVEL, REJECTION_LEVEL


def masked_log_ratio(logp: torch.Tensor, other: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log(pi / pi_other) on trained tokens, 0 elsewhere (so exp() of it is finite everywhere)."""
    return torch.where(mask > 0, logp - other, 0.0)


def token_ratio(logp: torch.Tensor, old: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """PPO's per-token importance ratio pi_theta(y_t) / pi_old(y_t)."""
    return torch.exp(masked_log_ratio(logp, old, mask))


def sequence_ratio(logp: torch.Tensor, old: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO-token's ratio: value s = exp(mean_t log(pi/pi_old)) on every token, gradient s * grad log pi_t.

    With one advantage per sequence and the sequence-mean aggregation this is exactly GSPO's
    sequence-level objective (value, clipping and gradient); it also accepts per-token advantages.
    """
    log_s = mean_log_ratio(masked_log_ratio(logp, old, mask), mask)
    return torch.exp(logp - logp.detach() + log_s.detach())


def mean_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The mask-weighted mean of a sequence's log-ratios: the log of its geometric-mean ratio (0 with nothing trained)."""
    trained = mask.sum()
    return (log_ratio * mask).sum() / torch.where(trained > 0, trained, 1.0)


def clipped_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float, dual_clip: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's pessimistic token loss max(-A r, -A clip(r, 1-lo, 1+hi)), and where clipping decided it.

    Dual clip (c > 1): a negative advantage's loss is capped at -c A, so a huge ratio on a bad
    token cannot dominate the batch.
    """
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    was_clipped = clipped > unclipped
    if dual_clip is not None:
        cap = -advantages * dual_clip
        capped = (advantages < 0) & (loss > cap)
        loss = torch.where(capped, cap, loss)
        was_clipped = was_clipped | capped
    return loss, was_clipped.detach()


def behaviour_weight(prox: torch.Tensor, behav: torch.Tensor, mask: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Decoupled PPO's constant weight pi_prox / pi_behav per token; 0 where it exceeds `cap` (token dropped)."""
    weight = torch.exp(masked_log_ratio(prox, behav, mask))
    if cap is not None:
        weight = torch.where(weight > cap, 0.0, weight)
    return weight.detach()


def kl_penalty(logp: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from d = log pi - log pi_ref at the sampled token (Schulman's k1-k3)."""
    d = masked_log_ratio(logp, ref, mask)
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        return torch.expm1(-d) + d
    raise ValueError(f"unknown KL estimator {estimator!r}")


SAFETY_BOUND = 20.0  # verl's rollout_corr_helper clamps log-ratios to +-20 before exp and in its rejection statistics


def rollout_weight(preset: str, log_r: torch.Tensor, log_sum: torch.Tensor, log_mean: torch.Tensor,
                   is_threshold: float) -> torch.Tensor:
    """A decoupled preset's truncated importance weight per token (1 for a preset that only rejects), as verl's
    compute_rollout_correction_weights: exp of the token's log r (token), of its trajectory's sum (sequence) or mean
    (geometric), clamped to +-20, then truncated at C."""
    if preset not in IMPORTANCE_LEVEL:
        return torch.ones_like(log_r)
    level = {"token": log_r, "sum": log_sum, "mean": log_mean}[IMPORTANCE_LEVEL[preset]]
    return torch.exp(level.clamp(-SAFETY_BOUND, SAFETY_BOUND)).clamp(max=is_threshold).expand_as(log_r).detach()


def rollout_kept(preset: str, log_r: torch.Tensor, clamped_sum: torch.Tensor, clamped_mean: torch.Tensor,
                 rs_threshold: float) -> torch.Tensor:
    """1 where a rejecting preset keeps the token, 0 where it rejects it (1 everywhere for the others), as verl's
    compute_rollout_rejection_mask: its K1 statistic -log r (log r clamped to +-20) per token (token_k1), summed
    (seq_sum_k1) or averaged (seq_mean_k1) over the trajectory, kept in [log(1/R), log R]."""
    if preset not in REJECTION_LEVEL:
        return torch.ones_like(log_r)
    statistic = {"token": -log_r.clamp(-SAFETY_BOUND, SAFETY_BOUND), "sum": -clamped_sum,
                 "mean": -clamped_mean}[REJECTION_LEVEL[preset]]
    lower, upper = math.log(1.0 / rs_threshold), math.log(rs_threshold)
    return ((statistic >= lower) & (statistic <= upper)).to(log_r.dtype).expand_as(log_r)
