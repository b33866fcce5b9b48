"""Attention for a batch of sibling tree nodes: queries see `[shared ancestor K/V | own K/V]`.

The DFS engine runs the model on a *unit*: G sibling nodes that start at the same position P
(one node is a unit of G = 1), padded to a common length R. Every row attends to the path's
ancestor K/V (positions < P, shared by all rows) and causally to its own K/V. The two parts are
computed by separate kernels and merged by log-sum-exp (treerl.attention.kernels):
- the ancestor part folds all G rows (and grouped-query heads) into one long query against the
  ancestors stored once: broadcast, never copied, and no mask;
- the own part is plain causal attention per row, so right padding never leaks into real rows.
A sliding window or chunk narrows both parts (the ancestors to the keys some row can still
see); attention sinks are one more log-sum-exp term in the merge.

The ancestors' K/V live in a per-layer path store; their gradient is added to a matching
gradient store, which each ancestor collects when its subtree is finished. A unit's own K/V
gradient from its descendants is collected into the unit (`UnitKV.key_grads`) and added in its
backward. That is how K/V gradients travel up the tree without holding descendants' graphs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from treerl.attention.dispatch import LayerAttention, UnsupportedModel
from treerl.attention.kernels import AttentionSpec, Part, attend, attend_backward, merge


@dataclass
class UnitKV:
    """K/V of one batched call of G sibling nodes that start at position `start`."""

    start: int
    keys: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [G, kv_heads, R, head_dim]
    values: dict[int, torch.Tensor] = field(default_factory=dict)
    key_grads: dict[int, torch.Tensor] | None = None  # what the rows' descendants sent to their K/V
    value_grads: dict[int, torch.Tensor] | None = None


def _grad_dtype(dtype: torch.dtype) -> torch.dtype:
    """Gradients of many descendants are summed in the store: keep them at least in float32."""
    return torch.promote_types(dtype, torch.float32)


class PathKV:
    """K/V of the current root-to-node path, per layer, and the K/V gradient flowing back up it.

    `preallocated=True` (default): one `[1, kv_heads, capacity, head_dim]` store per layer, written
    in place; ancestors are a view of its prefix. `False` keeps one tensor per path node and
    concatenates them for every call (the plain way, kept to measure what preallocation buys).
    Stores take the shape and dtype of the first K/V a layer produces (key and value head sizes
    may differ; under autocast they are the compute dtype).
    """

    def __init__(self, capacity: int, with_grads: bool, preallocated: bool = True):
        self.capacity, self.with_grads, self.preallocated = capacity, with_grads, preallocated
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.key_grads: dict[int, torch.Tensor] = {}
        self.value_grads: dict[int, torch.Tensor] = {}
        self.entries: dict[int, list[list[torch.Tensor]]] = {}  # unpreallocated: per layer, per path node

    def ancestors(self, layer: int, lo: int, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of positions [lo, start) of the path."""
        if self.preallocated:
            return self.keys[layer][:, :, lo:start], self.values[layer][:, :, lo:start]
        keys = torch.cat([e[0] for e in self.entries[layer]], dim=2)
        values = torch.cat([e[1] for e in self.entries[layer]], dim=2)
        return keys[:, :, lo:start], values[:, :, lo:start]

    def add_ancestor_grads(self, layer: int, lo: int, start: int, dk: torch.Tensor, dv: torch.Tensor) -> None:
        """Add d(loss)/d(K, V) of positions [lo, start), to be collected by each ancestor."""
        if self.preallocated:
            self.key_grads[layer][:, :, lo:start] += dk
            self.value_grads[layer][:, :, lo:start] += dv
            return
        offset = 0
        for entry in self.entries[layer]:
            n = entry[0].shape[2]
            a, b = max(lo, offset), min(start, offset + n)
            if a < b:
                entry[2][:, :, a - offset : b - offset] += dk[:, :, a - lo : b - lo]
                entry[3][:, :, a - offset : b - offset] += dv[:, :, a - lo : b - lo]
            offset += n

    def _allocate(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        shape = lambda x: (1, x.shape[1], self.capacity, x.shape[3])
        self.keys[layer] = k.new_zeros(shape(k))
        self.values[layer] = v.new_zeros(shape(v))
        if self.with_grads:
            self.key_grads[layer] = k.new_zeros(shape(k), dtype=_grad_dtype(k.dtype))
            self.value_grads[layer] = v.new_zeros(shape(v), dtype=_grad_dtype(v.dtype))

    @torch.no_grad()
    def push(self, unit: UnitKV, row: int, length: int) -> None:
        """Make row `row` of `unit` part of the path: its descendants will attend to it."""
        end = unit.start + length
        for layer, k in unit.keys.items():
            k, v = k[row : row + 1, :, :length], unit.values[layer][row : row + 1, :, :length]
            if self.preallocated:
                if layer not in self.keys:
                    self._allocate(layer, k, v)
                self.keys[layer][:, :, unit.start : end] = k
                self.values[layer][:, :, unit.start : end] = v
            else:
                grads = [torch.zeros_like(k, dtype=_grad_dtype(k.dtype)), torch.zeros_like(v, dtype=_grad_dtype(v.dtype))]
                entry = [k.clone(), v.clone()] + (grads if self.with_grads else [None, None])
                self.entries.setdefault(layer, []).append(entry)

    @torch.no_grad()
    def pop(self, unit: UnitKV, row: int, length: int) -> None:
        """Row `row`'s subtree is done: move the K/V gradient it received into the unit."""
        if not self.preallocated:
            popped = {layer: self.entries[layer].pop() for layer in unit.keys}
        if not self.with_grads:
            return
        end = unit.start + length
        if unit.key_grads is None:
            unit.key_grads = {l: torch.zeros_like(k, dtype=_grad_dtype(k.dtype)) for l, k in unit.keys.items()}
            unit.value_grads = {l: torch.zeros_like(v, dtype=_grad_dtype(v.dtype)) for l, v in unit.values.items()}
        for layer in unit.keys:
            if self.preallocated:
                slots = (self.key_grads[layer][:, :, unit.start : end], self.value_grads[layer][:, :, unit.start : end])
            else:
                slots = (popped[layer][2], popped[layer][3])
            for slot, into in zip(slots, (unit.key_grads, unit.value_grads)):
                into[layer][row : row + 1, :, :length] += slot
                slot.zero_()


def _fold(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[G, H, R, ...] -> [1, kv_heads, G * groups * R, ...]: every row's queries against one K/V."""
    g, h = x.shape[:2]
    x = x.reshape(g, kv_heads, h // kv_heads, *x.shape[2:]).transpose(0, 1)
    return x.reshape(1, kv_heads, -1, *x.shape[4:])


def _unfold(x: torch.Tensor, rows: int, heads: int, length: int) -> torch.Tensor:
    """Inverse of `_fold`."""
    kv_heads = x.shape[1]
    x = x.reshape(kv_heads, rows, heads // kv_heads, length, *x.shape[3:]).transpose(0, 1)
    return x.reshape(rows, heads, length, *x.shape[4:])


def _expand_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    """Grouped-query K/V [G, kv_heads, R, D] -> one K/V head per query head (own part only: small)."""
    if groups == 1:
        return x
    g, kv, r, d = x.shape
    return x[:, :, None].expand(g, kv, groups, r, d).reshape(g, kv * groups, r, d)


def _reduce_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    if groups == 1:
        return x
    g, h, r, d = x.shape
    return x.reshape(g, h // groups, groups, r, d).sum(2)


def ancestor_range(spec: AttentionSpec, start: int) -> int:
    """First ancestor position any query of a unit starting at `start` can still see."""
    lo = 0
    if spec.window is not None:
        lo = max(lo, start - spec.window + 1)
    if spec.chunk is not None:
        lo = max(lo, start // spec.chunk * spec.chunk)
    return min(lo, start)


class _TreeAttention(torch.autograd.Function):
    """Causal attention over own K/V merged with attention over the path's ancestor K/V (and sinks)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, path: PathKV, unit: UnitKV, layer: int, spec: AttentionSpec):
        unit.keys[layer], unit.values[layer] = k, v
        rows, heads, length, _ = q.shape
        kv_heads = k.shape[1]
        groups = heads // kv_heads
        start = unit.start
        own = Part(q_start=start, k_start=start, causal=True)
        own_out, own_lse, own_saved = attend(q, _expand_heads(k, groups), _expand_heads(v, groups), spec, own)
        parts = [(own_out, own_lse)]
        lo = ancestor_range(spec, start)
        anc_saved: tuple = ()
        if lo < start:
            anc_k, anc_v = path.ancestors(layer, lo, start)
            anc = Part(q_start=start, k_start=lo, causal=False, q_period=length)
            anc_out, anc_lse, anc_saved = attend(_fold(q, kv_heads), anc_k, anc_v, spec, anc)
            parts.append((_unfold(anc_out, rows, heads, length), _unfold(anc_lse, rows, heads, length)))
        sink = sinks.view(1, heads, 1) if sinks is not None else None
        out, lse = merge(parts, sink)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.path, ctx.unit, ctx.layer, ctx.spec, ctx.lo = path, unit, layer, spec, lo
        ctx.own_saved, ctx.anc_saved = own_saved, anc_saved
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        path, unit, layer, spec, lo = ctx.path, ctx.unit, ctx.layer, ctx.spec, ctx.lo
        rows, heads, length, _ = q.shape
        kv_heads = k.shape[1]
        groups = heads // kv_heads
        start = unit.start
        dout = dout.contiguous()
        own = Part(q_start=start, k_start=start, causal=True)
        dq, dk, dv = attend_backward(
            dout, q, _expand_heads(k, groups), _expand_heads(v, groups), out, lse, ctx.own_saved, spec, own
        )
        dk, dv = _reduce_heads(dk, groups), _reduce_heads(dv, groups)
        if lo < start:
            anc_k, anc_v = path.ancestors(layer, lo, start)
            anc = Part(q_start=start, k_start=lo, causal=False, q_period=length)
            fold = lambda x: _fold(x, kv_heads)
            dq_anc, dk_anc, dv_anc = attend_backward(
                fold(dout), fold(q), anc_k, anc_v, fold(out), fold(lse), ctx.anc_saved, spec, anc
            )
            dq = dq + _unfold(dq_anc, rows, heads, length)
            path.add_ancestor_grads(layer, lo, start, dk_anc, dv_anc)
        if unit.key_grads is not None:
            dk = dk + unit.key_grads[layer].to(dk.dtype)
            dv = dv + unit.value_grads[layer].to(dv.dtype)
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[3]:
            # d out / d sink = -p_sink * out, p_sink = exp(sink - lse): the sink only grows the denominator.
            compute = lse.dtype
            p_sink = torch.exp(sinks.to(compute).view(1, heads, 1) - lse)
            dsinks = -(p_sink * (dout.to(compute) * out.to(compute)).sum(-1)).sum((0, 2)).to(sinks.dtype)
        return dq, dk, dv, dsinks, None, None, None, None


class TreeCall:
    """The attention of one unit over the path: handed to every layer through the attention kwargs.

    A plain class, not a dataclass: FSDP2 and other wrappers rebuild dataclasses (and dicts) found in
    a forward's kwargs, and every layer must write into this one unit.
    """

    def __init__(self, path: PathKV, unit: UnitKV):
        self.path, self.unit = path, unit
        self.layers_called: set[int] = set()
        self.forward_done = False  # set by the engine; later calls are gradient checkpointing's recomputation

    def __call__(self, module, query, key, value, layer: LayerAttention) -> torch.Tensor:
        index = module.layer_idx
        if index in self.layers_called and not self.forward_done:
            raise UnsupportedModel(
                f"{type(module).__name__}: layer {index} calls attention more than once per forward (differential "
                "or repeated attention); the tree path stores one K/V per layer (use PackedEngine or FlatEngine)"
            )
        self.layers_called.add(index)
        out = _TreeAttention.apply(query, key, value, layer.sinks, self.path, self.unit, index, layer.spec)
        return out.transpose(1, 2).contiguous()
