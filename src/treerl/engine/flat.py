"""The reference engine: every sequence on its own, as frameworks train today, without padding.

Step 5 (docs/architecture.md): the reference every engine equals.

Two layouts compute the same thing:
- `"packed"`: sequences laid one after another in rows of at most `max_tokens` tokens, each at its
  own positions and attending causally to itself only (treerl's unit attention with no tree: the
  "remove padding" / variable-length packing of peer trainers). The dense speed baseline.
- `"sequences"`: one model call per sequence through the model's own attention, whatever
  implementation it was loaded with: literally the model's forward on each sequence alone. The
  exactness oracle, and the layout for every model the tree engines cannot route.
Either way a DeepSeek-sparse-attention indexer (treerl.engine.recurrent.WHOLE_ROW_TOPK_INDEXERS) takes, of keys
tied at its k-th index score, the earliest, as torch.topk does on CUDA and DfsEngine does everywhere: on CPU the
model's own forward picks among them by the width of the call, which no engine that computes a prefix once can match.
`"auto"` (default) is whichever is faster on the device: on CUDA packed rows where treerl can route
the model's attention (one call instead of one per sequence); on CPU one call per sequence, which
`treerl bench` measured faster on every workload (packed rows run treerl's attention node by node,
a kernel call per sequence plus the merge, where SDPA runs each sequence in one call).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from transformers import PreTrainedModel

from treerl.attention import Segment, TreeCall, UnitKV, UnitLayout, UnsupportedModel, engine_attention
from treerl.engine.base import (
    Head,
    LossFn,
    StepStats,
    check_batch,
    check_tree_engine,
    final_hidden,
    output_dtype,
    read_positions,
    sum_losses,
    to_device,
)
from treerl.engine.head import PolicyHead
from treerl.engine.images import ImageTable, body_positions, vision_family
from treerl.engine.memory import flat_micro_batches
from treerl.engine.recurrent import earliest_index_ties
from treerl.engine.routing import TreeRoutes, replayed, sequences_rows, tree_routes
from treerl.engine.support import check_all_layers_routed
from treerl.tree import TokenSequence

Layout = Literal["auto", "packed", "sequences"]


@dataclass
class FlatEngine:
    """Each sequence computed independently; the exactness reference and the dense baseline."""

    head: Head = field(default_factory=PolicyHead)
    max_tokens: int = 8192  # tokens per packed row (a longer sequence gets a row of its own)
    layout: Layout = "auto"  # packed rows | one call per sequence through the model's own attention | auto
    head_rows: str | None = None  # outputs computed only where this field is nonzero (loss_mask), 0 elsewhere

    def forward(self, model: PreTrainedModel, sequences: Sequence[TokenSequence]) -> list[dict[str, torch.Tensor]]:
        check_batch(model, self.head, sequences, tree=self.layout == "packed", head_rows=self.head_rows)
        packed = self._packed(model, sequences)
        routes = tree_routes(model, sequences, self.head.shifted)  # MoE routing replay: each node's routing
        results: list[dict[str, torch.Tensor]] = [{} for _ in sequences]
        with torch.no_grad(), self._routed(model, packed):
            for batch in self.micro_batches(sequences, packed):
                with self._replayed(model, routes, sequences, batch):
                    outputs = self._run(model, [sequences[i] for i in batch], packed)
                for i, out in zip(batch, outputs):
                    results[i] = out
        return results

    def forward_backward(self, model: PreTrainedModel, sequences: Sequence[TokenSequence], loss_fn: LossFn) -> StepStats:
        check_batch(model, self.head, sequences, tree=self.layout == "packed", head_rows=self.head_rows)
        packed = self._packed(model, sequences)
        routes = tree_routes(model, sequences, self.head.shifted)  # MoE routing replay: each node's routing
        stats = StepStats(sequences=len(sequences), flat_tokens=sum(len(s) for s in sequences))
        if routes is not None:
            stats.add_metrics(routes.metrics())
        started = time.perf_counter()
        shift = 1 if self.head.shifted else 0
        total = torch.zeros((), dtype=torch.float64)
        with self._routed(model, packed):  # backward too: gradient checkpointing recomputes the layers
            for batch in self.micro_batches(sequences, packed):
                with self._replayed(model, routes, sequences, batch):
                    outputs = self._run(model, [sequences[i] for i in batch], packed)
                stats.model_tokens += sum(len(sequences[i]) - shift for i in batch)
                batch_loss = sum_losses(((i, sequences[i], out) for i, out in zip(batch, outputs)), loss_fn, stats)
                if batch_loss.requires_grad:
                    batch_loss.backward()
                total = total.to(batch_loss.device) + batch_loss.detach().double()
        stats.loss = float(total)
        stats.settle()
        stats.seconds = time.perf_counter() - started
        return stats

    def chosen_layout(self, model: PreTrainedModel) -> str:
        """"packed" or "sequences": what `layout` means for this model (checked at every call)."""
        if self.layout not in ("auto", "packed", "sequences"):
            raise ValueError(f"layout must be 'auto', 'packed' or 'sequences', got {self.layout!r}")
        if self.layout == "sequences" or (self.layout == "auto" and model.device.type == "cpu"):
            return "sequences"
        try:
            check_tree_engine(model, carries_state=False)  # every layer routed (one probe per model), no state
        except UnsupportedModel:
            if self.layout == "packed":
                raise
            return "sequences"
        return "packed"

    def _packed(self, model: PreTrainedModel, sequences: Sequence[TokenSequence]) -> bool:
        """Packed rows, or one call per sequence (always for a batch that shows images: each sequence's own call)."""
        return self.chosen_layout(model) == "packed" and not any(s.images for s in sequences)

    @contextlib.contextmanager
    def _routed(self, model: PreTrainedModel, packed: bool) -> Iterator[None]:
        """The model's attention routed through treerl for packed rows; either way, keys tied at the k-th score of a
        DeepSeek-sparse-attention indexer go to the earliest, as DfsEngine takes them (`earliest_index_ties`)."""
        with engine_attention(model) if packed else contextlib.nullcontext(), earliest_index_ties(model):
            yield

    def _replayed(self, model: PreTrainedModel, routes: TreeRoutes | None, sequences: Sequence[TokenSequence],
                  batch: list[int]) -> contextlib.AbstractContextManager:
        """The call on `batch` with its routers replaying the batch's routes (treerl.engine.routing), if any."""
        shift = 1 if self.head.shifted else 0
        rows = lambda: sequences_rows(routes, batch, [len(sequences[i]) - shift for i in batch])
        return replayed(routes, rows, model.get_input_embeddings().weight.device)

    def micro_batches(self, sequences: Sequence[TokenSequence], packed: bool = True) -> list[list[int]]:
        """One sequence per call, or (packed) sequences in order, a row growing within `max_tokens` tokens."""
        if not packed:
            return [[i] for i in range(len(sequences))]
        shift = 1 if self.head.shifted else 0
        return flat_micro_batches([len(seq) - shift for seq in sequences], self.max_tokens)

    def _run(self, model: PreTrainedModel, batch: list[TokenSequence], packed: bool) -> list[dict[str, torch.Tensor]]:
        """One call on `batch`; per-sequence outputs aligned with tokens (differentiable if grad is on)."""
        shift = 1 if self.head.shifted else 0
        device = model.get_input_embeddings().weight.device
        lengths = [len(s) - shift for s in batch]
        ids = torch.cat([s.tokens[:n] for s, n in zip(batch, lengths)])
        positions = torch.cat([torch.arange(n) for n in lengths])
        targets = torch.cat([s.tokens[shift:] for s in batch])
        if len(ids) == 0:  # one-token sequences: nothing predicts anything
            return [{name: torch.zeros(1, dtype=output_dtype(model), device=device) for name in self.head.outputs}
                    for _ in batch]
        ids, positions, targets = (to_device(x, device) for x in (ids, positions, targets))
        if packed:
            segments, row = [], 0
            for n in lengths:
                if n:
                    segments.append(Segment(row, n, 0))
                    row += n
            call = TreeCall(None, UnitKV(), UnitLayout(segments, [], positions, 0))
            hidden = final_hidden(model, input_ids=ids[None], position_ids=positions[None], treerl_call=call)[0]
            call.forward_done = True  # later calls are gradient checkpointing's recomputation
            check_all_layers_routed(model, call.layers_called)
        elif batch[0].images:  # one sequence: its images through the vision tower, its own rotary positions
            table = ImageTable(model, batch, grad=torch.is_grad_enabled(), attached=True)
            where, rows = (x.to(device) for x in table.span(batch[0], 0, lengths[0]))
            inputs = table.inputs(model, ids[None], rows[None])
            positions = body_positions(where, ids[None].shape)
            family = vision_family(model)
            if family.both_ways:  # an image's tokens see each other both ways: the model's own mask
                inputs["attention_mask"] = family.body_mask(model, (rows >= 0)[None].long(), inputs["inputs_embeds"],
                                                            positions)
            hidden = final_hidden(model, **inputs, position_ids=positions)[0]
        else:
            hidden = final_hidden(model, input_ids=ids[None], position_ids=positions[None])[0]
        outputs = self._head(model, batch, hidden, targets)
        results = []
        for name, pieces in ((name, out.split(lengths)) for name, out in outputs.items()):
            for i, piece in enumerate(pieces):
                if len(results) <= i:
                    results.append({})
                results[i][name] = torch.cat([piece.new_zeros(shift), piece]) if shift else piece
        return results

    def _head(self, model: PreTrainedModel, batch: list[TokenSequence], hidden: torch.Tensor, targets: torch.Tensor,
              ) -> dict[str, torch.Tensor]:
        """The head on the call's rows; with `head_rows` only on those some sequence reads, the others 0 (no graph)."""
        shift = 1 if self.head.shifted else 0
        keep = None if self.head_rows is None else torch.cat([read_positions(s, self.head_rows)[shift:] for s in batch])
        if keep is None or bool(keep.all()):
            return self.head(model, hidden, targets)
        read = to_device(keep.nonzero()[:, 0], hidden.device)
        outputs = self.head(model, hidden[read], targets[read])
        return {name: out.new_zeros(len(targets)).index_copy(0, read, out) for name, out in outputs.items()}
