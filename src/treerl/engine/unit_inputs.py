"""What each unit of a DFS walk needs for its model call, built on the host before the walk starts.

Step 5 (docs/architecture.md): what each DfsEngine call needs, built before the walk.

For every unit of the plan (treerl.tree.plan): its rows (token ids and absolute positions), which of
its own rows each row attends to (causal runs and ancestor blocks, treerl.attention), which hidden
rows the head reads and which output slot each fills (treerl.engine.base.OutputSlots), and the
sequences that end in it. Every index of every unit goes to the device in one transfer (pinned and
non-blocking on CUDA), so the walk itself never waits on the host.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

import torch

from treerl.attention import Block, Segment, UnitKV, UnitLayout
from treerl.engine.base import OutputSlots, to_device
from treerl.tree import ROOT, PrefixTree
from treerl.tree.plan import Unit, WalkPlan


class HostIndex:
    """Integer tensors built on the host and copied to the device in one transfer."""

    def __init__(self) -> None:
        self.parts: list[torch.Tensor] = []
        self.size = 0

    def add(self, values: torch.Tensor) -> slice:
        self.parts.append(values.reshape(-1).long())
        self.size += values.numel()
        return slice(self.size - values.numel(), self.size)

    def to(self, device: torch.device) -> torch.Tensor:
        return to_device(torch.cat(self.parts) if self.parts else torch.zeros(0, dtype=torch.long), device)


class UnitInputs:
    """What one unit's call needs (index tensors end up as views of one device buffer), and its K/V and graph."""

    def __init__(self, segments: dict[int, Segment]):
        self.segments = segments  # node -> its rows
        self.layout: UnitLayout | None = None  # None: no rows to run (one-token leaves only)
        self.ids = self.positions = self.targets = self.slots = None  # slots: the output slot of each head row
        self.rope = self.image_rows = None  # images: [4, rows] depth and (t, h, w) positions; each row's image row
        self.rows = None  # hidden rows the head reads (None: every row, in order)
        self.ends: list[int] = []  # sequences whose last node is in the unit
        self.end_slots = None  # their slots, one sequence after another
        self.kv = UnitKV()
        self.graph: dict[str, torch.Tensor] | None = None  # head outputs with their autograd graph
        self.shape: tuple[int, int] | None = None  # row units: (rows, width) of the call; None: one packed row
        self.shard = None  # context parallelism: this rank's parts of the unit's attention (ShardLayout), built once
        self.row_of: dict[int, int] = {}  # row units: node -> its row
        self.open_rows: list[int] = []  # row units: the rows whose last node hands its state to calls below
        self.cache = None  # row units: the call's TreeStateCache (initial and final recurrent states)
        self.state_grads: dict[int, dict] = {}  # row units: open node -> gradient its children sent to its state
        self.links: list = []  # context parallelism: the call's state links to the neighbouring ranks (state_passing)


# A node's multimodal inputs for its first `length` tokens: [4, length] positions (depth, then t, h, w) and each token's
# row in the step's image table (-1: text). treerl.engine.images.
NodeImages = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]


def build_unit_inputs(tree: PrefixTree, plan: WalkPlan, slots: OutputSlots, device: torch.device,
                      images: NodeImages | None = None, both_ways: bool = False,
                      ) -> tuple[dict[int, UnitInputs], torch.Tensor]:
    """Every unit's inputs (by `id(unit)`), and the slots of every sequence one after another, on `device`; with
    `images`, each unit's rotary positions and image rows too (`both_ways`: an image's tokens see each other both
    ways, Gemma 3's)."""
    index = HostIndex()
    inputs = {id(unit): _unit_inputs(tree, plan, slots, unit, index) for unit in plan.all_units()}
    if images is not None:
        for unit in plan.all_units():
            _add_images(inputs[id(unit)], unit, plan, images, index, both_ways)
    all_slots = index.add(torch.cat([slots.sequence(s) for s in range(len(tree.sequences))]))
    device_index = index.to(device)
    view = lambda x: device_index[x] if isinstance(x, slice) else x
    for data in inputs.values():
        for name in ("ids", "positions", "rows", "targets", "slots", "end_slots", "rope", "image_rows"):
            setattr(data, name, view(getattr(data, name)))
        if data.layout is not None:
            data.layout.positions = data.positions
    return inputs, device_index[all_slots]


def _unit_inputs(tree: PrefixTree, plan: WalkPlan, slots: OutputSlots, unit: Unit, index: HostIndex) -> UnitInputs:
    """Rows, positions, attention layout, output rows and slots of one unit; its sequences' slots."""
    if unit.rows is not None:
        return _row_unit_inputs(tree, plan, slots, unit, index)
    run = plan.run
    segments, ids, positions, rows, targets, unit_slots = {}, [], [], [], [], []
    row = 0
    for n in unit.nodes:
        node = tree.nodes[n]
        if run[n] == 0:
            continue
        segments[n] = Segment(row, run[n], node.start)
        ids.append(node.tokens[: run[n]])
        positions.append(torch.arange(node.start, node.start + run[n]))
        node_rows, node_targets, node_slots = slots.node_rows(node, row)
        rows.append(node_rows)
        targets.append(node_targets)
        unit_slots.append(node_slots)
        row += run[n]
    data = UnitInputs(segments)
    data.ends = [s for n in unit.nodes for s in tree.nodes[n].ends]
    if data.ends:
        data.end_slots = index.add(torch.cat([slots.sequence(s) for s in data.ends]))
    if row == 0:  # one-token leaves only: their outputs came from the parent's fork rows
        return data
    all_rows = torch.cat(rows)
    data.ids, data.positions = index.add(torch.cat(ids)), index.add(torch.cat(positions))
    data.rows = None if torch.equal(all_rows, torch.arange(row)) else index.add(all_rows)
    data.targets, data.slots = index.add(torch.cat(targets)), index.add(torch.cat(unit_slots))
    path_end = tree.nodes[unit.parent].end if unit.parent != ROOT else 0
    runs, blocks = attention_layout(tree, segments)
    data.layout = UnitLayout(runs, blocks, torch.empty(0), path_end)
    return data


def _row_unit_inputs(tree: PrefixTree, plan: WalkPlan, slots: OutputSlots, unit: Unit,
                     index: HostIndex) -> UnitInputs:
    """A row unit (recurrent state): rows x width, each row a chain of nodes from the parent's end, padded on the
    right by repeating its last token (causal: padding changes no real row's outputs; no open row is padded).

    Row r's tokens are rows `[r * width, (r + 1) * width)` of the flattened call; every row starts at the
    parent's end position, so the attention layout is one causal run per row over the path's K/V."""
    run, width = plan.run, unit.width
    path_end = tree.nodes[unit.parent].end if unit.parent != ROOT else 0
    segments, ids, rows, targets, unit_slots, row_of = {}, [], [], [], [], {}
    for r, chain in enumerate(unit.rows):
        offset = r * width
        tokens = torch.cat([tree.nodes[n].tokens[: run[n]] for n in chain])
        ids.append(torch.cat([tokens, tokens[-1:].expand(width - len(tokens))]))
        for n in chain:
            node = tree.nodes[n]
            segments[n] = Segment(offset, run[n], node.start)
            row_of[n] = r
            node_rows, node_targets, node_slots = slots.node_rows(node, offset)
            rows.append(node_rows)
            targets.append(node_targets)
            unit_slots.append(node_slots)
            offset += run[n]
    data = UnitInputs(segments)
    data.ends = [s for n in unit.nodes for s in tree.nodes[n].ends]
    if data.ends:
        data.end_slots = index.add(torch.cat([slots.sequence(s) for s in data.ends]))
    if not unit.rows:  # one-token leaves only: their outputs came from the parent's fork rows
        return data
    count = len(unit.rows)
    data.shape, data.row_of = (count, width), row_of
    data.open_rows = [row_of[o] for o in unit.open]
    data.ids = index.add(torch.cat(ids))
    data.positions = index.add(torch.arange(path_end, path_end + width).repeat(count))
    data.rows = index.add(torch.cat(rows))
    data.targets, data.slots = index.add(torch.cat(targets)), index.add(torch.cat(unit_slots))
    runs = [Segment(r * width, width, path_end) for r in range(count)]
    data.layout = UnitLayout(runs, [], torch.empty(0), path_end)
    return data


def _add_images(data: UnitInputs, unit: Unit, plan: WalkPlan, images: NodeImages, index: HostIndex,
                both_ways: bool) -> None:
    """The unit's rows' positions (`[rows, tokens]`, flattened) and image rows, laid out as its token ids: nodes one
    after another, or (a row unit) each row's chain padded to the width by repeating its last token's. `both_ways`:
    the runs of image rows go to the attention layout (each a block whose tokens see each other both ways, as the
    model's own mask makes a run of image tokens: transformers' `get_block_sequence_ids_for_mask`)."""
    if data.layout is None:
        return
    if data.shape is None:
        parts = [images(n, plan.run[n]) for n in data.segments]
        if both_ways:
            data.layout.both_ways = [run for n, (_, rows) in zip(data.segments, parts)
                                     for run in _image_runs(data.segments[n], rows)]
    else:
        parts = []
        for chain in unit.rows:
            where, rows = zip(*(images(n, plan.run[n]) for n in chain))
            where, rows = torch.cat(where, dim=1), torch.cat(rows)
            pad = data.shape[1] - rows.numel()
            parts.append((torch.cat([where, where[:, -1:].expand(-1, pad)], dim=1),
                          torch.cat([rows, rows[-1:].expand(pad)])))
    data.rope = index.add(torch.cat([rope for rope, _ in parts], dim=1))
    data.image_rows = index.add(torch.cat([rows for _, rows in parts]))


def _image_runs(segment: Segment, rows: torch.Tensor) -> list[Segment]:
    """The maximal runs of a node's image tokens (`rows >= 0`), as rows and positions of the unit."""
    shown = torch.cat([torch.zeros(1, dtype=torch.int8), (rows >= 0).to(torch.int8), torch.zeros(1, dtype=torch.int8)])
    edges = (shown[1:] - shown[:-1]).nonzero()[:, 0].tolist()  # a run starts at +1, ends at -1, alternating
    return [Segment(segment.row + lo, hi - lo, segment.position + lo) for lo, hi in zip(edges[::2], edges[1::2])]


def attention_layout(tree: PrefixTree, segments: dict[int, Segment]) -> tuple[list[Segment], list[Block]]:
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
        if runs and tree.nodes[n].parent == runs[-1][-1]:
            runs[-1].append(n)
        else:
            runs.append([n])
    last_row = {n: segments[n].end for n in order}  # node -> end row of its in-unit subtree
    for n in reversed(order):  # children before parents; a node with rows has its parent's rows in the unit or none
        parent = tree.nodes[n].parent
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
