"""The reference engine: every sequence on its own, as frameworks train today.

Sequences are sorted by length and grouped into right-padded micro-batches under a token
budget, then run through the model with its own attention implementation (SDPA by default):
what a careful user runs, not a strawman. Shared prefixes are computed once per sequence.
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from treerl.engine.base import Head, LossFn, StepStats, check_batch, final_hidden, sum_losses
from treerl.engine.head import PolicyHead
from treerl.tree import Sequence


@dataclass
class FlatEngine:
    """Each sequence computed independently; the exactness reference and the "dense" baseline."""

    head: Head = field(default_factory=PolicyHead)
    max_tokens: int = 8192  # padded tokens per micro-batch (the same budget as DfsEngine.batch_tokens)

    def forward(self, model: PreTrainedModel, sequences: Seq[Sequence]) -> list[dict[str, torch.Tensor]]:
        check_batch(model, self.head, sequences, tree=False)
        results: list[dict[str, torch.Tensor]] = [{} for _ in sequences]
        with torch.no_grad():
            for batch in self.micro_batches(sequences):
                for i, outputs in zip(batch, self._run(model, [sequences[i] for i in batch])):
                    results[i] = outputs
        return results

    def forward_backward(self, model: PreTrainedModel, sequences: Seq[Sequence], loss_fn: LossFn) -> StepStats:
        check_batch(model, self.head, sequences, tree=False)
        stats = StepStats(sequences=len(sequences), flat_tokens=sum(len(s) for s in sequences))
        started = time.perf_counter()
        total = torch.zeros((), dtype=torch.float64)
        for batch in self.micro_batches(sequences):
            outputs = self._run(model, [sequences[i] for i in batch])
            stats.model_tokens += sum(len(sequences[i]) - (1 if self.head.shifted else 0) for i in batch)
            batch_loss = sum_losses(((i, sequences[i], out) for i, out in zip(batch, outputs)), loss_fn, stats)
            if batch_loss.requires_grad:
                batch_loss.backward()
            total = total + batch_loss.detach().cpu()
        stats.loss = float(total)
        stats.seconds = time.perf_counter() - started
        return stats

    def micro_batches(self, sequences: Seq[Sequence]) -> list[list[int]]:
        """Longest first; a batch grows while (rows x longest row) stays within the token budget."""
        order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i]))
        batches: list[list[int]] = []
        for i in order:
            if batches and (len(batches[-1]) + 1) * len(sequences[batches[-1][0]]) <= self.max_tokens:
                batches[-1].append(i)
            else:
                batches.append([i])
        return batches

    def _run(self, model: PreTrainedModel, batch: list[Sequence]) -> list[dict[str, torch.Tensor]]:
        """One padded forward; per-sequence outputs aligned with tokens (differentiable if grad is on)."""
        shift = 1 if self.head.shifted else 0
        device = model.get_input_embeddings().weight.device
        lengths = [len(s) - shift for s in batch]
        width = max(max(lengths), 1)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        valid = torch.zeros(len(batch), width, dtype=torch.bool)
        for row, (seq, n) in enumerate(zip(batch, lengths)):
            ids[row, :n] = seq.tokens[:n]
            valid[row, :n] = True
        # Right padding needs no padding mask: causality already hides a row's padding from its real
        # tokens, and padding that sees itself never gives a fully masked (NaN) row, even in a window.
        ids, valid = ids.to(device), valid.to(device)
        positions = torch.arange(width, device=device).expand(len(batch), -1)
        hidden = final_hidden(model, input_ids=ids, position_ids=positions)
        rows = hidden[valid]
        targets = torch.cat([seq.tokens[shift:] for seq in batch]).to(device)
        outputs = self.head(model, rows, targets)
        results = []
        offset = 0
        for n in lengths:
            out = {}
            for name, value in outputs.items():
                piece = value[offset : offset + n]
                out[name] = torch.cat([piece.new_zeros(shift), piece]) if shift else piece
            results.append(out)
            offset += n
        return results
