"""A training sequence: tokens plus the per-token and per-sequence data a loss reads.

Step 2 (docs/architecture.md): what every later step reads.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from treerl.errors import UserError


class BatchError(UserError):
    """Bad input found before any compute; the message names the sequence and the field."""


@dataclass
class TokenSequence:
    """One training sequence.

    `fields` holds per-token tensors aligned with `tokens` (same length): loss mask, advantages,
    behaviour log-probs ... `info` holds per-sequence values: reward, group id, policy version ...
    Sequences that share a prefix may carry different field values on the shared tokens.
    """

    tokens: torch.Tensor
    fields: dict[str, torch.Tensor] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)
    name: str | None = None

    def __post_init__(self) -> None:
        self.tokens = torch.as_tensor(self.tokens, dtype=torch.long).reshape(-1)
        self.fields = {k: torch.as_tensor(v) for k, v in self.fields.items()}

    def __len__(self) -> int:
        return int(self.tokens.numel())

    def label(self, index: int) -> str:
        """How error messages name this sequence."""
        return f"sequence {index}" + (f" ({self.name!r})" if self.name else "")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def validate_sequences(
    sequences: Sequence[TokenSequence],
    vocab_size: int | None = None,
    max_positions: int | None = None,
) -> None:
    """Reject a bad batch before any compute, naming the sequence and the field (docs/design.md, invariant 3)."""
    if len(sequences) == 0:
        raise BatchError("the batch holds no sequences")
    for i, seq in enumerate(sequences):
        if not isinstance(seq, TokenSequence):
            raise BatchError(f"sequence {i}: expected treerl.tree.Sequence, got {type(seq).__name__}")
        who = seq.label(i)
        n = len(seq)
        if n == 0:
            raise BatchError(f"{who}: field 'tokens' is empty")
        if max_positions is not None and 0 < max_positions < n:  # <= 0: the model sets no limit (XLNet)
            raise BatchError(
                f"{who}: field 'tokens' has {n} tokens, more than the model's maximum of {max_positions} positions"
            )
        if vocab_size is not None:
            lo, hi = int(seq.tokens.min()), int(seq.tokens.max())
            if lo < 0 or hi >= vocab_size:
                bad = lo if lo < 0 else hi
                pos = int((seq.tokens == bad).nonzero()[0])
                raise BatchError(
                    f"{who}: field 'tokens' has id {bad} at position {pos}, outside the vocabulary [0, {vocab_size})"
                )
        for key, value in seq.fields.items():
            if value.dim() != 1 or value.numel() != n:
                raise BatchError(
                    f"{who}: field {key!r} has shape {tuple(value.shape)}, but the sequence has {n} tokens"
                )
            if value.is_floating_point() and not bool(torch.isfinite(value).all()):
                pos = int((~torch.isfinite(value)).nonzero()[0])
                raise BatchError(f"{who}: field {key!r} is {value[pos].item()} at token {pos} (NaN/inf not allowed)")
        for key, value in seq.info.items():
            if _is_number(value) and not math.isfinite(value):
                raise BatchError(f"{who}: field {key!r} is {value} (NaN/inf not allowed)")
