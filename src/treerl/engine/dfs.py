"""Dynamic tree attention: walk the prefix tree depth-first, computing each shared prefix once.

The walk visits *units* (treerl.tree.plan): tree nodes packed into one model call without padding,
each token attending to its own node causally and to its ancestors (treerl.attention). A unit
hangs below a node of the current root-to-node path, whose K/V sit in a per-layer path store. On
the way down a unit's outputs (log-probs, entropy) are written, as plain values, into per-token
*slots*: node n's token j has one slot, filled by the row that predicts it. When a sequence's last
node has run, all of its outputs are known: its loss is evaluated on them (a gather of its slots)
and d(loss)/d(output) is added to a gradient buffer of the same slots. On the way back up, a
unit's backward reads its slots' gradients plus, through the K/V gradient store, what its
descendants sent to its K/V, and passes its ancestors' share on. Parameter gradients accumulate
in `.grad`. The result equals training each sequence on its own.

Memory: the plan keeps what is held at once (the running unit's graph and the graphs kept on the
path) within a budget of graph tokens: by default 1.5x the largest node (so within 1.5x of the
one-path walk's peak, on any machine), or an explicit number of tokens or bytes, or a share of the
device's free memory. A unit whose descendants do not fit beside its graph runs without a graph
going down and again with one going up.

No host synchronisation in the walk: every index (token ids, positions, output rows, slots) is
built on the host before it starts and copied to the device once; losses and metrics stay on the
device and are read once at the end.
"""

from __future__ import annotations

import bisect
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from transformers import PreTrainedModel

from treerl.attention import Block, PathKV, Segment, TreeCall, UnitKV, UnitLayout, engine_attention
from treerl.engine.base import (
    Head,
    LossFn,
    OutputSlots,
    StepStats,
    check_batch,
    final_hidden,
    output_dtype,
    run_length,
    sum_losses,
)
from treerl.engine.head import PolicyHead
from treerl.engine.support import attention_layers, check_all_layers_routed
from treerl.models import model_geometry
from treerl.tree import ROOT, PrefixTree, TokenSequence
from treerl.tree.plan import PlanCost, Unit, WalkPlan

ONE_PATH_SLACK = 1.5
"""The default budget: this many times the largest node's rows. The one-path walk (one node per call, every
graph recomputed) holds one node's graph at a time, so the default peak stays within this factor of its peak
whatever the tree and the machine; more memory is an explicit budget (`memory_budget_tokens` / `_bytes`)."""


@dataclass
class DfsEngine:
    """Depth-first dynamic tree attention with exact per-sequence gradients."""

    head: Head = field(default_factory=PolicyHead)
    chunk_tokens: int = 2048  # longest run of one node computed at once; longer nodes become chains
    batch_tokens: int = 8192  # most tokens in one model call (nodes packed without padding); 0: one node per call
    recompute: Literal["auto", "always", "never"] = "auto"  # open units: cost model within the budget | always | never
    memory_budget_tokens: int | None = None  # tokens of autograd graph held at once; None: see ONE_PATH_SLACK
    memory_budget_bytes: int | None = None  # instead: bytes of autograd graph held at once (graph_bytes_per_token)
    memory_budget_fraction: float | None = None  # instead: this share of the device's free memory at each step
    plan_cost: PlanCost | None = None  # None: PlanCost.for_device

    def forward(self, model: PreTrainedModel, sequences: Sequence[TokenSequence]) -> list[dict[str, torch.Tensor]]:
        tree = self._tree(model, sequences)
        # The training plan, not a faster one of bigger calls: the log-probs a no-grad pass fills in (old,
        # proximal, reference) must be bit-identical to the ones the update computes, or the on-policy ratio is
        # off by low-precision rounding (bf16 matmuls round differently when the rows of a call change).
        walk = _Walk(self, model, tree, self.plan(model, tree), loss_fn=None)
        with torch.no_grad(), engine_attention(model):
            walk.run()
        return walk.sequence_outputs()

    def forward_backward(self, model: PreTrainedModel, sequences: Sequence[TokenSequence], loss_fn: LossFn) -> StepStats:
        started = time.perf_counter()
        tree = self._tree(model, sequences)
        walk = _Walk(self, model, tree, self.plan(model, tree), loss_fn=loss_fn)
        with engine_attention(model):
            walk.run()
        walk.stats.loss = float(walk.total_loss)
        walk.stats.settle()
        walk.stats.seconds = time.perf_counter() - started
        return walk.stats

    def _tree(self, model: PreTrainedModel, sequences: Sequence[TokenSequence]) -> PrefixTree:
        """Check everything, then merge the batch into a tree whose nodes are at most `chunk_tokens` long."""
        check_batch(model, self.head, sequences, tree=True)
        if self.recompute not in ("auto", "always", "never"):
            raise ValueError(f"recompute must be 'auto', 'always' or 'never', got {self.recompute!r}")
        if self.batch_tokens < 0:
            raise ValueError(f"batch_tokens must be >= 0, got {self.batch_tokens}")
        budgets = {"memory_budget_tokens": self.memory_budget_tokens, "memory_budget_bytes": self.memory_budget_bytes,
                   "memory_budget_fraction": self.memory_budget_fraction}
        given = [name for name, value in budgets.items() if value is not None]
        if len(given) > 1:
            raise ValueError(f"set one memory budget, not {' and '.join(given)}")
        for name in ("memory_budget_tokens", "memory_budget_bytes"):
            if budgets[name] is not None and budgets[name] <= 0:
                raise ValueError(f"{name} must be > 0, got {budgets[name]}")
        if self.memory_budget_fraction is not None and not 0 < self.memory_budget_fraction <= 1:
            raise ValueError(f"memory_budget_fraction must be in (0, 1], got {self.memory_budget_fraction}")
        return PrefixTree.build(sequences).chunked(self.chunk_tokens)

    def plan(self, model: PreTrainedModel, tree: PrefixTree) -> WalkPlan:
        """Which nodes run together and which graphs are kept, within the memory budget (in graph tokens)."""
        run = [run_length(node, self.head.shifted) for node in tree.nodes]
        run[ROOT] = 0
        cost = self.plan_cost or PlanCost.for_device(_device(model).type)
        return WalkPlan(tree, run, self.graph_budget_tokens(model, tree), self.batch_tokens, self.recompute, cost)

    def graph_budget_tokens(self, model: PreTrainedModel, tree: PrefixTree) -> int:
        """Tokens of autograd graph the walk may hold at once (`tree` is chunked: no node over `chunk_tokens`)."""
        if self.memory_budget_tokens is not None:
            return self.memory_budget_tokens
        if self.memory_budget_bytes is not None:
            return self.memory_budget_bytes // graph_bytes_per_token(model)
        if self.memory_budget_fraction is not None:
            return int(free_memory(_device(model)) * self.memory_budget_fraction) // graph_bytes_per_token(model)
        largest = max(run_length(node, self.head.shifted) for node in tree.nodes[1:])
        return int(ONE_PATH_SLACK * largest)


def _device(model: PreTrainedModel) -> torch.device:
    return model.get_input_embeddings().weight.device


def free_memory(device: torch.device) -> int:
    """Bytes this process could still allocate on `device`: on CUDA the device's free memory plus what
    PyTorch's caching allocator holds reserved but unused; on CPU the available RAM."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError):
        return 4 << 30


def graph_bytes_per_token(model: PreTrainedModel) -> int:
    """Rough size of what autograd saves per token for one pass through the model (for byte budgets)."""
    g = model_geometry(model.config)
    per_layer = 3 * g.hidden + 5 * g.heads * g.head_dim + 4 * g.kv_heads * g.head_dim + 4 * g.ffn
    elem = next(model.parameters()).element_size()
    layers = g.layers or len(attention_layers(model)) or 1
    return (layers * per_layer + 2 * g.hidden) * elem


class _HostIndex:
    """Integer tensors built on the host and copied to the device in one transfer (pinned, non-blocking)."""

    def __init__(self) -> None:
        self.parts: list[torch.Tensor] = []
        self.size = 0

    def add(self, values: torch.Tensor) -> slice:
        self.parts.append(values.reshape(-1).long())
        self.size += values.numel()
        return slice(self.size - values.numel(), self.size)

    def to(self, device: torch.device) -> torch.Tensor:
        flat = torch.cat(self.parts) if self.parts else torch.zeros(0, dtype=torch.long)
        if device.type == "cuda":
            return flat.pin_memory().to(device, non_blocking=True)
        return flat.to(device)


class _UnitInputs:
    """What one unit's call needs, built before the walk (index tensors end up as views of one device buffer)."""

    def __init__(self, segments: dict[int, Segment]):
        self.segments = segments  # node -> its rows
        self.layout: UnitLayout | None = None  # None: no rows to run (one-token leaves only)
        self.ids = self.positions = self.targets = self.slots = None  # slots: the output slot of each head row
        self.rows = None  # hidden rows the head reads (None: every row, in order)
        self.ends: list[int] = []  # sequences whose last node is in the unit
        self.end_slots = None  # their slots, one sequence after another
        self.kv = UnitKV()
        self.graph: dict[str, torch.Tensor] | None = None  # head outputs with their autograd graph


class _Walk:
    """State of one depth-first walk: output slots and their gradients, the path store, kept graphs."""

    def __init__(self, engine: DfsEngine, model: PreTrainedModel, tree: PrefixTree, plan: WalkPlan,
                 loss_fn: LossFn | None):
        self.engine, self.model, self.tree, self.plan, self.loss_fn = engine, model, tree, plan, loss_fn
        self.head = engine.head
        self.device = _device(model)
        self.layers = attention_layers(model)
        self.path = PathKV(max(len(s) for s in tree.sequences), with_grads=loss_fn is not None)
        self.stats = StepStats(sequences=len(tree.sequences), flat_tokens=sum(len(s) for s in tree.sequences))
        self.total_loss = torch.zeros((), dtype=torch.float64, device=self.device)
        self.needs_backward: set[int] = set()  # nodes on the path of a loss that depends on the outputs
        self.slots = OutputSlots(tree, self.head.shifted)  # where each token's outputs land, the fork rows' included
        self.slot_outputs = {name: torch.zeros(self.slots.total, dtype=output_dtype(model), device=self.device)
                             for name in self.head.outputs}
        self.grads = {name: torch.zeros_like(v) for name, v in self.slot_outputs.items()} if loss_fn is not None else {}
        self.inputs = self._prepare()

    # ------------------------------------------------------------ before the walk
    def _prepare(self) -> dict[int, _UnitInputs]:
        """Every unit's index tensors, built on the host and copied to the device at once."""
        index = _HostIndex()
        inputs = {id(unit): self._unit_inputs(unit, index) for unit in self.plan.all_units()}
        self.all_slots = index.add(torch.cat([self.slots.sequence(s) for s in range(len(self.tree.sequences))]))
        device_index = index.to(self.device)
        view = lambda x: device_index[x] if isinstance(x, slice) else x
        for data in inputs.values():
            for name in ("ids", "positions", "rows", "targets", "slots", "end_slots"):
                setattr(data, name, view(getattr(data, name)))
            if data.layout is not None:
                data.layout.positions = data.positions
        self.all_slots = device_index[self.all_slots]
        return inputs

    def _unit_inputs(self, unit: Unit, index: _HostIndex) -> _UnitInputs:
        """Rows, positions, blocks, output rows and slots of one unit; its sequences' slots."""
        tree, run = self.tree, self.plan.run
        segments, ids, positions, rows, targets, slots = {}, [], [], [], [], []
        row = 0
        for n in unit.nodes:
            node = tree.nodes[n]
            if run[n] == 0:
                continue
            segments[n] = Segment(row, run[n], node.start)
            ids.append(node.tokens[: run[n]])
            positions.append(torch.arange(node.start, node.start + run[n]))
            node_rows, node_targets, node_slots = self.slots.node_rows(node, row)
            rows.append(node_rows)
            targets.append(node_targets)
            slots.append(node_slots)
            row += run[n]
        data = _UnitInputs(segments)
        data.ends = [s for n in unit.nodes for s in tree.nodes[n].ends]
        if data.ends:
            data.end_slots = index.add(torch.cat([self.slots.sequence(s) for s in data.ends]))
        if row == 0:  # one-token leaves only: their outputs came from the parent's fork rows
            return data
        all_rows = torch.cat(rows)
        data.ids, data.positions = index.add(torch.cat(ids)), index.add(torch.cat(positions))
        data.rows = None if torch.equal(all_rows, torch.arange(row)) else index.add(all_rows)
        data.targets, data.slots = index.add(torch.cat(targets)), index.add(torch.cat(slots))
        path_end = tree.nodes[unit.parent].end if unit.parent != ROOT else 0
        runs, blocks = self._attention_layout(segments)
        data.layout = UnitLayout(runs, blocks, torch.empty(0), path_end)
        return data

    def _attention_layout(self, segments: dict[int, Segment]) -> tuple[list[Segment], list[Block]]:
        """The unit's causal runs and blocks: which of its own rows each row sees.

        A node followed in the row by its own child continues the same causal run (a chain of nodes is
        one sequence: one kernel call, not one per node). The rows below a run that are not in it see a
        prefix of it: those below its last node all of it, those below an earlier node (after the run's
        next node's subtree) the run up to that node. Every (row, in-unit ancestor) pair is in exactly
        one run or block.
        """
        order = list(segments)
        runs: list[list[int]] = []
        for n in order:
            if runs and self.tree.nodes[n].parent == runs[-1][-1]:
                runs[-1].append(n)
            else:
                runs.append([n])
        last_row = {n: segments[n].end for n in order}  # node -> end row of its in-unit subtree
        for n in reversed(order):  # children before parents; a node with rows has its parent's rows in the unit or none
            parent = self.tree.nodes[n].parent
            if parent in last_row:
                last_row[parent] = max(last_row[parent], last_row[n])
        starts = [segments[n].row for n in order]
        last_positions = [segments[n].position + segments[n].length - 1 for n in order]
        merged, blocks = [], []
        for run in runs:
            top = segments[run[0]]
            merged.append(Segment(top.row, segments[run[-1]].end - top.row, top.position))
            lo = segments[run[-1]].end
            for n in reversed(run):
                hi = last_row[n]
                if hi > lo:
                    q_max = max(last_positions[bisect.bisect_left(starts, lo) : bisect.bisect_left(starts, hi)])
                    key = Segment(top.row, segments[n].end - top.row, top.position)
                    blocks.append(Block(lo, hi, key, q_max))
                lo = max(lo, hi)
        return merged, blocks

    # ------------------------------------------------------------ the walk
    def run(self) -> None:
        """Visit every unit in plan order; backward (when training) on the way back up."""
        for event, unit, node in self.plan.walk():
            data = self.inputs[id(unit)]
            if event == "enter":
                self.enter(unit, data)
            elif event == "push":
                self.path.push(data.kv, [data.segments[n] for n in self.plan.chain(unit, node) if n in data.segments])
            elif event == "pop":
                self.path.pop(data.kv, [data.segments[n] for n in self.plan.chain(unit, node) if n in data.segments])
            else:
                if self.loss_fn is not None:
                    self.backward(unit, data)
                data.kv.clear()
                data.graph = None

    def enter(self, unit: Unit, data: _UnitInputs) -> None:
        """Run the unit (with a graph if it backpropagates without recomputation); record outputs; losses."""
        keep = self.loss_fn is not None and (not unit.open or unit.keep)
        outputs = self._compute(data, grad=keep)
        if keep:
            data.graph = outputs
        for name, out in (outputs or {}).items():
            self.slot_outputs[name].index_copy_(0, data.slots, out.detach().to(self.slot_outputs[name].dtype))
        if self.loss_fn is not None and data.ends:
            self._sequence_losses(data)

    def _compute(self, data: _UnitInputs, grad: bool, again: bool = False) -> dict[str, torch.Tensor] | None:
        """Run the unit's rows at their absolute positions over the path's K/V; apply the head.

        `again`: a recomputation for the backward; the outputs' values are in the slots already, so the
        head only builds its backward (`Head.replay`)."""
        if data.layout is None:
            return None
        self.stats.model_tokens += data.layout.rows
        call = TreeCall(self.path, data.kv, data.layout)
        with torch.set_grad_enabled(grad):
            hidden = final_hidden(self.model, input_ids=data.ids[None], position_ids=data.positions[None],
                                  treerl_call=call)[0]
            call.forward_done = True
            check_all_layers_routed(self.model, call.layers_called, self.layers)
            if data.rows is not None:
                hidden = hidden[data.rows]
            if again:
                known = {name: v[data.slots] for name, v in self.slot_outputs.items()}
                return self.head.replay(self.model, hidden, data.targets, known)
            return self.head(self.model, hidden, data.targets)

    def _sequence_losses(self, data: _UnitInputs) -> None:
        """Evaluate the losses of the sequences that end in the unit; add d(loss)/d(outputs) to their slots."""
        leaves = {name: v[data.end_slots].requires_grad_() for name, v in self.slot_outputs.items()}
        views, offset = [], 0
        for s in data.ends:
            n = len(self.tree.sequences[s])
            views.append((s, self.tree.sequences[s], {name: t[offset : offset + n] for name, t in leaves.items()}))
            offset += n
        total = sum_losses(views, self.loss_fn, self.stats)
        self.total_loss += total.detach().to(self.total_loss.dtype)
        if not total.requires_grad:
            return
        self.needs_backward.update(i for s in data.ends for i in self.tree.path(s))
        names = list(leaves)
        grads = torch.autograd.grad(total, [leaves[name] for name in names], allow_unused=True)
        for name, g in zip(names, grads):
            if g is not None:
                self.grads[name].index_add_(0, data.end_slots, g.to(self.grads[name].dtype))

    def backward(self, unit: Unit, data: _UnitInputs) -> None:
        """Back-propagate the unit's slot gradients (and, via the store, its K/V's).

        A unit no gradient-carrying loss reads is skipped, so parameters keep `.grad = None` as
        with the flat reference (a zero gradient would still move them through weight decay).
        """
        if data.layout is None or not any(n in self.needs_backward for n in unit.nodes):
            return
        outputs = data.graph if data.graph is not None else self._compute(data, grad=True, again=True)
        tensors, grads = [], []
        for name, out in outputs.items():
            if out.requires_grad:
                tensors.append(out)
                grads.append(self.grads[name][data.slots].to(out.dtype))
        if tensors:
            torch.autograd.backward(tensors, grads)

    def sequence_outputs(self) -> list[dict[str, torch.Tensor]]:
        """Every sequence's outputs, gathered from the slots (after a forward walk)."""
        lengths = [len(s) for s in self.tree.sequences]
        gathered = {name: v[self.all_slots].split(lengths) for name, v in self.slot_outputs.items()}
        return [{name: parts[i] for name, parts in gathered.items()} for i in range(len(lengths))]
