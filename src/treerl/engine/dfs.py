"""Dynamic tree attention: walk the prefix tree depth-first, computing each shared prefix once.

Step 5 (docs/architecture.md): the DFS walk over the plan's units.

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

Memory (treerl.engine.memory): the plan keeps what is held at once (the running unit's graph and the
graphs kept on the path) within a budget of graph tokens. The default contract, `memory="micro-batch"`:
never more than FlatEngine's packed micro-batch of `max_tokens` tokens (the one knob flat training
sets), or 1.5x the one-path walk when one path alone needs more; `memory="one-path"`: 1.5x the
one-path walk (one node's graph at a time); or an explicit byte budget. Bytes are measured from the
model. A unit whose descendants do not fit beside its graph runs without a graph going down and again
with one going up.

No host synchronisation in the walk: every index (token ids, positions, output rows, slots) is
built on the host before it starts and copied to the device once; losses and metrics stay on the
device and are read once at the end.

This module is the engine and the traversal; `unit_inputs` builds what each unit's call needs,
`walk_outputs` holds the slots, evaluates the losses and keeps their gradients.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from transformers import PreTrainedModel

from treerl.attention import PathKV, TreeCall, UnsupportedModel, engine_attention
from treerl.attention.context_parallel import ContextParallel, ShardLayout, gather_outputs
from treerl.engine.base import (
    Head,
    LossFn,
    OutputSlots,
    StepStats,
    attends_in_own_code,
    check_batch,
    final_hidden,
    gradient_checkpointing,
    output_dtype,
    run_length,
    runs_in_rows,
)
from treerl.engine.embedding_rows import EmbeddingRows
from treerl.engine.head import PolicyHead
from treerl.engine.images import ImageTable, body_positions, vision_family
from treerl.engine.memory import (
    MemoryMode,
    agree_graph_bytes,
    check_memory_settings,
    graph_budget_tokens,
    graph_bytes,
    micro_batch_tokens,
)
from treerl.engine.recurrent import (
    PathIndexKeys,
    PathStates,
    cache_under_checkpointing,
    compressed_entries,
    earliest_mask_ties,
    find_mixers,
    iter_state_grads,
)
from treerl.engine.routing import replayed, tree_routes, unit_rows
from treerl.engine.selective_scan import continued_scans
from treerl.engine.state_passing import StatePassing, side_by_side_scans
from treerl.engine.support import attention_layers, check_all_layers_routed, model_name
from treerl.engine.unit_inputs import UnitInputs, build_unit_inputs
from treerl.engine.walk_outputs import WalkOutputs
from treerl.tree import ROOT, PrefixTree, TokenSequence
from treerl.tree.plan import PlanCost, Unit, WalkPlan, check_recompute


@dataclass
class DfsEngine:
    """Depth-first dynamic tree attention with exact per-sequence gradients.

    Memory contract (default `memory="micro-batch"`): never more autograd graph than FlatEngine's packed
    micro-batch of `max_tokens` tokens, or 1.5x the one-path walk when one path alone needs more."""

    head: Head = field(default_factory=PolicyHead)
    chunk_tokens: int = 2048  # longest run of one node computed at once; longer nodes become chains
    batch_tokens: int = 8192  # most tokens in one model call (nodes packed without padding); 0: one node per call
    recompute: Literal["auto", "always", "never"] = "auto"  # open units: cost model within the budget | always | never
    memory: MemoryMode = "micro-batch"  # at most flat's micro-batch of max_tokens | "one-path": 1.5x the one-path walk
    max_tokens: int = 8192  # the flat micro-batch (FlatEngine.max_tokens) the default contract is measured against
    memory_budget_bytes: int | None = None  # instead: bytes held at once (graph and the path's K/V), from the model
    memory_budget_tokens: int | None = None  # instead: tokens of autograd graph held at once (tests, experiments)
    plan_cost: PlanCost | None = None  # None: PlanCost.for_device
    context_parallel: ContextParallel | None = None  # split every call's rows (a recurrent model's: columns) over ranks
    head_rows: str | None = None  # outputs computed only where this field is nonzero (loss_mask), 0 elsewhere

    def forward(self, model: PreTrainedModel, sequences: Sequence[TokenSequence]) -> list[dict[str, torch.Tensor]]:
        tree = self._tree(model, sequences)
        # The training plan, not a faster one of bigger calls: the log-probs a no-grad pass fills in (old,
        # proximal, reference) must be bit-identical to the ones the update computes, or the on-policy ratio is
        # off by low-precision rounding (bf16 matmuls round differently when the rows of a call change).
        walk = _Walk(self, model, tree, self.plan(model, tree), loss_fn=None)
        with torch.no_grad(), walk.attention(), cache_under_checkpointing(model), walk.continued_scans():
            walk.run()
        return walk.outputs.per_sequence(walk.all_slots)

    def forward_backward(self, model: PreTrainedModel, sequences: Sequence[TokenSequence], loss_fn: LossFn) -> StepStats:
        started = time.perf_counter()
        tree = self._tree(model, sequences)
        walk = _Walk(self, model, tree, self.plan(model, tree), loss_fn=loss_fn)
        with walk.attention(), cache_under_checkpointing(model), walk.continued_scans(), walk.embedding_rows.active():
            walk.run()
        if walk.images is not None:
            walk.images.backward()  # what every unit sent to the image rows, through the vision tower once
        stats = walk.outputs.stats
        stats.loss = float(walk.outputs.total_loss)
        stats.settle()
        stats.seconds = time.perf_counter() - started
        return stats

    def _tree(self, model: PreTrainedModel, sequences: Sequence[TokenSequence]) -> PrefixTree:
        """Check everything, then merge the batch into a tree whose nodes are at most `chunk_tokens` long."""
        check_batch(model, self.head, sequences, tree=True, carries_state=True, head_rows=self.head_rows)
        check_recompute(self.recompute)
        if self.batch_tokens < 0:
            raise ValueError(f"batch_tokens must be >= 0, got {self.batch_tokens}")
        check_memory_settings(self.memory, self.max_tokens, self.memory_budget_tokens, self.memory_budget_bytes)
        if self.context_parallel is not None:
            check_context_parallel(model, sequences, self.context_parallel)
            cp = self.context_parallel  # every rank must walk the same plan
            agree_graph_bytes(model, lambda values: cp.largest(values, _device(model)), self._side_by_side(model))
        family = vision_family(model)  # Gemma 3: an image's tokens see each other both ways, so no piece cuts one
        return PrefixTree.build(sequences).chunked(self.chunk_tokens, whole_images=family is not None and family.both_ways)

    def plan(self, model: PreTrainedModel, tree: PrefixTree) -> WalkPlan:
        """Which nodes run together and which graphs are kept, within the memory budget (in graph tokens)."""
        run = [run_length(node, self.head.shifted) for node in tree.nodes]
        run[ROOT] = 0
        cost = self.plan_cost or PlanCost.for_device(_device(model).type)
        rows = runs_in_rows(model)
        return WalkPlan(tree, run, self.graph_budget_tokens(model, tree), self.batch_tokens, self.recompute, cost, rows,
                        graph_bytes(model).row_tokens if rows else None)

    def graph_budget_tokens(self, model: PreTrainedModel, tree: PrefixTree) -> int:
        """Tokens of autograd graph the walk may hold at once (`tree` is chunked: no node over `chunk_tokens`)."""
        largest = max(run_length(node, self.head.shifted) for node in tree.nodes[1:])
        shift = 1 if self.head.shifted else 0
        lengths = [len(s) - shift for s in tree.sequences]
        if runs_in_rows(model) or any(s.images for s in tree.sequences):
            # flat cannot pack a model whose layers carry a state (one sequence would run into the next), nor a batch
            # that shows images (each sequence's own call): its micro-batch is then one sequence, and so is the
            # contract's; a row holds its chunk padding too
            row_tokens = graph_bytes(model).row_tokens
            largest, micro_batch = row_tokens(largest), row_tokens(max(lengths))
        else:
            micro_batch = micro_batch_tokens(lengths, self.max_tokens)
        cp = self.context_parallel  # each rank holds 1/R of a call, and of the path's store when it is sharded
        return graph_budget_tokens(model, largest, max(len(s) for s in tree.sequences), self.memory, micro_batch,
                                   self.memory_budget_tokens, self.memory_budget_bytes,
                                   *((cp.size, cp.path_ranks, self._side_by_side(model)) if cp is not None else ()))

    def _side_by_side(self, model: PreTrainedModel) -> frozenset[tuple[str, str]] | None:
        """The scans a hybrid's context-parallel ranks split (their pieces hold more graph: see `graph_bytes`)."""
        return side_by_side_scans(model, self.context_parallel) if self.context_parallel is not None else None


def _device(model: PreTrainedModel) -> torch.device:
    return model.get_input_embeddings().weight.device


class _Walk:
    """One depth-first walk: the path store, the units' calls down and their backward up, in plan order."""

    def __init__(self, engine: DfsEngine, model: PreTrainedModel, tree: PrefixTree, plan: WalkPlan,
                 loss_fn: LossFn | None):
        self.model, self.tree, self.plan, self.loss_fn = model, tree, plan, loss_fn
        self.head = engine.head
        self.cp = engine.context_parallel
        self.mixers = find_mixers(model)
        self.own_code = attends_in_own_code(model)  # its layers attend over the K/V the cache returns
        self.layers = attention_layers(model, self.mixers.mixer_classes)
        # the path's K/V; under context parallelism each rank holds every R-th position of it
        ranks = self.cp.path_ranks if self.cp is not None else 1
        self.path = PathKV(max(len(s) for s in tree.sequences), loss_fn is not None, self.cp.rank if ranks > 1 else 0,
                           ranks)
        self.states = PathStates(with_grads=loss_fn is not None) if self.mixers else None  # recurrent state
        # context parallelism over a recurrent model: each rank's columns continue the previous rank's state
        self.passing = StatePassing(model, self.cp) if self.cp is not None and self.mixers else None
        # sparse attention: the path's indexer keys
        self.index_path = PathIndexKeys(self.path.capacity, self.mixers.whole_row_topk) if self.mixers.indexed else None
        # where each token's outputs land, the fork rows' included; with head_rows only the read ones
        slots = OutputSlots(tree, self.head.shifted, engine.head_rows)
        device = _device(model)
        self.outputs = WalkOutputs(tree, self.head.outputs, slots, output_dtype(model), device, loss_fn)
        self.images = None  # the step's images through the vision tower once (treerl.engine.images)
        node_images, both_ways = None, False
        if any(s.images for s in tree.sequences):
            self.images = ImageTable(model, tree.sequences, grad=loss_fn is not None)
            node_images, both_ways = _NodeImages(tree, self.images), vision_family(model).both_ways
        self.inputs, self.all_slots = build_unit_inputs(tree, plan, slots, device, node_images, both_ways)
        self.embedding_rows = EmbeddingRows(model)  # the input embedding's gradient by rows, not a dense table a call
        self.routes = tree_routes(model, tree, self.head.shifted)  # MoE routing replay: each node's routing
        if self.routes is not None:
            if self.cp is not None:
                raise UnsupportedModel(f"{model_name(model)}: routing replay under context parallelism is not "
                                       "supported yet (trainer.context_parallel=1)")
            self.outputs.stats.add_metrics(self.routes.metrics())

    def attention(self) -> contextlib.AbstractContextManager:
        """The model's attention routed through treerl's for the walk, or left to a model that attends in its own code
        (its cache hands it the path's K/V)."""
        return contextlib.nullcontext() if self.own_code else engine_attention(self.model)

    @contextlib.contextmanager
    def continued_scans(self) -> Iterator[None]:
        """Mamba layers' zero-start scans continue the state each call hands them, and compressors report the entries
        they append to their attention's keys, in the forward and in the backward (gradient checkpointing replays a
        layer there); a dynamic mask's top-k (Doge) takes the earliest of tied keys, as in every engine. Under context
        parallelism each mixer layer passes its state from rank to rank (treerl.engine.state_passing)."""
        with continued_scans(self.mixers.scans), compressed_entries(self.model) if self.mixers.compression \
                else contextlib.nullcontext(), earliest_mask_ties(self.model), \
                self.passing.hooks() if self.passing is not None else contextlib.nullcontext():
            yield

    def run(self) -> None:
        """Visit every unit in plan order; backward (when training) on the way back up."""
        for event, unit, node in self.plan.walk():
            data = self.inputs[id(unit)]
            if event == "enter":
                self.enter(unit, data)
            elif event == "push":
                self.path.push(data.kv, [data.segments[n] for n in self.plan.chain(unit, node) if n in data.segments])
                if self.states is not None:
                    self.states.push(self._final_states(data, node))
                if self.index_path is not None:
                    self.index_path.push(data.cache.index_keys, [data.segments[n] for n in self.plan.chain(unit, node)
                                                                 if n in data.segments])
            elif event == "pop":
                self.path.pop(data.kv, [data.segments[n] for n in self.plan.chain(unit, node) if n in data.segments])
                if self.states is not None:
                    data.state_grads[node] = self._state_grads()
            else:
                if self.loss_fn is not None:
                    self.backward(unit, data)
                data.kv.clear()
                data.graph = data.cache = None
                data.links = []
                data.state_grads.clear()

    def _final_states(self, data: UnitInputs, node: int) -> dict:
        """The final states of an open node's row, which its children start from (under context parallelism, held by
        the last rank with columns and shared with every rank)."""
        if self.passing is None:
            return data.cache.row_states(data.row_of[node])
        ends = self.cp.rank == data.shard.active - 1
        return self.passing.share_states(data.cache.row_states(data.row_of[node]) if ends else None, data.shard)

    def _state_grads(self) -> dict:
        """Leave the innermost open node: the gradient its children sent to its final states (under context
        parallelism, received by rank 0's pieces and shared with every rank)."""
        states = self.states.states[-1]
        grads = self.states.pop()
        return grads if self.passing is None else self.passing.share_grads(grads, states)

    def enter(self, unit: Unit, data: UnitInputs) -> None:
        """Run the unit (with a graph if it backpropagates without recomputation); record outputs; losses."""
        keep = self.loss_fn is not None and (not unit.open or unit.keep)
        outputs = self._compute(data, grad=keep)
        if keep:
            data.graph = outputs
        if outputs is not None:
            self.outputs.record(data.slots, outputs)
        if self.loss_fn is not None and data.ends:
            self.outputs.evaluate(data.ends, data.end_slots)

    def _compute(self, data: UnitInputs, grad: bool, again: bool = False) -> dict[str, torch.Tensor] | None:
        """Run the unit's rows at their absolute positions over the path's K/V; apply the head.

        `again`: a recomputation for the backward; the outputs' values are in the slots already, so the
        head only builds its backward (`Head.replay`)."""
        if data.layout is None:
            return None
        self.outputs.stats.model_tokens += data.layout.rows
        if self.cp is not None:
            with torch.set_grad_enabled(grad):
                return self._compute_shard(data, again)
        call = TreeCall(self.path, data.kv, data.layout, wants_mask=self.index_path is not None,
                        replays=self.loss_fn is not None and gradient_checkpointing(self.model))
        inputs = {"input_ids": data.ids[None], "position_ids": data.positions[None]}
        if not self.own_code:
            inputs["treerl_call"] = call
        if data.shape is not None:  # a row unit: rows x width, each row from the parent's recurrent state
            inputs["input_ids"], inputs["position_ids"] = data.ids.view(data.shape), data.positions.view(data.shape)
        if data.rope is not None:  # images: their rows from the step's table; depth and (t, h, w) positions
            ids = inputs.pop("input_ids")
            inputs.update(self.images.inputs(self.model, ids, data.image_rows.view(ids.shape)))
            inputs["position_ids"] = body_positions(data.rope, ids.shape)
        with torch.set_grad_enabled(grad):
            if self.states is not None or self.own_code:
                data.cache = self.mixers.new_cache(self.states.leaves() if self.states else None, data.shape[0],
                                                   data.layout.path_end, self.index_path, data.ids.device,
                                                   attention=call if self.own_code else None)
                call.appended = data.cache.appended  # what compressors append to their attention's keys
                inputs.update({self.mixers.cache_kwarg: data.cache, "use_cache": True})
            rows = lambda: unit_rows(self.routes, data.segments, data.layout.rows, data.shape and data.shape[1])
            with replayed(self.routes, rows, data.ids.device):
                hidden = final_hidden(self.model, **inputs).flatten(0, 1)
            if data.cache is not None:
                data.cache.finish()
                data.cache.check_handed_on(self.mixers.layers, data.open_rows)
            call.forward_done = True
            check_all_layers_routed(self.model, call.layers_called, self.layers)
            if data.rows is not None:
                hidden = hidden[data.rows]
            if again:
                return self.head.replay(self.model, hidden, data.targets, self.outputs.known(data.slots))
            return self.head(self.model, hidden, data.targets)

    def _compute_shard(self, data: UnitInputs, again: bool) -> dict[str, torch.Tensor]:
        """`_compute` of this context-parallel rank's rows of the unit (treerl.attention.context_parallel): its rows
        through the model and the head, the head's outputs of the whole unit gathered from every rank."""
        if data.shard is None:
            data.shard = ShardLayout(data.layout, self.cp, None if data.shape is None else data.shape[1])
        shard = data.shard
        call = TreeCall(self.path, data.kv, data.layout, cp=self.cp, shard=shard,
                        replays=self.loss_fn is not None and gradient_checkpointing(self.model))
        shape = shard.shape or (1, len(shard.runs))
        inputs = {"input_ids": data.ids[shard.runs].view(shape), "position_ids": data.positions[shard.runs].view(shape),
                  "treerl_call": call}
        if self.passing is not None:  # rank 0 starts from the parent's states, the others from the previous rank's
            data.cache = self.mixers.new_cache(self.states.leaves() if self.passing.starts_from_parent(shard) else {},
                                               shape[0],
                                               data.layout.path_end, None, data.ids.device)
            self.passing.begin(data.cache, shard)
            inputs.update({self.mixers.cache_kwarg: data.cache, "use_cache": True})
        hidden = final_hidden(self.model, **inputs).flatten(0, 1)
        if self.passing is not None:
            self.passing.check_scanned()
            data.links = self.passing.end()
            data.cache.finish()
            data.cache.check_handed_on(self.mixers.layers, data.open_rows)
        call.forward_done = True
        check_all_layers_routed(self.model, call.layers_called, self.layers)
        read = data.rows if data.rows is not None else torch.arange(data.layout.rows, device=data.ids.device)
        owner = shard.owner[read]  # the rank of each row the head reads
        mine = (owner == self.cp.rank).nonzero()[:, 0]
        hidden, targets = hidden[shard.where[read[mine]]], data.targets[mine]
        if again:
            known = {name: value[mine] for name, value in self.outputs.known(data.slots).items()}
            outputs = self.head.replay(self.model, hidden, targets, known)
        else:
            outputs = self.head(self.model, hidden, targets)
        outputs = gather_outputs(outputs, self.cp, owner)
        if self.passing is not None:
            self.passing.wait()  # every rank's forward is done: what this one sent has been received
        return outputs

    def backward(self, unit: Unit, data: UnitInputs) -> None:
        """Back-propagate the unit's slot gradients (and, via the store, its K/V's).

        A unit no gradient-carrying loss reads is skipped, so parameters keep `.grad = None` as
        with the flat reference (a zero gradient would still move them through weight decay).
        """
        if data.layout is None or not any(n in self.outputs.needs_backward for n in unit.nodes):
            return
        outputs = data.graph if data.graph is not None else self._compute(data, grad=True, again=True)
        tensors, grads = self.outputs.output_grads(outputs, data.slots)
        # what the node's children sent to its final state (under context parallelism: the last rank's pieces hold it)
        if self.passing is None or self.cp.rank == data.shard.active - 1:
            for node, state_grads in data.state_grads.items():
                for state, grad in iter_state_grads(data.cache, data.row_of[node], state_grads):
                    tensors.append(state)
                    grads.append(grad)
        for link in data.links:  # every state link's backward runs, so each neighbour's message comes
            tensors.append(link)
            grads.append(torch.zeros_like(link))
        if tensors:
            with self.passing.replaying(data.cache, data.shard) if self.passing is not None \
                    else contextlib.nullcontext():  # gradient checkpointing's replays pass states as the forward did
                torch.autograd.backward(tensors, grads)
            self.embedding_rows.flush()
        if self.passing is not None:
            self.passing.wait()
        if self.states is not None and (self.passing is None or self.cp.rank == 0):
            self.states.add_grads(data.cache.initial)  # to the parent's final state


def check_context_parallel(model: PreTrainedModel, sequences: Sequence[TokenSequence], cp: ContextParallel) -> None:
    """What context parallelism computes so far: attention and token mixers that keep their state through the cache
    (sparse attention's indexers, compressed attention, convolutions inside attention, images and a model's own
    attention code are refused, naming why), before any compute."""
    why = None
    inside = sorted({kind.name for kind in find_mixers(model).layers.values() if kind.in_attention})
    if inside:
        why = (f"its attention layers carry state of their own ({', '.join(inside)}), which context parallelism does "
               "not pass between ranks yet")
    elif attends_in_own_code(model):
        why = "it computes attention in its own code over its cache's keys, which the ranks do not share"
    elif gradient_checkpointing(model) and find_mixers(model) and side_by_side_scans(model, cp) is None:
        why = ("gradient checkpointing replays the layers, and a replayed mixer layer would pass its state from rank to "
               "rank again, which context parallelism does with the mixers side by side only "
               "(trainer.context_parallel_mixers=side-by-side, where every mixer allows it)")
    elif any(s.images for s in sequences):
        why = "a sequence shows images, which context parallelism does not feed yet"
    if why is not None:
        raise UnsupportedModel(f"{model_name(model)} under context parallelism: {why}; train it without "
                               "(trainer.context_parallel=1)")


class _NodeImages:
    """A node's positions and image rows, from a sequence through it (they depend only on its prefix)."""

    def __init__(self, tree: PrefixTree, table: ImageTable):
        self.tree, self.table = tree, table

    def __call__(self, node_index: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        node = self.tree.nodes[node_index]
        sequence = self.tree.sequences[self.tree.sequences_through(node_index)]
        return self.table.span(sequence, node.start, node.start + length)
