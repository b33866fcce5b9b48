"""Tree packing: the whole tree as one sequence with an ancestor-only attention mask.

Step 5 (docs/architecture.md): the tree as one masked sequence.

The unique tokens of one or more trees are laid out in depth-first order, each at its absolute
position (its depth), and every token attends to its own node's earlier tokens and to all
tokens of its ancestor nodes. One forward and one backward compute everything; a token shared
by k sequences feeds k sequences' losses, and autograd sums their gradients ("gradient
restoration" of the Tree Training paper, the "sparse" baseline of AReaL). Cheap for small trees;
the mask is quadratic in the packed length, so large trees are split into packs of whole
top-level subtrees under `max_tokens`.

The model's attention is routed to treerl's packed attention (treerl.attention.PackedCall),
whatever implementation the model was loaded with: a dense boolean mask with SDPA (or exact
math for soft-capping and sinks), or on CUDA a FlexAttention block mask that skips the blocks no
token may see. Sliding windows and chunked attention narrow the mask by position distance.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from treerl.attention import PackedCall, engine_attention
from treerl.engine.base import (
    Head,
    LossFn,
    OutputSlots,
    StepStats,
    check_batch,
    empty_outputs,
    final_hidden,
    run_length,
    sum_losses,
    to_device,
)
from treerl.engine.head import PolicyHead
from treerl.engine.routing import TreeRoutes, replayed, tree_routes
from treerl.engine.support import check_all_layers_routed
from treerl.tree import ROOT, PrefixTree, TokenSequence


@dataclass
class PackedEngine:
    """All unique tokens in one packed call per pack, with a tree (ancestor) attention mask."""

    head: Head = field(default_factory=PolicyHead)
    max_tokens: int = 8192  # unique tokens per pack (a larger single top-level subtree is packed alone)
    flex_attention: bool = True  # on CUDA, use FlexAttention's block-sparse mask
    head_rows: str | None = None  # outputs computed only where this field is nonzero (loss_mask), 0 elsewhere

    def forward(self, model: PreTrainedModel, sequences: Sequence[TokenSequence]) -> list[dict[str, torch.Tensor]]:
        check_batch(model, self.head, sequences, tree=True, head_rows=self.head_rows)
        tree = PrefixTree.build(sequences)
        results: list[dict[str, torch.Tensor]] = [{} for _ in sequences]
        layout = OutputSlots(tree, self.head.shifted, self.head_rows)
        routes = tree_routes(model, tree, self.head.shifted)  # MoE routing replay: each node's routing
        with torch.no_grad(), engine_attention(model):
            for pack in self.packs(tree):
                for s, outputs in self._run(model, tree, layout, pack, routes):
                    results[s] = outputs
        return results

    def forward_backward(self, model: PreTrainedModel, sequences: Sequence[TokenSequence], loss_fn: LossFn) -> StepStats:
        check_batch(model, self.head, sequences, tree=True, head_rows=self.head_rows)
        started = time.perf_counter()
        tree = PrefixTree.build(sequences)
        stats = StepStats(sequences=len(sequences), flat_tokens=sum(len(s) for s in sequences))
        total = torch.zeros((), dtype=torch.float64, device=model.get_input_embeddings().weight.device)
        layout = OutputSlots(tree, self.head.shifted, self.head_rows)
        routes = tree_routes(model, tree, self.head.shifted)  # MoE routing replay: each node's routing
        if routes is not None:
            stats.add_metrics(routes.metrics())
        with engine_attention(model):  # backward too: gradient checkpointing recomputes layers through treerl
            for pack in self.packs(tree):
                views = ((s, sequences[s], outputs) for s, outputs in self._run(model, tree, layout, pack, routes))
                pack_loss = sum_losses(views, loss_fn, stats)
                if pack_loss.requires_grad:
                    pack_loss.backward()
                total += pack_loss.detach().to(total)  # stays on the device: read once, below
                stats.model_tokens += sum(run_length(tree.nodes[i], self.head.shifted) for i in pack)
        stats.loss = float(total)
        stats.settle()
        stats.seconds = time.perf_counter() - started
        return stats

    def packs(self, tree: PrefixTree) -> list[list[int]]:
        """Whole top-level subtrees, in order, greedily filling packs of <= max_tokens run tokens."""
        packs: list[list[int]] = []
        size = 0
        for top in tree.nodes[ROOT].children:
            subtree, stack = [], [top]
            while stack:
                index = stack.pop()
                subtree.append(index)
                stack.extend(reversed(tree.nodes[index].children))
            tokens = sum(run_length(tree.nodes[i], self.head.shifted) for i in subtree)
            if packs and size + tokens <= self.max_tokens:
                packs[-1] += subtree
                size += tokens
            else:
                packs.append(subtree)
                size = tokens
        return packs

    def _run(self, model: PreTrainedModel, tree: PrefixTree, layout: OutputSlots, pack: list[int],
             routes: TreeRoutes | None = None) -> list[tuple[int, dict[str, torch.Tensor]]]:
        """One packed call over `pack` (node indices in preorder); per-sequence outputs aligned with tokens."""
        device = model.get_input_embeddings().weight.device
        shifted = self.head.shifted
        lengths = [run_length(tree.nodes[i], shifted) for i in pack]
        offsets = torch.tensor([0] + lengths).cumsum(0).tolist()
        ids = torch.cat([tree.nodes[i].tokens[:n] for i, n in zip(pack, lengths)])
        positions = torch.cat([torch.arange(tree.nodes[i].start, tree.nodes[i].start + n) for i, n in zip(pack, lengths)])
        parts = [layout.node_rows(tree.nodes[i], offsets[k]) for k, i in enumerate(pack)]
        rows, targets, slots = (torch.cat(column) for column in zip(*parts))
        if len(ids) == 0:
            outputs = empty_outputs(model, self.head)
        else:
            ids, positions, rows, targets = (to_device(x, device) for x in (ids, positions, rows, targets))
            call = self._call(tree, pack, lengths, positions)
            rows_of = lambda: torch.cat([routes.node_rows(i, n) for i, n in zip(pack, lengths)])
            with replayed(routes, rows_of, device):
                hidden = final_hidden(model, input_ids=ids[None], position_ids=positions[None], treerl_call=call)[0]
            check_all_layers_routed(model, call.layers_called)
            outputs = self.head(model, hidden[rows], targets)
        slots = to_device(slots, device)
        by_slot = {name: out.new_zeros(layout.total).index_copy(0, slots, out) for name, out in outputs.items()}
        results = []
        for s in (s for i in pack for s in tree.nodes[i].ends):  # a pack holds whole subtrees: every path is in it
            index = to_device(layout.sequence(s), device)
            results.append((s, {name: values[index] for name, values in by_slot.items()}))
        return results

    def _call(self, tree: PrefixTree, pack: list[int], lengths: list[int], positions: torch.Tensor) -> PackedCall:
        """The pack's ancestor structure: token q sees token k iff k <= q and q's node lies in k's node's subtree."""
        local = {index: k for k, index in enumerate(pack)}
        subtree_end = list(range(len(pack)))  # last pack position of each node's subtree (preorder)
        for k in reversed(range(len(pack))):
            parent = local.get(tree.nodes[pack[k]].parent)
            if parent is not None:
                subtree_end[parent] = max(subtree_end[parent], subtree_end[k])
        device = positions.device
        node_of = torch.repeat_interleave(torch.arange(len(pack)), torch.tensor(lengths))
        end_of = torch.tensor(subtree_end)[node_of]
        node_of, end_of = to_device(node_of, device), to_device(end_of, device)
        return PackedCall(positions, node_of, end_of, flex=device.type == "cuda" and self.flex_attention)
