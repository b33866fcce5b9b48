"""Training-inference mismatch: how far the sampler's log-probs are from the trainer's own at the same weights.

Beside step 3 (docs/architecture.md): measured once the trainer has recomputed the batch's log-probs (docs/mismatch.md).

With d_t = log pi_train(y_t) - log pi_behav(y_t) on the measured tokens (trained, and sampled at the weights the
trainer recomputed with) and r_t = exp(d_t):

    abs_logprob_diff_mean / _max    mean and max of |d_t|
    kl_k1, kl_k3                    KL(pi_behav || pi_train) from the sampler's own tokens: mean -d_t, mean r_t - 1 - d_t
    ratio_p01 ... ratio_p99         quantiles of r_t (and ratio_min, ratio_max)
    ratio_outside_half_two          share of tokens with r_t < 1/2 or r_t > 2
    seq_geo_ratio_mean / _min / _max  per sequence exp(mean_t d_t), summarised over the batch's sequences

A sequence of a tree holds its own behaviour log-probs even on tokens it shares with others (each came from its own
request), so every measure is over sequences' tokens, not over the tree's unique tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from treerl.algo.checks import ROLLOUT_WEIGHT, SAMPLED_MASK
from treerl.tree import TokenSequence

QUANTILES = {"p01": 0.01, "p05": 0.05, "p50": 0.5, "p95": 0.95, "p99": 0.99}
PREFIX = "mismatch/"


def measured_tokens(seq: TokenSequence, version: int | None) -> torch.Tensor:
    """Trained tokens sampled by the policy `version` (all trained tokens when the sequence has no `versions`), a
    rollout-correction preset's rejected ones included (verl's mismatch metrics read the mask before its rejection)."""
    measured = seq.fields.get(SAMPLED_MASK, seq.fields["loss_mask"]) > 0
    if version is not None and "versions" in seq.fields:
        measured = measured & (seq.fields["versions"] == version)
    return measured


def mismatch_metrics(train: Sequence[torch.Tensor], behaviour: Sequence[torch.Tensor],
                     measured: Sequence[torch.Tensor]) -> dict[str, float]:
    """The mismatch measures of a batch, from each sequence's trainer and sampler log-probs on its measured tokens."""
    diffs = [(t.double() - b.double())[m] for t, b, m in zip(train, behaviour, measured)]
    d = torch.cat(diffs) if diffs else torch.zeros(0, dtype=torch.float64)
    if d.numel() == 0:
        return {f"{PREFIX}tokens": 0.0}
    ratio = torch.exp(d)
    geometric = torch.exp(torch.stack([each.mean() for each in diffs if each.numel()]))
    metrics = {
        "tokens": float(d.numel()),
        "abs_logprob_diff_mean": float(d.abs().mean()), "abs_logprob_diff_max": float(d.abs().max()),
        "kl_k1": float((-d).mean()), "kl_k3": float((torch.expm1(d) - d).mean()),
        "ratio_min": float(ratio.min()), "ratio_max": float(ratio.max()),
        "ratio_outside_half_two": float(((ratio < 0.5) | (ratio > 2.0)).double().mean()),
        "seq_geo_ratio_mean": float(geometric.mean()), "seq_geo_ratio_min": float(geometric.min()),
        "seq_geo_ratio_max": float(geometric.max()),
    }
    quantiles = torch.quantile(ratio, torch.tensor(list(QUANTILES.values()), dtype=ratio.dtype))
    metrics.update({f"ratio_{name}": float(q) for name, q in zip(QUANTILES, quantiles)})
    return {PREFIX + key: value for key, value in metrics.items()}


def correction_metrics(sequences: Sequence[TokenSequence]) -> dict[str, float]:
    """What a decoupled `rollout_correction` preset did to the batch (`correct_rollout`): the mean weight over the
    trained tokens (a rejected token weighs 0) and the share of them it rejected."""
    weights, rejected = [], []
    for seq in sequences:
        if ROLLOUT_WEIGHT not in seq.fields:
            continue
        sampled = seq.fields.get(SAMPLED_MASK, seq.fields["loss_mask"]) > 0
        kept = seq.fields["loss_mask"] > 0
        weights.append(torch.where(kept, seq.fields[ROLLOUT_WEIGHT].double(), 0.0)[sampled])
        rejected.append((~kept)[sampled])
    weight = torch.cat(weights) if weights else torch.zeros(0, dtype=torch.float64)
    if weight.numel() == 0:
        return {}
    return {"rollout_correction/weight_mean": float(weight.mean()),
            "rollout_correction/dropped": float(torch.cat(rejected).double().mean())}
