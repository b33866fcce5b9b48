"""`correct_rollout`: a decoupled `algo.rollout_correction` preset's weights and rejections, fixed once per batch.

Step 3 (docs/architecture.md): after the proximal pass and the advantages, before the update, as verl's
`compute_rollout_correction_and_add_to_batch` (verl/trainer/ppo/rollout_corr_helper.py).

With log r_t = log pi_prox(y_t) - log pi_behav(y_t) on each trained token, a preset writes per token:

    rollout_weight     its truncated importance weight (1 for a preset that only rejects); the loss multiplies the
                       policy term by it (verl's rollout_is_weights)
    loss_mask          the loss mask with the rejected tokens set to 0 (verl writes its rejection into response_mask):
                       they leave the policy, KL and entropy terms, their metrics and every token count
    sampled_loss_mask  the loss mask before the rejection: the mismatch measures read it, and a sequence with a
                       trained token in it still counts in the sequence means (verl's global batch size counts a
                       rejected sequence)

A sequence-level preset (a product or geometric mean of r) runs over a whole trajectory: every sequence with the
same (`info["group"]`, `info["trajectory"]`), as the group advantages count it. verl's sequence is a whole
multi-turn trajectory; treerl makes each model call its own sequence, so a call's weight is its trajectory's
(docs/mismatch.md). Applied again, it gives the same result (it starts from `sampled_loss_mask`).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from treerl.algo.checks import ROLLOUT_WEIGHT, SAMPLED_MASK, check_mask_and_logprobs, loss_setting, require_field
from treerl.algo.config import AlgoConfig, corrects_rollout
from treerl.algo.policy import SAFETY_BOUND, masked_log_ratio, rollout_kept, rollout_weight
from treerl.tree import TokenSequence, validate_sequences

MEAN_EPS = 1e-8  # verl's masked_mean divides by (sum of the mask + 1e-8)


def correct_rollout(config: AlgoConfig, sequences: Sequence[TokenSequence]) -> None:
    """Write `rollout_weight`, the rejection into `loss_mask` and `sampled_loss_mask` for the WHOLE batch, in place;
    nothing for a config without a decoupled preset."""
    if not corrects_rollout(config):
        return
    validate_sequences(sequences)
    purpose = f"needed by {loss_setting(config)}"
    masks, log_ratios = [], []
    for i, seq in enumerate(sequences):
        check_mask_and_logprobs(seq, i)
        mask = seq.fields.get(SAMPLED_MASK, seq.fields["loss_mask"])
        prox = require_field(seq, i, "prox_logprobs", purpose).double()
        behaviour = require_field(seq, i, "old_logprobs", purpose).double()
        masks.append(mask)
        log_ratios.append(masked_log_ratio(prox, behaviour, mask.double()))
    totals = trajectory_totals(sequences, log_ratios, masks)
    is_threshold, rs_threshold = config.correction_thresholds()
    for seq, mask, log_r, (raw_sum, clamped_sum, count) in zip(sequences, masks, log_ratios, totals):
        trained = mask > 0
        weight = rollout_weight(config.rollout_correction, log_r, raw_sum, raw_sum / (count + MEAN_EPS), is_threshold)
        kept = rollout_kept(config.rollout_correction, log_r, clamped_sum, clamped_sum / (count + MEAN_EPS),
                            rs_threshold)
        seq.fields[SAMPLED_MASK] = mask
        seq.fields["loss_mask"] = torch.where(trained & (kept > 0), mask, torch.zeros_like(mask))
        seq.fields[ROLLOUT_WEIGHT] = torch.where(trained, weight, 0.0).to(seq.fields["prox_logprobs"].dtype)


def trajectory_totals(sequences: Sequence[TokenSequence], log_ratios: list[torch.Tensor], masks: list[torch.Tensor]
                      ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per sequence, its trajectory's sum of m_t log r_t, the same with log r_t clamped to +-20, and sum of m_t
    (verl's masked_sum over one response, here over every call of the trajectory)."""
    keys: list[Hashable] = [(seq.info.get("group"), seq.info.get("trajectory", ("sequence", i)))
                            for i, seq in enumerate(sequences)]
    zero = torch.zeros((), dtype=torch.float64)
    totals: dict[Hashable, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    for key, log_r, mask in zip(keys, log_ratios, masks):
        m = mask.double()
        raw, clamped, count = totals.get(key, (zero, zero, zero))
        totals[key] = (raw + (log_r * m).sum(), clamped + (log_r.clamp(-SAFETY_BOUND, SAFETY_BOUND) * m).sum(),
                       count + m.sum())
    return [totals[key] for key in keys]
