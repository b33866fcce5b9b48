"""The batch-wide denominators of a loss mean, and the three ways of aggregating token losses.

Steps 3 and 5 (docs/architecture.md): counted over the whole batch (3), applied in each sequence's loss (5).

A per-sequence `loss_fn` sees one sequence, but "mean over the batch" needs the whole batch's
token and sequence counts. `LossNormalizer` holds them; it is computed once from the loss
masks of the WHOLE (global) batch and closed over by the loss, so the sum of the per-sequence
losses is the same number whether the batch runs flat, as one tree, as several trees, as
micro-batches, or spread over data-parallel ranks:

    token_mean            sum_s sum_t m_st l_st / N_tokens
    seq_mean_token_mean   sum_s (sum_t m_st l_st / sum_t m_st) / N_sequences
    seq_sum               sum_s sum_t m_st l_st / (N_sequences * seq_sum_scale)

N_tokens = sum of every loss mask, N_sequences = number of sequences with a trained token
(a sequence whose mask is all zero adds 0 to the loss and to the counts; one whose every token a
rollout-correction preset rejected adds 0 to the loss and still counts, as in verl, from its
`sampled_loss_mask`: `treerl.algo.correct_rollout`). Both counts are sums
over sequences: data-parallel ranks all-reduce (SUM) `[tokens, sequences]` of their local
normalisers, or add them with `+`. A batch with no trained token at all has loss 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from treerl.algo.checks import SAMPLED_MASK, check_loss_mask
from treerl.tree import TokenSequence, validate_sequences


@dataclass(frozen=True)
class LossNormalizer:
    """Global batch counts: trained tokens (sum of loss masks) and sequences with a trained token."""

    tokens: float
    sequences: int

    @classmethod
    def from_sequences(cls, sequences: Sequence[TokenSequence]) -> LossNormalizer:
        """Counts of `sequences` (pass the whole batch, or add the per-rank results)."""
        validate_sequences(sequences)
        tokens, count = 0.0, 0
        for i, seq in enumerate(sequences):
            check_loss_mask(seq, i)
            tokens += float(seq.fields["loss_mask"].sum())
            sampled = float(seq.fields.get(SAMPLED_MASK, seq.fields["loss_mask"]).sum())
            count += int(sampled > 0)
        return cls(tokens=tokens, sequences=count)

    def __add__(self, other: LossNormalizer) -> LossNormalizer:
        """The counts of two disjoint parts of one batch together (e.g. two ranks' local batches)."""
        return LossNormalizer(self.tokens + other.tokens, self.sequences + other.sequences)

    def aggregate(
        self, token_values: torch.Tensor, mask: torch.Tensor, mode: str, seq_sum_scale: float = 1.0
    ) -> torch.Tensor:
        """One sequence's share of the batch aggregate of `token_values` (masked positions only)."""
        total = torch.where(mask > 0, token_values * mask, 0.0).sum()
        if mode == "token_mean":
            return total / (self.tokens or 1.0)
        sequences = self.sequences or 1
        if mode == "seq_mean_token_mean":
            trained = mask.sum()
            return total / torch.where(trained > 0, trained, 1.0) / sequences
        if mode == "seq_sum":
            return total / (sequences * seq_sum_scale)
        raise ValueError(f"unknown aggregation {mode!r}")
