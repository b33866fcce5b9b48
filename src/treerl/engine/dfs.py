"""Dynamic tree attention: walk the prefix tree depth-first, computing each shared prefix once.

On the way down, a node's tokens run through the model with attention over
`[ancestor K/V | own K/V]` (treerl.attention); its outputs (log-probs, entropy) are kept as
plain values. When a sequence's last node has run, all of its outputs are known: its loss is
evaluated on them and the gradient w.r.t. each output is added to a per-node buffer. On the way
back up, a node's backward receives those buffered gradients plus, through the path's K/V
gradient store, what its descendants sent to its K/V, and passes its ancestors' share on.
Parameter gradients accumulate in `.grad`. The result equals training every sequence alone.

Memory: only the current root-to-node path is held. With `recompute=True` a node that has
children is run without a graph on the way down and again with one on the way up, so only one
chunk's graph (at most `chunk_tokens` tokens) exists at a time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence as Seq

import torch
from transformers import PreTrainedModel

from treerl.attention import PathKV, check_supported, tree_attention
from treerl.engine.base import LossFn, SequenceView, StepStats, check_batch, decoder, split_loss
from treerl.engine.head import PolicyHead
from treerl.tree import Node, PrefixTree, Sequence


@dataclass
class DfsEngine:
    """Depth-first dynamic tree attention with exact per-sequence gradients."""

    head: PolicyHead = field(default_factory=PolicyHead)
    chunk_tokens: int = 2048  # longest run of tokens computed (and, with recompute, held as a graph) at once
    recompute: bool = False  # True: hold one chunk's graph at a time; False: hold the path's graphs

    def forward(self, model: PreTrainedModel, sequences: Seq[Sequence]) -> list[dict[str, torch.Tensor]]:
        tree = self.plan(model, sequences)
        walk = _Walk(self, model, tree, loss_fn=None)
        results: list[dict[str, torch.Tensor]] = [{} for _ in sequences]
        with torch.no_grad(), tree_attention(model, walk.path):
            for entering, node in tree.dfs():
                if entering:
                    walk.run(node, grad=False)
                    for s in node.ends:
                        results[s] = walk.sequence_outputs(s)
                else:
                    walk.release(node)
        return results

    def forward_backward(self, model: PreTrainedModel, sequences: Seq[Sequence], loss_fn: LossFn) -> StepStats:
        started = time.perf_counter()
        tree = self.plan(model, sequences)
        walk = _Walk(self, model, tree, loss_fn=loss_fn)
        with tree_attention(model, walk.path):
            for entering, node in tree.dfs():
                if entering:
                    keep = not self.recompute or not node.children
                    walk.run(node, grad=keep)
                    for s in node.ends:
                        walk.sequence_loss(s)
                else:
                    walk.backward(node)
                    walk.release(node)
        walk.stats.loss = float(walk.total_loss)
        walk.stats.seconds = time.perf_counter() - started
        return walk.stats

    def plan(self, model: PreTrainedModel, sequences: Seq[Sequence]) -> PrefixTree:
        """Check everything, then merge the batch into a tree whose nodes are at most `chunk_tokens` long."""
        check_batch(model, self.head, sequences)
        check_supported(model)
        return PrefixTree.build(sequences).chunked(self.chunk_tokens)


class _Walk:
    """State of one depth-first walk: per-node outputs, output gradients and kept graphs."""

    def __init__(self, engine: DfsEngine, model: PreTrainedModel, tree: PrefixTree, loss_fn: LossFn | None):
        self.engine, self.model, self.tree, self.loss_fn = engine, model, tree, loss_fn
        self.head = engine.head
        self.device = model.get_input_embeddings().weight.device
        capacity = max(len(s) for s in tree.sequences)
        self.path = PathKV.allocate(model, capacity, with_grads=loss_fn is not None)
        self.values: dict[int, dict[str, torch.Tensor]] = {}  # node -> outputs for its tokens (no graph)
        self.grads: dict[int, dict[str, torch.Tensor]] = {}  # node -> d(loss)/d(outputs) for its tokens
        self.graphs: dict[int, dict[str, torch.Tensor]] = {}  # node -> row outputs with their graph
        self.forks: dict[int, dict[str, torch.Tensor]] = {}  # child -> its first token's outputs
        self.stats = StepStats(sequences=len(tree.sequences), flat_tokens=sum(len(s) for s in tree.sequences))
        self.total_loss = torch.zeros((), dtype=torch.float64, device=self.device)

    # ------------------------------------------------------------ one node
    def inputs(self, node: Node) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Tokens to run, the hidden row behind each output, and the token each row predicts.

        Shifted heads: rows 0..L-2 predict the node's own tokens 1..L-1; the last row, once per
        child, predicts that child's first token (fork logits). A leaf's last token predicts
        nothing and feeds no one, so it is not run.
        """
        tokens = node.tokens
        if not self.head.shifted:
            return tokens, torch.arange(len(tokens)), tokens
        forks = [self.tree.nodes[c].tokens[0] for c in node.children]
        run = tokens if node.children else tokens[:-1]
        rows = torch.cat([torch.arange(len(tokens) - 1), torch.full((len(forks),), len(tokens) - 1)])
        targets = torch.cat([tokens[1:], torch.stack(forks)]) if forks else tokens[1:]
        return run, rows, targets

    def run(self, node: Node, grad: bool) -> None:
        """Compute the node's outputs; with `grad`, keep their graph for `backward`."""
        outputs = self._compute(node, grad)
        values = {name: out.detach() for name, out in outputs.items()}
        if self.head.shifted:
            own = node.length - 1
            first = self.forks.pop(node.index, None)  # from the parent's last row; none at the top
            for name, out in values.items():
                for i, child in enumerate(node.children):
                    self.forks.setdefault(child, {})[name] = out[own + i : own + i + 1]
                head_value = first[name] if first is not None else out.new_zeros(1)
                values[name] = torch.cat([head_value, out[:own]])
        self.values[node.index] = values
        if self.loss_fn is not None:
            self.grads[node.index] = {name: torch.zeros_like(v) for name, v in values.items()}
            if grad:
                self.graphs[node.index] = outputs

    def _compute(self, node: Node, grad: bool) -> dict[str, torch.Tensor]:
        """Run the node's tokens at their absolute positions over the path's K/V; apply the head."""
        run, rows, targets = self.inputs(node)
        if len(run) == 0:  # a one-token leaf: its only output came from the parent's fork row
            dtype = torch.promote_types(next(self.model.parameters()).dtype, torch.float32)
            return {name: torch.zeros(0, dtype=dtype, device=self.device) for name in self.head.outputs}
        self.path.start = node.start
        self.stats.model_tokens += len(run)
        with torch.set_grad_enabled(grad):
            ids = run.to(self.device)[None]
            positions = torch.arange(node.start, node.start + len(run), device=self.device)[None]
            hidden = decoder(self.model)(input_ids=ids, position_ids=positions, use_cache=False).last_hidden_state[0]
            if not torch.equal(rows, torch.arange(len(run))):
                hidden = hidden[rows.to(self.device)]
            return self.head(self.model, hidden, targets.to(self.device))

    # ------------------------------------------------------------ sequences
    def sequence_outputs(self, s: int) -> dict[str, torch.Tensor]:
        """Sequence `s`'s outputs, gathered from the nodes on its path (all computed by now)."""
        n = len(self.tree.sequences[s])
        nodes = self.tree.path(s)
        return {name: torch.cat([self.values[i][name] for i in nodes])[:n] for name in self.head.outputs}

    def sequence_loss(self, s: int) -> None:
        """Evaluate the loss of sequence `s`; add d(loss)/d(outputs) into its nodes' buffers."""
        outputs = {k: v.requires_grad_() for k, v in self.sequence_outputs(s).items()}
        loss, metrics = split_loss(self.loss_fn(SequenceView(s, self.tree.sequences[s], outputs)))
        self.total_loss += loss.detach()
        self.stats.add_metrics(metrics)
        if not loss.requires_grad:
            return
        names = list(outputs)
        grads = torch.autograd.grad(loss, [outputs[k] for k in names], allow_unused=True)
        n = len(self.tree.sequences[s])
        for name, g in zip(names, grads):
            if g is None:
                continue
            for i in self.tree.path(s):
                node = self.tree.nodes[i]
                hi = min(node.end, n)
                self.grads[i][name][: hi - node.start] += g[node.start : hi]

    # ------------------------------------------------------------ way back up
    def backward(self, node: Node) -> None:
        """Back-propagate the node's buffered output gradients (and, via the store, its K/V's)."""
        outputs = self.graphs.pop(node.index, None)
        if outputs is None:
            outputs = self._compute(node, grad=True)
        shifted = 1 if self.head.shifted else 0
        tensors, grads = [], []
        for name, out in outputs.items():
            if not out.requires_grad:
                continue
            parts = [self.grads[node.index][name][shifted:]]
            parts += [self.grads[c][name][:1] for c in (node.children if shifted else [])]
            tensors.append(out)
            grads.append(torch.cat(parts).to(out.dtype))
        if tensors:
            torch.autograd.backward(tensors, grads)

    def release(self, node: Node) -> None:
        """Forget a finished subtree's state; the node's own buffers stay until its parent is done."""
        for c in node.children:
            self.values.pop(c, None)
            self.grads.pop(c, None)
        if node.parent == 0:
            self.values.pop(node.index, None)
            self.grads.pop(node.index, None)
