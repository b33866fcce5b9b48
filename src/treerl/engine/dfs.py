"""Dynamic tree attention: walk the prefix tree depth-first, computing each shared prefix once.

The walk visits *units*: sibling nodes of similar length run as one padded batch over their
shared ancestors' K/V (treerl.attention); a lone node is a unit of one. On the way down a unit's
outputs (log-probs, entropy) are kept as plain values. When a sequence's last node has run, all
of its outputs are known: its loss is evaluated on them and d(loss)/d(output) is added to a
per-node buffer. On the way back up, a unit's backward receives those buffered gradients plus,
through the K/V gradient store, what its descendants sent to its K/V, and passes its ancestors'
share on. Parameter gradients accumulate in `.grad`. The result equals training each sequence
on its own.

Memory: only the current root-to-node path is held. A unit with descendants keeps its autograd
graph while the kept graphs fit `memory_budget_bytes` (`recompute="auto"`); otherwise it runs
without a graph on the way down and again with one on the way up (`"always"` does that for every
unit, AREAL-DTA style), so at most one unit's graph (<= `batch_tokens` tokens) exists at a time.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Literal

import torch
from transformers import PreTrainedModel

from treerl.attention import PathKV, TreeCall, UnitKV, engine_attention
from treerl.engine.base import (
    Head,
    LossFn,
    StepStats,
    check_batch,
    empty_outputs,
    final_hidden,
    head_rows,
    run_length,
    sum_losses,
)
from treerl.engine.head import PolicyHead
from treerl.engine.support import attention_layers, check_all_layers_routed
from treerl.tree import ROOT, Node, PrefixTree, Sequence
from treerl.tree.batching import group_siblings


@dataclass
class DfsEngine:
    """Depth-first dynamic tree attention with exact per-sequence gradients."""

    head: Head = field(default_factory=PolicyHead)
    chunk_tokens: int = 2048  # longest run of one node computed at once; longer nodes become chains
    batch_tokens: int = 8192  # most tokens (padding included) in one batched call of siblings; 0: no batching
    recompute: Literal["auto", "always", "never"] = "auto"
    memory_budget_bytes: int | None = None  # kept graphs; None: half the free device memory at start
    preallocated_kv: bool = True  # one K/V store per layer written in place (False: torch.cat per call)

    def forward(self, model: PreTrainedModel, sequences: Seq[Sequence]) -> list[dict[str, torch.Tensor]]:
        walk = _Walk(self, model, self.plan(model, sequences), loss_fn=None)
        with torch.no_grad(), engine_attention(model):
            walk.run()
        return walk.results

    def forward_backward(self, model: PreTrainedModel, sequences: Seq[Sequence], loss_fn: LossFn) -> StepStats:
        started = time.perf_counter()
        walk = _Walk(self, model, self.plan(model, sequences), loss_fn=loss_fn)
        with engine_attention(model):
            walk.run()
        walk.stats.loss = float(walk.total_loss)
        walk.stats.seconds = time.perf_counter() - started
        return walk.stats

    def plan(self, model: PreTrainedModel, sequences: Seq[Sequence]) -> PrefixTree:
        """Check everything, then merge the batch into a tree whose nodes are at most `chunk_tokens` long."""
        check_batch(model, self.head, sequences, tree=True)
        if self.recompute not in ("auto", "always", "never"):
            raise ValueError(f"recompute must be 'auto', 'always' or 'never', got {self.recompute!r}")
        return PrefixTree.build(sequences).chunked(self.chunk_tokens)


@dataclass
class _Unit:
    """Sibling nodes run as one batch: row i is `nodes[i]`, its first `lengths[i]` tokens."""

    nodes: list[Node]
    lengths: list[int]
    kv: UnitKV
    graph: dict[str, torch.Tensor] | None = None  # row outputs with their autograd graph
    kept_bytes: int = 0

    @property
    def width(self) -> int:
        return max(self.lengths)


def graph_bytes_per_token(model: PreTrainedModel) -> int:
    """Rough size of what autograd saves per token for one pass through the model (for the budget)."""
    c = model.config.get_text_config()
    hidden = _size(c, "hidden_size")
    heads = _size(c, "num_attention_heads") or 1
    kv_heads = _size(c, "num_key_value_heads") or heads
    head_dim = _size(c, "head_dim") or hidden // heads
    ffn = _size(c, "intermediate_size", "n_inner", "ffn_dim") or 4 * hidden  # GPT-2, OPT: the usual 4x width
    per_layer = 3 * hidden + 5 * heads * head_dim + 4 * kv_heads * head_dim + 4 * ffn
    elem = next(model.parameters()).element_size()
    layers = _size(c, "num_hidden_layers") or len(attention_layers(model)) or 1
    return (layers * per_layer + 2 * hidden) * elem


def _size(config, *names: str) -> int:
    """The first of `names` the config sets, as one number (the largest, where it varies by layer)."""
    for name in names:
        try:
            value = getattr(config, name, None)
        except Exception:  # noqa: BLE001 - per-layer configs refuse a global read (Gemma-4)
            value = [getattr(layer, name, 0) or 0 for layer in getattr(config, "per_layer_config", [])]
        if isinstance(value, (list, tuple)):
            value = max(value, default=0)
        if value:
            return int(value)
    return 0


def _default_budget(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free // 2
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES") // 2
    except (ValueError, OSError):
        return 4 << 30


class _Walk:
    """State of one depth-first walk: per-node outputs, output gradients, kept graphs."""

    def __init__(self, engine: DfsEngine, model: PreTrainedModel, tree: PrefixTree, loss_fn: LossFn | None):
        self.engine, self.model, self.tree, self.loss_fn = engine, model, tree, loss_fn
        self.head = engine.head
        self.shift = 1 if self.head.shifted else 0
        self.device = model.get_input_embeddings().weight.device
        capacity = max(len(s) for s in tree.sequences)
        self.path = PathKV(capacity, with_grads=loss_fn is not None, preallocated=engine.preallocated_kv)
        self.values: dict[int, dict[str, torch.Tensor]] = {}  # node -> outputs for its tokens (no graph)
        self.grads: dict[int, dict[str, torch.Tensor]] = {}  # node -> d(loss)/d(outputs) for its tokens
        self.forks: dict[int, dict[str, torch.Tensor]] = {}  # child -> its first token's outputs
        self.results: list[dict[str, torch.Tensor]] = [{} for _ in tree.sequences]
        self.needs_backward: set[int] = set()  # nodes on the path of a loss that depends on the outputs
        self.stats = StepStats(sequences=len(tree.sequences), flat_tokens=sum(len(s) for s in tree.sequences))
        self.total_loss = torch.zeros((), dtype=torch.float64, device=self.device)
        self.budget = engine.memory_budget_bytes
        if self.budget is None:
            self.budget = _default_budget(self.device)
        self.per_token = graph_bytes_per_token(model)
        self.kept = 0

    # ------------------------------------------------------------ the walk
    def run(self) -> None:
        """Visit every unit depth-first; backward (when training) on the way back up."""
        for event, unit, row in self._events():
            if event == "enter":
                self.enter(unit)
            elif event == "push":
                self.path.push(unit.kv, row, unit.lengths[row])
            elif event == "pop":
                self.path.pop(unit.kv, row, unit.lengths[row])
            else:
                if self.loss_fn is not None:
                    self.backward(unit)
                self.release(unit)

    def _events(self) -> Iterator[tuple[str, _Unit, int]]:
        """enter U, then for each row with children: push, the children's units, pop; then exit U."""
        stack: list[tuple[str, _Unit | None, int, Node | None]] = [("expand", None, 0, self.tree.nodes[ROOT])]
        while stack:
            event, unit, row, node = stack.pop()
            if event == "expand":  # the units below `node`, in order
                stack.extend(("enter", u, 0, None) for u in reversed(self._units(node)))
                continue
            if event == "enter":
                yield "enter", unit, 0
                stack.append(("exit", unit, 0, None))
                for i in reversed(range(len(unit.nodes))):
                    if unit.nodes[i].children:
                        stack.append(("pop", unit, i, None))
                        stack.append(("expand", unit, i, unit.nodes[i]))
                        stack.append(("push", unit, i, None))
                continue
            yield event, unit, row

    def _units(self, parent: Node) -> list[_Unit]:
        """Group `parent`'s children into batched units."""
        children = [self.tree.nodes[c] for c in parent.children]
        lengths = [run_length(n, self.head.shifted) for n in children]
        groups = group_siblings(lengths, self.engine.batch_tokens)
        start = parent.end if parent.index != ROOT else 0
        return [_Unit([children[i] for i in g], [lengths[i] for i in g], UnitKV(start)) for g in groups]

    # ------------------------------------------------------------ one unit
    def enter(self, unit: _Unit) -> None:
        """Run the unit; keep its graph if it must backpropagate and fits; record outputs; losses."""
        training = self.loss_fn is not None
        has_children = any(n.children for n in unit.nodes)
        size = len(unit.nodes) * unit.width * self.per_token
        mode = self.engine.recompute
        keep = training and (not has_children or mode == "never" or (mode == "auto" and self.kept + size <= self.budget))
        outputs = self._compute(unit, grad=keep)
        if keep and has_children:
            unit.graph, unit.kept_bytes = outputs, size
            self.kept += size
        elif keep:
            unit.graph = outputs
        self._record(unit, outputs)
        ends = [s for n in unit.nodes for s in n.ends]
        if training:
            self._sequence_losses(ends)
        else:
            for s in ends:
                self.results[s] = self.sequence_outputs(s)

    def _rows(self, unit: _Unit) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat hidden-state row of every output of the unit (row i starts at i x width), and its target."""
        parts = [head_rows(self.tree, node, self.head.shifted, i * unit.width) for i, node in enumerate(unit.nodes)]
        return torch.cat([rows for rows, _ in parts]), torch.cat([targets for _, targets in parts])

    def _compute(self, unit: _Unit, grad: bool) -> dict[str, torch.Tensor]:
        """Run the unit's rows at their absolute positions over the path's K/V; apply the head."""
        rows, targets = self._rows(unit)
        width = unit.width
        if width == 0:  # one-token leaves: their only outputs came from the parent's fork row
            return empty_outputs(self.model, self.head)
        ids = torch.zeros(len(unit.nodes), width, dtype=torch.long)
        for i, (node, n) in enumerate(zip(unit.nodes, unit.lengths)):
            ids[i, :n] = node.tokens[:n]
        start = unit.kv.start
        positions = torch.arange(start, start + width).expand(len(unit.nodes), -1)
        self.stats.model_tokens += sum(unit.lengths)
        call = TreeCall(self.path, unit.kv)
        with torch.set_grad_enabled(grad):
            hidden = final_hidden(
                self.model, input_ids=ids.to(self.device), position_ids=positions.to(self.device), treerl_call=call
            ).reshape(len(unit.nodes) * width, -1)
            call.forward_done = True
            check_all_layers_routed(self.model, call.layers_called)
            if not torch.equal(rows, torch.arange(len(hidden))):
                hidden = hidden[rows.to(self.device)]
            return self.head(self.model, hidden, targets.to(self.device))

    def _record(self, unit: _Unit, outputs: dict[str, torch.Tensor]) -> None:
        """Split the unit's row outputs into per-node values (and fork values for the children)."""
        offset = 0
        for node in unit.nodes:
            own = node.length - self.shift
            forks = len(node.children) if self.shift else 0
            first = self.forks.pop(node.index, None)  # from the parent's last row; none at the top
            values = {}
            for name, out in outputs.items():
                out = out.detach()[offset : offset + own + forks]
                for i, child in enumerate(node.children[:forks]):
                    self.forks.setdefault(child, {})[name] = out[own + i : own + i + 1]
                parts = [first[name] if first is not None else out.new_zeros(1)] if self.shift else []
                values[name] = torch.cat(parts + [out[:own]])
            offset += own + forks
            self.values[node.index] = values
            if self.loss_fn is not None:
                self.grads[node.index] = {name: torch.zeros_like(v) for name, v in values.items()}

    # ------------------------------------------------------------ sequences
    def sequence_outputs(self, s: int) -> dict[str, torch.Tensor]:
        """Sequence `s`'s outputs, gathered from the nodes on its path (all computed by now)."""
        n = len(self.tree.sequences[s])
        nodes = self.tree.path(s)
        return {name: torch.cat([self.values[i][name] for i in nodes])[:n] for name in self.head.outputs}

    def _sequence_losses(self, ends: list[int]) -> None:
        """Evaluate the losses of the sequences that end here; add d(loss)/d(outputs) to their nodes."""
        if not ends:
            return
        leaves = [(s, {k: v.requires_grad_() for k, v in self.sequence_outputs(s).items()}) for s in ends]
        total = sum_losses(((s, self.tree.sequences[s], out) for s, out in leaves), self.loss_fn, self.stats)
        self.total_loss += total.detach().to(self.total_loss.dtype)
        if not total.requires_grad:
            return
        self.needs_backward.update(i for s, _ in leaves for i in self.tree.path(s))
        inputs = [(s, name, t) for s, outputs in leaves for name, t in outputs.items()]
        grads = torch.autograd.grad(total, [t for _, _, t in inputs], allow_unused=True)
        for (s, name, _), g in zip(inputs, grads):
            if g is None:
                continue
            n = len(self.tree.sequences[s])
            for i in self.tree.path(s):
                node = self.tree.nodes[i]
                hi = min(node.end, n)
                self.grads[i][name][: hi - node.start] += g[node.start : hi]

    # ------------------------------------------------------------ way back up
    def backward(self, unit: _Unit) -> None:
        """Back-propagate the unit's buffered output gradients (and, via the store, its K/V's).

        A unit no gradient-carrying loss reads is skipped, so parameters keep `.grad = None` as
        with the flat reference (a zero gradient would still move them through weight decay).
        """
        if not any(node.index in self.needs_backward for node in unit.nodes):
            self.kept -= unit.kept_bytes
            unit.graph, unit.kept_bytes = None, 0
            return
        outputs = unit.graph if unit.graph is not None else self._compute(unit, grad=True)
        tensors, grads = [], []
        for name, out in outputs.items():
            if not out.requires_grad:
                continue
            parts = []
            for node in unit.nodes:
                parts.append(self.grads[node.index][name][self.shift :])
                if self.shift:
                    parts += [self.grads[c][name][:1] for c in node.children]
            tensors.append(out)
            grads.append(torch.cat(parts).to(out.dtype))
        if tensors:
            torch.autograd.backward(tensors, grads)
        self.kept -= unit.kept_bytes
        unit.graph, unit.kept_bytes = None, 0

    def release(self, unit: _Unit) -> None:
        """Forget the unit's children's state (their gradients reached the unit's fork rows)."""
        for node in unit.nodes:
            for c in node.children:
                self.values.pop(c, None)
                self.grads.pop(c, None)
            if node.parent == ROOT:
                self.values.pop(node.index, None)
                self.grads.pop(node.index, None)
        unit.kv.keys.clear()
        unit.kv.values.clear()
        unit.kv.key_grads = unit.kv.value_grads = None
