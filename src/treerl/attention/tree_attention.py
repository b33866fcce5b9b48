"""Attention of a packed unit of tree nodes: each token sees its own node causally, its ancestors fully.

Step 5 (docs/architecture.md): DfsEngine's attention, each unit over the path.

The DFS engine runs the model on a *unit*: tree nodes laid out one after another in a single row,
with no padding, in preorder. A *segment* is a causal run of the row: one node, or a chain of nodes
where each is followed by its own child (consecutive positions: one sequence). All of them hang
below the same node of the current root-to-node path, whose K/V (positions `< path_end`) live in a
per-layer path store. A token of segment j attends to
- the path's K/V: every query of the unit against the store's prefix, all in one kernel call
  (queries folded into one long row per K/V head: broadcast, never copied, no mask);
- its own segment, causally (one kernel call per segment);
- its ancestors in other segments of the unit, fully: the queries below an in-unit node are
  contiguous in preorder, so each *block* (rows, a prefix of a segment) is one kernel call; the
  engine lays them out (treerl.engine.unit_inputs.attention_layout);
- where a run of its segment attends both ways (Gemma 3's image tokens), that run's later keys too (one kernel call
  per run, `UnitLayout.both_ways`: the causal part already gave the earlier ones).
Exactly the pairs the tree allows are computed; the parts are merged by log-sum-exp (as ring
attention does, treerl.attention.kernels), and each part's backward gets the merged output and
log-sum-exp. A sliding window or chunk narrows the parts (and the path to the keys some query can
still see); attention sinks are one more log-sum-exp term.

The flat reference's packed layout is a unit of whole sequences with no path: only the own parts.

A model that computes attention in its own code over the K/V its cache returns (Bloom, Falcon, GPT-Neo) gets
[path | own row] K/V from the cache instead (`TreeCall.keys_over_path`), each row of its calls a chain from the path's
end, and builds its own causal mask over them.

The path's K/V gradient is added to a matching gradient store, which each ancestor collects when
its subtree is finished; what descendants sent to a unit's own K/V is collected into the unit
(`UnitKV.key_grads`) and added in its backward. That is how K/V gradients travel up the tree
without holding descendants' graphs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from treerl.attention.context_parallel import (
    ContextParallel,
    ShardLayout,
    gather_keys,
    gather_rows,
    merge_over_ranks,
    scatter_rows,
)
from treerl.attention.dispatch import LayerAttention, UnsupportedModel
from treerl.attention.kernels import AttentionSpec, Part, attend, attend_backward

Slot = tuple[int | None, int]  # (layer index, n): the layer's n-th attention call of a forward, one K/V on the path


@dataclass(frozen=True)
class Segment:
    """Rows `[row, row + length)` of a unit hold one node's tokens at positions `[position, position + length)`."""

    row: int
    length: int
    position: int

    @property
    def end(self) -> int:
        return self.row + self.length


@dataclass(frozen=True)
class Block:
    """Queries of rows `[q_lo, q_hi)` see all keys of `key`: the part of a causal run that is their ancestors."""

    q_lo: int
    q_hi: int
    key: Segment
    q_max: int  # largest query position (for windows and chunks)


class UnitLayout:
    """Where a unit's tokens sit and which of its own tokens each sees. Built on the host, once per unit.

    `segments` tile the row in order; `positions` (on the device) is each row's absolute position.
    """

    def __init__(self, segments: list[Segment], blocks: list[Block], positions: torch.Tensor, path_end: int,
                 both_ways: list[Segment] | None = None):
        self.segments, self.blocks, self.positions, self.path_end = segments, blocks, positions, path_end
        # runs of rows, each inside one segment, whose tokens also see the run's later tokens (Gemma 3's images)
        self.both_ways = both_ways or []
        self.rows = segments[-1].end if segments else 0
        self.first_position = min((s.position for s in segments), default=path_end)
        self.last_position = max((s.position + s.length - 1 for s in segments), default=path_end)
        self._folded: dict[int, torch.Tensor] = {}

    def folded_positions(self, groups: int) -> torch.Tensor:
        """Positions of the rows repeated `groups` times (queries folded per K/V head)."""
        if groups not in self._folded:
            self._folded[groups] = self.positions.repeat(groups)
        return self._folded[groups]


@dataclass
class UnitKV:
    """K/V of one unit (layer -> `[1, kv_heads, rows, head_dim]`) and what its descendants sent to them."""

    keys: dict[Slot, torch.Tensor] = field(default_factory=dict)
    values: dict[Slot, torch.Tensor] = field(default_factory=dict)
    key_grads: dict[Slot, torch.Tensor] | None = None
    value_grads: dict[Slot, torch.Tensor] | None = None

    def clear(self) -> None:
        self.keys.clear()
        self.values.clear()
        self.key_grads = self.value_grads = None


def _kept(x: torch.Tensor) -> torch.Tensor:
    """K or V as a unit keeps them: values only. The tensor itself would close a cycle that Python's collector cannot
    see (unit -> K -> its autograd history -> an earlier layer's attention node -> its ctx -> unit): every call's K/V
    stayed alive after its backward wherever an engine did not clear the unit (FlatEngine's packed rows: 67 GiB on an
    H100 within one step)."""
    return x.detach()


def _grad_dtype(dtype: torch.dtype) -> torch.dtype:
    """Gradients of many descendants are summed in the store: keep them at least in float32."""
    return torch.promote_types(dtype, torch.float32)


class PathKV:
    """K/V of the current root-to-node path, per layer, and the K/V gradient flowing back up it.

    One `[1, kv_heads, capacity, head_dim]` store per layer, written in place at absolute positions;
    ancestors are a view of its prefix. Stores take the shape and dtype of the first K/V a layer
    produces (key and value head sizes may differ; under autocast they are the compute dtype).

    Sharded over `ranks` context-parallel ranks (treerl.attention.context_parallel): this one holds every
    `ranks`-th position from `rank` on (position p at p // ranks: `held`), a store of about capacity / ranks
    positions and its gradients; what it reads of [lo, end) is then every `ranks`-th position.
    """

    def __init__(self, capacity: int, with_grads: bool, rank: int = 0, ranks: int = 1):
        self.capacity, self.with_grads, self.rank, self.ranks = capacity, with_grads, rank, ranks
        self.keys: dict[Slot, torch.Tensor] = {}
        self.values: dict[Slot, torch.Tensor] = {}
        self.key_grads: dict[Slot, torch.Tensor] = {}
        self.value_grads: dict[Slot, torch.Tensor] = {}

    def held(self, lo: int, end: int) -> tuple[slice, int]:
        """Where this store keeps the positions [lo, end) it holds, and the first of them."""
        below = lambda x: max(0, (x - self.rank + self.ranks - 1) // self.ranks)  # held positions < x
        first = below(lo)
        return slice(first, max(first, below(end))), self.rank + first * self.ranks

    def ancestors(self, layer: Slot, lo: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of the positions [lo, end) of the path this store holds."""
        span, _ = self.held(lo, end)
        return self.keys[layer][:, :, span], self.values[layer][:, :, span]

    def add_ancestor_grads(self, layer: Slot, lo: int, end: int, dk: torch.Tensor, dv: torch.Tensor) -> None:
        """Add d(loss)/d(K, V) of the held positions of [lo, end), to be collected by each ancestor."""
        span, _ = self.held(lo, end)
        self.key_grads[layer][:, :, span] += dk
        self.value_grads[layer][:, :, span] += dv

    def _allocate(self, layer: Slot, k: torch.Tensor, v: torch.Tensor) -> None:
        size, _ = self.held(0, self.capacity)
        shape = lambda x: (1, x.shape[1], size.stop, x.shape[3])
        self.keys[layer] = k.new_zeros(shape(k))
        self.values[layer] = v.new_zeros(shape(v))
        if self.with_grads:
            self.key_grads[layer] = k.new_zeros(shape(k), dtype=_grad_dtype(k.dtype))
            self.value_grads[layer] = v.new_zeros(shape(v), dtype=_grad_dtype(v.dtype))

    def _rows(self, s: Segment) -> tuple[slice, slice]:
        """The segment's positions this store holds: where (in the store) and which rows of the unit."""
        span, first = self.held(s.position, s.position + s.length)
        row = s.row + first - s.position
        return span, slice(row, row + (span.stop - span.start) * self.ranks, self.ranks)

    @torch.no_grad()
    def push(self, unit: UnitKV, segments: list[Segment]) -> None:
        """Make these segments of `unit` (a chain of nodes) part of the path: descendants will attend to them."""
        for layer, k in unit.keys.items():
            v = unit.values[layer]
            if layer not in self.keys:
                self._allocate(layer, k, v)
            for s in segments:
                span, rows = self._rows(s)
                self.keys[layer][:, :, span] = k[:, :, rows]
                self.values[layer][:, :, span] = v[:, :, rows]

    @torch.no_grad()
    def pop(self, unit: UnitKV, segments: list[Segment]) -> None:
        """The segments' descendants are done: move the K/V gradient they sent into the unit."""
        if not self.with_grads:
            return
        if unit.key_grads is None:
            unit.key_grads = {l: torch.zeros_like(k, dtype=_grad_dtype(k.dtype)) for l, k in unit.keys.items()}
            unit.value_grads = {l: torch.zeros_like(v, dtype=_grad_dtype(v.dtype)) for l, v in unit.values.items()}
        for layer in unit.keys:
            for s in segments:
                span, rows = self._rows(s)
                for store, into in ((self.key_grads, unit.key_grads), (self.value_grads, unit.value_grads)):
                    into[layer][:, :, rows] += store[layer][:, :, span]
                    store[layer][:, :, span] = 0


def _fold(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[1, H, N, ...] -> [1, kv_heads, groups * N, ...]: every query head of a group against one K/V head."""
    h = x.shape[1]
    return x.reshape(1, kv_heads, (h // kv_heads) * x.shape[2], *x.shape[3:])


def _unfold(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Inverse of `_fold`."""
    return x.reshape(1, heads, -1, *x.shape[3:])


def _expand_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    """Grouped-query K/V [1, kv_heads, N, D] -> one K/V head per query head (the unit's own K/V only)."""
    if groups == 1:
        return x
    b, kv, n, d = x.shape
    return x[:, :, None].expand(b, kv, groups, n, d).reshape(b, kv * groups, n, d)


def _reduce_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    if groups == 1:
        return x
    b, h, n, d = x.shape
    return x.reshape(b, h // groups, groups, n, d).sum(2)


def path_start(spec: AttentionSpec, first_query: int) -> int:
    """First path position any query at or after `first_query` can still see (a window or chunk narrows it)."""
    lo = 0
    if spec.window is not None:
        lo = max(lo, first_query - spec.window + 1)
    if spec.chunk is not None:
        lo = max(lo, first_query // spec.chunk * spec.chunk)
    return min(lo, first_query)


def _merge_into(out: torch.Tensor, lse: torch.Tensor, rows: slice, part_out: torch.Tensor, part_lse: torch.Tensor):
    """Merge one partial attention over other keys into rows of the running (out, lse), in place."""
    old_lse = lse[:, :, rows]
    new_lse = torch.logaddexp(old_lse, part_lse.to(lse.dtype))
    safe = new_lse.nan_to_num(neginf=0.0)
    scaled = out[:, :, rows] * torch.exp(old_lse - safe)[..., None]
    out[:, :, rows] = scaled + part_out.to(out.dtype) * torch.exp(part_lse.to(lse.dtype) - safe)[..., None]
    lse[:, :, rows] = new_lse


def _own_part(s: Segment) -> Part:
    return Part(q_start=s.position, k_start=s.position, causal=True)


def _block_part(b: Block, layout: UnitLayout) -> Part:
    return Part(q_start=0, k_start=b.key.position, causal=False, q_positions=layout.positions[b.q_lo : b.q_hi],
                q_max=b.q_max)


def _later_part(s: Segment) -> Part:
    return Part(q_start=s.position, k_start=s.position, causal=False, later=True)


def _path_part(layout: UnitLayout, lo: int, groups: int) -> Part:
    return Part(q_start=0, k_start=lo, causal=False, q_positions=layout.folded_positions(groups),
                q_max=layout.last_position)


class _UnitAttention(torch.autograd.Function):
    """Own segments causally, in-unit ancestors and the path's K/V fully, merged by log-sum-exp (and sinks)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, path: PathKV | None, unit: UnitKV, layout: UnitLayout, layer: Slot,
                spec: AttentionSpec):
        unit.keys[layer], unit.values[layer] = _kept(k), _kept(v)
        heads, kv_heads = q.shape[1], k.shape[1]
        groups = heads // kv_heads
        ke, ve = _expand_heads(k, groups), _expand_heads(v, groups)
        parts = [attend(q[:, :, s.row : s.end], ke[:, :, s.row : s.end], ve[:, :, s.row : s.end], spec, _own_part(s))
                 for s in layout.segments]
        own_saved = [saved for _, _, saved in parts]
        lo = path_start(spec, layout.path_end)
        use_path = path is not None and lo < layout.path_end
        if not layout.blocks and not layout.both_ways and not use_path and sinks is None:
            out = torch.cat([o for o, _, _ in parts], dim=2)
            lse = torch.cat([l for _, l, _ in parts], dim=2)
            block_saved, path_saved = [], ()
        else:
            lse = torch.cat([l for _, l, _ in parts], dim=2)
            out = torch.cat([o.to(lse.dtype) for o, _, _ in parts], dim=2)
            block_saved = []
            for b in layout.blocks:
                key = slice(b.key.row, b.key.end)
                o, l, saved = attend(q[:, :, b.q_lo : b.q_hi], ke[:, :, key], ve[:, :, key], spec, _block_part(b, layout))
                _merge_into(out, lse, slice(b.q_lo, b.q_hi), o, l)
                block_saved.append(saved)
            for s in layout.both_ways:  # the later keys of a run that attends both ways
                rows = slice(s.row, s.end)
                o, l, saved = attend(q[:, :, rows], ke[:, :, rows], ve[:, :, rows], spec, _later_part(s))
                _merge_into(out, lse, rows, o, l)
                block_saved.append(saved)
            path_saved = _path_and_sinks(q, out, lse, sinks, path if use_path else None, layer, spec, lo,
                                         layout.path_end, _path_part(layout, lo, groups))
            out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.path, ctx.unit, ctx.layout, ctx.layer, ctx.spec, ctx.lo = path, unit, layout, layer, spec, lo
        ctx.use_path, ctx.own_saved, ctx.block_saved, ctx.path_saved = use_path, own_saved, block_saved, path_saved
        return out

    @staticmethod
    def backward(ctx, dout):
        q, out, lse, sinks, groups, ke, ve = _saved(ctx)
        layout, spec = ctx.layout, ctx.spec
        dout = dout.contiguous()
        grads = []
        for s, saved in zip(layout.segments, ctx.own_saved):
            r = slice(s.row, s.end)
            grads.append(attend_backward(dout[:, :, r], q[:, :, r], ke[:, :, r], ve[:, :, r], out[:, :, r],
                                         lse[:, :, r], saved, spec, _own_part(s)))
        dq = torch.cat([g[0] for g in grads], dim=2)
        dk = torch.cat([g[1] for g in grads], dim=2)
        dv = torch.cat([g[2] for g in grads], dim=2)
        for b, saved in zip(layout.blocks, ctx.block_saved):
            r, key = slice(b.q_lo, b.q_hi), slice(b.key.row, b.key.end)
            dq_b, dk_b, dv_b = attend_backward(dout[:, :, r], q[:, :, r], ke[:, :, key], ve[:, :, key], out[:, :, r],
                                               lse[:, :, r], saved, spec, _block_part(b, layout))
            dq[:, :, r] += dq_b
            dk[:, :, key] += dk_b
            dv[:, :, key] += dv_b
        for s, saved in zip(layout.both_ways, ctx.block_saved[len(layout.blocks):]):
            r = slice(s.row, s.end)
            dq_b, dk_b, dv_b = attend_backward(dout[:, :, r], q[:, :, r], ke[:, :, r], ve[:, :, r], out[:, :, r],
                                               lse[:, :, r], saved, spec, _later_part(s))
            dq[:, :, r] += dq_b
            dk[:, :, r] += dk_b
            dv[:, :, r] += dv_b
        dk, dv = _reduce_heads(dk, groups), _reduce_heads(dv, groups)
        dq, dk, dv, dsinks = _path_sinks_and_descendants_backward(ctx, dout, q, out, lse, sinks, dq, dk, dv,
                                                                  _path_part(layout, ctx.lo, groups))
        return dq, dk, dv, dsinks, None, None, None, None, None


def _saved(ctx) -> tuple:
    """What a unit attention's backward starts from: its saved tensors, the query heads per K/V head, and K/V
    expanded to the query heads."""
    q, k, v, out, lse, sinks = ctx.saved_tensors
    groups = q.shape[1] // k.shape[1]
    return q, out, lse, sinks, groups, _expand_heads(k, groups), _expand_heads(v, groups)


def _path_and_sinks(q, out, lse, sinks, path: PathKV | None, layer: Slot, spec: AttentionSpec, lo: int, end: int,
                    part: Part) -> tuple:
    """Merge the path's K/V `[lo, end)` (every query folded per K/V head; None: no path part) and the sinks into
    (out, lse), in place; what the path part's backward needs."""
    heads = q.shape[1]
    saved = ()
    if path is not None:
        anc_k, anc_v = path.ancestors(layer, lo, end)
        o, l, saved = attend(_fold(q, anc_k.shape[1]), anc_k, anc_v, spec, part)
        _merge_into(out, lse, slice(None), _unfold(o, heads), _unfold(l, heads))
    _merge_sinks(out, lse, sinks)
    return saved


def _merge_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor | None) -> None:
    """Attention sinks (a logit per head with a zero value) into (out, lse), in place."""
    if sinks is not None:
        heads = out.shape[1]
        _merge_into(out, lse, slice(None), torch.zeros_like(out), sinks.to(lse.dtype).view(1, heads, 1).expand_as(lse))


def _path_sinks_and_descendants_backward(ctx, dout, q, out, lse, sinks, dq, dk, dv, part: Part | None) -> tuple:
    """The path part's backward (its K/V gradient to the path store; None: none here), what descendants sent to this
    unit's K/V added, and the sinks' gradient."""
    heads, kv_heads = q.shape[1], dk.shape[1]
    if ctx.use_path and part is not None:
        path, lo, end = ctx.path, ctx.lo, ctx.layout.path_end
        anc_k, anc_v = path.ancestors(ctx.layer, lo, end)
        fold = lambda x: _fold(x, kv_heads)
        dq_p, dk_p, dv_p = attend_backward(fold(dout), fold(q), anc_k, anc_v, fold(out), fold(lse), ctx.path_saved,
                                           ctx.spec, part)
        dq = dq + _unfold(dq_p, heads)
        path.add_ancestor_grads(ctx.layer, lo, end, dk_p, dv_p)
    unit = ctx.unit
    if unit.key_grads is not None:
        dk = dk + unit.key_grads[ctx.layer].to(dk.dtype)
        dv = dv + unit.value_grads[ctx.layer].to(dv.dtype)
    dsinks = None
    if sinks is not None and ctx.needs_input_grad[3]:
        # d out / d sink = -p_sink * out, p_sink = exp(sink - lse): the sink only grows the denominator.
        compute = lse.dtype
        p_sink = torch.exp(sinks.to(compute).view(1, heads, 1) - lse)
        dsinks = -(p_sink * (dout.to(compute) * out.to(compute)).sum(-1)).sum((0, 2)).to(sinks.dtype)
    return dq, dk, dv, dsinks


class _ShardAttention(torch.autograd.Function):
    """One context-parallel rank's queries (`shard`) against the unit's gathered K/V and the path's: the parts of
    `_UnitAttention` clipped to its rows (treerl.attention.context_parallel), merged by log-sum-exp. A sharded path
    (`PathKV.ranks` > 1): every query of the unit meets this rank's share of it, and the ranks' partials merge
    (`_sharded_path`); a replicated one: this rank's queries meet it whole."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, path: PathKV | None, unit: UnitKV, layout: UnitLayout, layer: Slot,
                spec: AttentionSpec, shard: ShardLayout):
        unit.keys[layer], unit.values[layer] = _kept(k), _kept(v)  # the whole unit's: each rank keeps its share
        heads, kv_heads = q.shape[1], k.shape[1]
        groups = heads // kv_heads
        ke, ve = _expand_heads(k, groups), _expand_heads(v, groups)
        lse = q.new_full(q.shape[:-1], float("-inf"), dtype=torch.promote_types(q.dtype, torch.float32))
        out = q.new_zeros((*q.shape[:-1], v.shape[-1]), dtype=lse.dtype)
        saved_parts = []
        for rows, keys, part in shard.parts:
            o, l, saved = attend(q[:, :, rows], ke[:, :, keys], ve[:, :, keys], spec, part)
            _merge_into(out, lse, rows, o, l)
            saved_parts.append(saved)
        lo = path_start(spec, layout.path_end)
        sharded = path is not None and path.ranks > 1
        use_path = path is not None and lo < layout.path_end and (sharded or shard.rows > 0)  # sharded: every rank
        path_saved = ()  # joins the collectives
        if use_path and sharded:
            o, l, path_saved = _sharded_path(q, path, layer, spec, lo, layout, shard, groups)
            if shard.rows:
                _merge_into(out, lse, slice(None), o, l)
        elif use_path:
            path_saved = _path_and_sinks(q, out, lse, None, path, layer, spec, lo, layout.path_end,
                                         _replicated_path_part(shard, layout, lo, groups))
        _merge_sinks(out, lse, sinks)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.path, ctx.unit, ctx.layout, ctx.layer, ctx.spec, ctx.lo = path, unit, layout, layer, spec, lo
        ctx.shard, ctx.use_path, ctx.saved_parts, ctx.path_saved = shard, use_path, saved_parts, path_saved
        return out

    @staticmethod
    def backward(ctx, dout):
        q, out, lse, sinks, groups, ke, ve = _saved(ctx)
        layout, spec, shard = ctx.layout, ctx.spec, ctx.shard
        dout = dout.contiguous()
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(ke), torch.zeros_like(ve)
        for (rows, keys, part), saved in zip(shard.parts, ctx.saved_parts):
            dq_p, dk_p, dv_p = attend_backward(dout[:, :, rows], q[:, :, rows], ke[:, :, keys], ve[:, :, keys],
                                               out[:, :, rows], lse[:, :, rows], saved, spec, part)
            dq[:, :, rows] += dq_p
            dk[:, :, keys] += dk_p
            dv[:, :, keys] += dv_p
        dk, dv = _reduce_heads(dk, groups), _reduce_heads(dv, groups)
        part = _replicated_path_part(shard, layout, ctx.lo, groups)
        if ctx.use_path and ctx.path.ranks > 1:
            dq_path = _sharded_path_backward(ctx, dout, q, out, lse, groups)
            if shard.rows:
                dq = dq + dq_path
            part = None  # done
        # what descendants sent to this rank's share of the unit's K/V (the key gather sums the ranks')
        dq, dk, dv, dsinks = _path_sinks_and_descendants_backward(ctx, dout, q, out, lse, sinks, dq, dk, dv, part)
        return dq, dk, dv, dsinks, None, None, None, None, None, None


def _replicated_path_part(shard: ShardLayout, layout: UnitLayout, lo: int, groups: int) -> Part:
    """The part this rank's queries (folded per K/V head) compute over the whole path's keys [lo, path end)."""
    return Part(q_start=0, k_start=lo, causal=False, q_positions=shard.folded_positions(groups),
                q_max=layout.last_position)


def _shard_path_part(path: PathKV, layout: UnitLayout, lo: int, groups: int) -> tuple[slice, Part]:
    """This rank's share of the path's keys [lo, path end) and the part every query of the unit (folded per K/V head)
    computes over them."""
    span, first = path.held(lo, layout.path_end)
    return span, Part(q_start=0, k_start=first, causal=False, q_positions=layout.folded_positions(groups),
                      q_max=layout.last_position, k_stride=path.ranks)


def _sharded_path(q, path: PathKV, layer: Slot, spec: AttentionSpec, lo: int, layout: UnitLayout, shard: ShardLayout,
                  groups: int) -> tuple:
    """This rank's queries over the whole path, whose K/V the ranks hold a share each: the unit's queries gathered,
    each rank's share attended, the partials merged onto their queries' ranks (`merge_over_ranks`). Traffic is the
    call's queries and outputs, never the path's K/V."""
    heads = q.shape[1]
    q_all = gather_rows(q, shard)
    anc_k, anc_v = path.ancestors(layer, lo, layout.path_end)
    span, part = _shard_path_part(path, layout, lo, groups)
    if span.stop > span.start:
        o, l, saved = attend(_fold(q_all, anc_k.shape[1]), anc_k, anc_v, spec, part)
        o, l = _unfold(o, heads), _unfold(l, heads).to(torch.promote_types(q.dtype, torch.float32))
    else:  # no key of this rank's share is in reach
        o, saved = q_all.new_zeros((*q_all.shape[:-1], anc_v.shape[-1])), ()
        l = q_all.new_full(q_all.shape[:-1], float("-inf"), dtype=torch.promote_types(q.dtype, torch.float32))
    o, l = merge_over_ranks(o, l, shard)
    return o, l, saved


def _sharded_path_backward(ctx, dout, q, out, lse, groups: int) -> torch.Tensor:
    """`_sharded_path`'s backward: the unit's queries, output gradients, outputs and log-sum-exps gathered, this
    rank's share of the path's K/V gradient into its store, the query gradient summed onto the queries' ranks."""
    shard, path, layout, heads = ctx.shard, ctx.path, ctx.layout, q.shape[1]
    d, dv = q.shape[-1], dout.shape[-1]
    gathered = gather_rows(torch.cat([q, dout.to(q.dtype), out.to(q.dtype)], dim=-1), shard)
    q_all, dout_all, out_all = gathered[..., :d], gathered[..., d : d + dv], gathered[..., d + dv :]
    lse_all = gather_rows(lse[..., None], shard)[..., 0]
    span, part = _shard_path_part(path, layout, ctx.lo, groups)
    if span.stop > span.start:
        anc_k, anc_v = path.ancestors(ctx.layer, ctx.lo, layout.path_end)
        fold = lambda x: _fold(x, anc_k.shape[1])
        dq_all, dk_p, dv_p = attend_backward(fold(dout_all), fold(q_all), anc_k, anc_v, fold(out_all), fold(lse_all),
                                             ctx.path_saved, ctx.spec, part)
        path.add_ancestor_grads(ctx.layer, ctx.lo, layout.path_end, dk_p, dv_p)
        dq_all = _unfold(dq_all, heads)
    else:
        dq_all = torch.zeros_like(q_all)
    # the ranks' partial query gradients summed in at least float32, as the forward merges their outputs
    return scatter_rows(dq_all.to(torch.promote_types(q.dtype, torch.float32)).contiguous(), shard).to(q.dtype)


class TreeCall:
    """The attention of one unit (over the path, if any): handed to every layer through the attention kwargs.

    Each attention call of a forward has its own K/V slot on the path: the n-th call of layer L is slot (L, n), the
    same in every forward of the model. A layer that attends more than once (differential attention's two calls,
    a looped layer's passes, HRM's cycles) has a slot per call, as one whole forward computes each call over its own
    keys; modules without a layer index (Zamba's shared attention block, tied across layers) count as one layer
    (None), their calls told apart by their order.

    A plain class, not a dataclass: FSDP2 and other wrappers rebuild dataclasses (and dicts) found in
    a forward's kwargs, and every layer must write into this one unit.
    """

    def __init__(self, path: PathKV | None, unit: UnitKV, layout: UnitLayout, wants_mask: bool = False,
                 replays: bool = False, appended: dict[int, tuple[int, torch.Tensor | None]] | None = None,
                 cp: ContextParallel | None = None, shard: ShardLayout | None = None):
        self.path, self.unit, self.layout = path, unit, layout
        self.cp, self.shard = cp, shard  # context parallelism: this rank's rows of the unit
        # layer -> (keys its attention appends after the row's own, their additive bias): DeepSeek-V4's compressed
        # entries, reported by the engine's cache (treerl.engine.recurrent.compressed_entries)
        self.appended = {} if appended is None else appended
        self.layers_called: set[int | None] = set()
        self.calls: dict[int | None, int] = {}  # layer -> its attention calls in the forward (its slots)
        self.forward_done = False  # set by the engine; later calls are gradient checkpointing's recomputation
        self.replays = replays  # gradient checkpointing will recompute the layers in backward
        self.wants_mask = wants_mask  # the layers read a causal mask themselves (a sparse-attention indexer)

    def slot(self, module: torch.nn.Module) -> Slot:
        """The path K/V slot of this attention call: the layer's n-th of the forward; in a recomputation (after the
        forward), the layer's one slot."""
        return self.slot_of(getattr(module, "layer_idx", None), type(module).__name__)

    def slot_of(self, index: int | None, who: str) -> Slot:
        """`slot`, for an attention call of layer `index` (`who` names it in a refusal)."""
        if index is not None and not isinstance(index, int):
            raise UnsupportedModel(f"{who}: its layer_idx {index!r} is no layer index; treerl "
                                   "cannot tell which layer's keys and values the path holds for it")
        self.layers_called.add(index)
        if self.forward_done:
            return index, 0
        n = self.calls.get(index, 0)
        if n and self.replays:
            what = "modules without a layer index call" if index is None else f"layer {index} calls"
            raise UnsupportedModel(
                f"{who}: {what} attention more than once per forward (differential, looped or shared "
                "attention), and gradient checkpointing's recomputation in backward replays one layer at a time, "
                "which cannot tell which of those calls (and so which keys on the path) it replays; turn gradient "
                "checkpointing off for this model"
            )
        self.calls[index] = n + 1
        return index, n

    def keys_over_path(self, key: torch.Tensor, value: torch.Tensor, index: int | None) -> tuple[torch.Tensor, ...]:
        """For a layer that computes attention in its own code over the K/V its cache returns (Bloom, MVP, TrOCR):
        [path | own row] K/V (`[rows, kv_heads, path + width, D]`), each row of the call one chain from the path's
        end, so that the model's own causal mask over them (the cache says the path's length) is the sequence's. The
        row's K/V are kept for the path; the path's K/V gradient goes to its store."""
        slot = self.slot_of(index, f"layer {index}")
        rows, _, width, _ = key.shape
        _check_chains(self.layout, rows, width, index, "computed by the model over the K/V its cache returns")
        return _over_path(key, value, self.path, self.unit, self.layout.path_end, slot)

    def __call__(self, module, query, key, value, layer: LayerAttention) -> torch.Tensor:
        slot = self.slot(module)
        if key.shape[2] != query.shape[2]:  # keys beyond the call's own tokens
            layer = self._with_appended(slot[0], layer, key.shape[2] - query.shape[2])
        if self.cp is not None:
            if layer.dense:
                raise UnsupportedModel(f"layer {slot[0]}: dense attention (an indexer's choice, a bias per key) under "
                                       "context parallelism, which treerl does not compute yet")
            rows = query.shape[0]  # a recurrent model's call: this rank's columns of every row, as one row
            query, key, value = (_one_row(x) for x in (query, key, value))
            key, value = gather_keys(key, self.shard), gather_keys(value, self.shard)
            out = _ShardAttention.apply(query, key, value, layer.sinks, self.path, self.unit, self.layout, slot,
                                        layer.spec, self.shard)
            return _unflatten(out, rows).transpose(1, 2).contiguous()
        if self.layout.both_ways and (layer.dense or query.shape[0] > 1):
            raise UnsupportedModel(f"layer {slot[0]}: tokens that attend to each other both ways (an image's) in a "
                                   "call of rows or of dense attention, which treerl does not compute: use FlatEngine")
        if layer.dense:  # an indexer's choice, a bias per query and key, a sink per query
            return dense_attention(query, key, value, layer, self.path, self.unit, self.layout, slot)
        rows = query.shape[0]
        if rows > 1:  # a batch of rows (a unit of a recurrent model): one row of rows x width, a causal run each
            query, key, value = (_one_row(x) for x in (query, key, value))
        out = _UnitAttention.apply(query, key, value, layer.sinks, self.path, self.unit, self.layout, slot, layer.spec)
        if rows > 1:
            out = out.reshape(out.shape[1], rows, -1, out.shape[-1]).transpose(0, 1)
        return out.transpose(1, 2).contiguous()


    def _with_appended(self, index: int | None, layer: LayerAttention, extra: int) -> LayerAttention:
        """The layer's keys after its own tokens' are entries a compressor appended (`appended`); any others are keys
        treerl cannot place on the tree: refused."""
        count, bias = self.appended.get(index, (0, None))
        if count != extra:
            raise UnsupportedModel(f"layer {index}: its attention reads {extra} keys beyond the call's own tokens, "
                                   "which no module treerl knows appended; treerl cannot place them on the tree (use "
                                   "FlatEngine)")
        return dataclasses.replace(layer, appended=count, appended_bias=bias)


def _one_row(x: torch.Tensor) -> torch.Tensor:
    """[rows, heads, width, D] -> [1, heads, rows * width, D]: row r's tokens at `[r * width, (r + 1) * width)`."""
    rows, heads, width, dim = x.shape
    return x.transpose(0, 1).reshape(1, heads, rows * width, dim)


# ---------------------------------------------------------------- dense attention over [path | row]

def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: LayerAttention, path: PathKV | None,
                    unit: UnitKV, layout: UnitLayout, index: Slot) -> torch.Tensor:
    """Attention for a unit of rows (each a chain starting at the path's end) computed densely over [path | own row],
    causally, for what the unit kernels do not compute (`LayerAttention.dense`):
    - sparse attention: the keys a learned indexer chose, `layer.indices` (positions in that order, DeepSeek sparse
      attention) or `layer.mask` (a boolean mask over them, which the layer narrowed from treerl's causal one:
      Qwen4-Exp's block selection). The indexer scored exactly the keys the query has on its sequence alone (the path
      is its ancestors), so the chosen set is the same;
    - a bias per query and key, `layer.bias` (Inkling's position_bias over distances, which the layer computed over
      [path | row] from the cache's offsets: the same distances as on the sequence alone), within a sliding window;
    - attention sinks, one more logit of the softmax per head (HY-V4) or per query (Inkling2).
    Exact (the flash-MLA kernel is for CUDA); the path's K/V gradient goes to the path store, what descendants sent to
    this unit's K/V is added."""
    rows, heads, width, _ = q.shape
    end = layout.path_end
    _check_dense_call(layer, index[0], layout, rows, width)
    groups = heads // k.shape[1]
    k, k_appended = k[:, :, :width], k[:, :, width:]  # appended: a compressor's entries, the row's own (not the path's)
    v, v_appended = v[:, :, :width], v[:, :, width:]
    k, v = _over_path(k, v, path, unit, end, index)
    k, v = _expand_heads_batched(k, groups), _expand_heads_batched(v, groups)
    scores = torch.matmul(q, k.transpose(-1, -2)) * layer.spec.scale
    if layer.bias is not None:  # a bias per query and key (Inkling's distances), over [path | row] like the scores
        scores = scores + layer.bias.to(scores.dtype)
    scores = scores.masked_fill(~_allowed_keys(layer, rows, width, end, q.device), float("-inf"))
    if layer.appended:  # DeepSeek-V4's compressed entries: each query's causal (and top-k) choice, an additive bias
        k_appended, v_appended = _expand_heads_batched(k_appended, groups), _expand_heads_batched(v_appended, groups)
        more = torch.matmul(q, k_appended.transpose(-1, -2)) * layer.spec.scale
        if layer.appended_bias is not None:
            more = more + layer.appended_bias.to(more.dtype)
        scores, v = torch.cat([scores, more], dim=-1), torch.cat([v, v_appended], dim=2)
    scores = scores.to(torch.promote_types(q.dtype, torch.float32))
    if layer.sinks is not None:  # a learned logit that takes its share of the softmax and gives no value
        scores = torch.cat([scores, _sink_logits(layer.sinks, rows, heads, width).to(scores.dtype)], dim=-1)
    weights = torch.softmax(scores, dim=-1)[..., : v.shape[2]].to(q.dtype)
    return torch.matmul(weights, v).transpose(1, 2).contiguous()


def _over_path(k: torch.Tensor, v: torch.Tensor, path: PathKV | None, unit: UnitKV, end: int,
               slot: Slot) -> tuple[torch.Tensor, torch.Tensor]:
    """The call's own K/V (`[rows, kv_heads, width, D]`, kept for the path) behind the path's: [path | row]. Backward
    adds what descendants sent to the own K/V, and sends the path's share to its store."""
    rows = k.shape[0]
    unit.keys[slot], unit.values[slot] = _kept(_one_row(k)), _kept(_one_row(v))  # the path store reads segments
    k, v = _WithDescendantGrads.apply(k, v, unit, slot)
    if path is not None and end > 0:
        path_k, path_v = _PathRead.apply(_DIFFERENTIABLE, path, slot, end, k.dtype)
        k = torch.cat([path_k.expand(rows, -1, -1, -1), k], dim=2)
        v = torch.cat([path_v.expand(rows, -1, -1, -1), v], dim=2)
    return k, v


def _check_chains(layout: UnitLayout, rows: int, width: int, index: int | None, what: str) -> None:
    """Attention over [path | row] needs each row of the call to be one chain of nodes from the path's end."""
    end = layout.path_end
    chains = not layout.blocks and len(layout.segments) == rows and all(
        s.row == r * width and s.length == width and s.position == end for r, s in enumerate(layout.segments))
    if not chains:
        raise UnsupportedModel(f"layer {index}: its attention ({what}) is computed over [path | row], which needs each "
                               "row of a call to be one chain from the path's end; this call packs several nodes into "
                               "a row")


def _allowed_keys(layer: LayerAttention, rows: int, width: int, end: int, device: torch.device) -> torch.Tensor:
    """Which keys of [path | row] each query may see: causal, within the sliding window, among the indexer's choice."""
    keys = torch.arange(end + width, device=device)[None, :]
    queries = end + torch.arange(width, device=device)[:, None]
    allowed = keys <= queries  # causal over [path | row]
    if layer.spec.window is not None:  # key k visible to query q while q - k < window (transformers' sliding mask)
        allowed = allowed & (keys > queries - layer.spec.window)
    allowed = allowed[None, None]
    if layer.indices is not None:
        chosen = torch.zeros(rows, width, end + width, dtype=torch.bool, device=device)
        allowed = allowed & chosen.scatter_(-1, layer.indices.long(), True)[:, None]
    if layer.mask is not None:
        allowed = allowed & layer.mask
    return allowed


def _sink_logits(sinks: torch.Tensor, rows: int, heads: int, width: int) -> torch.Tensor:
    """Sink logits `[rows, heads, width, 1]`: one per head (`[heads]`, HY-V4) or one per query (`[rows, heads, width,
    1]`, Inkling2's, projected from each token's hidden state)."""
    per_query = sinks.view(1, heads, 1, 1) if sinks.dim() == 1 else sinks
    return per_query.expand(rows, heads, width, 1)


def _check_dense_call(layer: LayerAttention, index: int | None, layout: UnitLayout, rows: int, width: int) -> None:
    """What the dense attention assumes: its rows each a chain from the path's end, a mask or bias over [path | row],
    and nothing it does not apply (a window or soft-cap over an indexer's choice, soft-capping, chunks)."""
    end = layout.path_end
    _check_chains(layout, rows, width, index, "an indexer's choice, a bias per query and key, a sink per query or "
                  "appended keys")
    if layer.indices is not None or layer.mask is not None:
        _check_sparse_spec(layer.spec, index)
    else:
        _check_dense_spec(layer.spec, index)
    expected = (rows, 1, width, end + width)
    if layer.mask is not None and (layer.mask.dtype != torch.bool or layer.mask.shape != expected):
        raise UnsupportedModel(f"layer {index}: an attention mask of shape {tuple(layer.mask.shape)} "
                               f"({layer.mask.dtype}) is not a choice among [path | row] (expected {expected}, bool)")
    if layer.appended_bias is not None and layer.appended_bias.shape[-2:] != (width, layer.appended):
        raise UnsupportedModel(f"layer {index}: the bias of its {layer.appended} appended keys has shape "
                               f"{tuple(layer.appended_bias.shape)}, not one per query of the call and key")
    if layer.bias is not None and (layer.bias.dim() != 4 or layer.bias.shape[-2:] != (width, end + width)
                                   or layer.bias.shape[0] not in (1, rows)):
        raise UnsupportedModel(f"layer {index}: its position_bias of shape {tuple(layer.bias.shape)} is not over "
                               f"[path | row] (expected ({rows}, heads, {width}, {end + width})): the layer computed "
                               "its distances without the cache's offsets, so a tree node would read them from 0")


def _check_dense_spec(spec: AttentionSpec, index: int | None) -> None:
    """The dense attention applies scale, biases, sinks and a sliding window: refuse what else a layer would ask."""
    extra = [name for name, value in (("soft-capping", spec.softcap), ("chunked attention", spec.chunk)) if value]
    if extra:
        raise UnsupportedModel(f"layer {index}: attention with a bias per query and key, a sink per query or appended "
                               f"keys, and with {' and '.join(extra)}; treerl's dense attention over [path | row] does "
                               "not apply it (use FlatEngine)")


def _check_sparse_spec(spec: AttentionSpec, index: int | None) -> None:
    """Sparse attention here computes scale, the indexer's choice and sinks: refuse what else a layer would ask."""
    extra = [name for name, value in (("a sliding window", spec.window), ("soft-capping", spec.softcap),
                                      ("chunked attention", spec.chunk)) if value]
    if extra:
        raise UnsupportedModel(f"layer {index}: sparse attention (keys chosen by an indexer) with {' and '.join(extra)}; "
                               "treerl's sparse attention does not apply it over the indexer's choice (use FlatEngine)")


def _expand_heads_batched(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _unflatten(x: torch.Tensor, rows: int) -> torch.Tensor:
    """Inverse of `_one_row`: [1, heads, rows * width, D] -> [rows, heads, width, D]."""
    return x.reshape(x.shape[1], rows, -1, x.shape[-1]).transpose(0, 1)


_DIFFERENTIABLE = torch.zeros((), requires_grad=True)  # an input that makes a read of the path differentiable


class _PathRead(torch.autograd.Function):
    """The path's K/V as a copy (the store is written in place later); backward adds into the gradient store."""

    @staticmethod
    def forward(ctx, _flag, path: PathKV, layer: Slot, end: int, dtype: torch.dtype):
        ctx.path, ctx.layer, ctx.end = path, layer, end
        k, v = path.ancestors(layer, 0, end)
        return k.to(dtype, copy=True), v.to(dtype, copy=True)

    @staticmethod
    def backward(ctx, dk, dv):
        if ctx.path.with_grads:
            ctx.path.add_ancestor_grads(ctx.layer, 0, ctx.end, dk.sum(0, keepdim=True), dv.sum(0, keepdim=True))
        return None, None, None, None, None


class _WithDescendantGrads(torch.autograd.Function):
    """The unit's own K/V; backward adds what its descendants sent to them (collected when their subtrees ended)."""

    @staticmethod
    def forward(ctx, k: torch.Tensor, v: torch.Tensor, unit: UnitKV, layer: Slot):
        ctx.unit, ctx.layer, ctx.rows = unit, layer, k.shape[0]
        return k.view_as(k), v.view_as(v)

    @staticmethod
    def backward(ctx, dk, dv):
        unit = ctx.unit
        if unit.key_grads is not None:
            dk = dk + _unflatten(unit.key_grads[ctx.layer], ctx.rows).to(dk.dtype)
            dv = dv + _unflatten(unit.value_grads[ctx.layer], ctx.rows).to(dv.dtype)
        return dk, dv, None, None
