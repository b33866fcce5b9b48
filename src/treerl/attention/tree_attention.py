"""Attention for a batch of sibling tree nodes: queries see `[shared ancestor K/V | own K/V]`.

The DFS engine runs the model on a *unit*: G sibling nodes that start at the same position P
(one node is a unit of G = 1), padded to a common length R. Every row attends to the path's
ancestor K/V (positions < P, shared by all rows) and causally to its own K/V. The two parts are
computed by separate kernels and merged by log-sum-exp (treerl.attention.kernels):
- the ancestor part folds all G rows (and grouped-query heads) into one long query against the
  ancestors stored once: broadcast, never copied, and no mask;
- the own part is plain causal attention per row, so right padding never leaks into real rows.

The ancestors' K/V live in a preallocated per-layer path store; their gradient is added to a
matching gradient store, which each ancestor collects when its subtree is finished. A unit's own
K/V gradient from its descendants is collected into the unit (`UnitKV.key_grads`) and added in
its backward. That is how K/V gradients travel up the tree without holding descendants' graphs.

Registered with transformers' `AttentionInterface`: any causal LM that dispatches attention
through it (Qwen2/2.5/3, Llama, ...) runs unchanged.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface, PreTrainedModel

from treerl.attention.kernels import attend, attend_backward, merge

ATTENTION_NAME = "treerl_tree"


@dataclass
class UnitKV:
    """K/V of one batched call of G sibling nodes that start at position `start`."""

    start: int
    keys: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [G, kv_heads, R, head_dim]
    values: dict[int, torch.Tensor] = field(default_factory=dict)
    key_grads: dict[int, torch.Tensor] | None = None  # what the rows' descendants sent to their K/V
    value_grads: dict[int, torch.Tensor] | None = None


class PathKV:
    """K/V of the current root-to-node path, per layer, and the K/V gradient flowing back up it.

    `preallocated=True` (default): one `[1, kv_heads, capacity, head_dim]` store per layer, written
    in place; ancestors are a view of its prefix. `False` keeps one tensor per path node and
    concatenates them for every call (the plain way, kept to measure what preallocation buys).
    """

    def __init__(self, model: PreTrainedModel, capacity: int, with_grads: bool, preallocated: bool = True):
        config = model.config
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        param = next(model.parameters())
        self.layers = config.num_hidden_layers
        self.with_grads, self.preallocated = with_grads, preallocated
        # Gradients of many descendants are summed here: keep them at least in float32.
        self.grad_dtype = torch.promote_types(param.dtype, torch.float32)
        self.unit: UnitKV | None = None  # the unit being computed
        if preallocated:
            shape = (1, kv_heads, capacity, head_dim)
            store = lambda dtype: [torch.zeros(shape, dtype=dtype, device=param.device) for _ in range(self.layers)]
            self.keys, self.values = store(param.dtype), store(param.dtype)
            self.key_grads = store(self.grad_dtype) if with_grads else None
            self.value_grads = store(self.grad_dtype) if with_grads else None
        else:  # per layer, one entry per path node: (keys, values, key grads, value grads)
            self.entries: list[list[list[torch.Tensor]]] = [[] for _ in range(self.layers)]

    def ancestors(self, layer: int, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of positions [0, start) of the path."""
        if self.preallocated:
            return self.keys[layer][:, :, :start], self.values[layer][:, :, :start]
        entries = self.entries[layer]
        return torch.cat([e[0] for e in entries], dim=2), torch.cat([e[1] for e in entries], dim=2)

    def add_ancestor_grads(self, layer: int, start: int, dk: torch.Tensor, dv: torch.Tensor) -> None:
        """Add d(loss)/d(K, V) of positions [0, start), to be collected by each ancestor."""
        if self.preallocated:
            self.key_grads[layer][:, :, :start] += dk
            self.value_grads[layer][:, :, :start] += dv
            return
        offset = 0
        for entry in self.entries[layer]:
            n = entry[0].shape[2]
            entry[2] += dk[:, :, offset : offset + n]
            entry[3] += dv[:, :, offset : offset + n]
            offset += n

    @torch.no_grad()
    def push(self, unit: UnitKV, row: int, length: int) -> None:
        """Make row `row` of `unit` part of the path: its descendants will attend to it."""
        end = unit.start + length
        for layer, k in unit.keys.items():
            k, v = k[row : row + 1, :, :length], unit.values[layer][row : row + 1, :, :length]
            if self.preallocated:
                self.keys[layer][:, :, unit.start : end] = k
                self.values[layer][:, :, unit.start : end] = v
            else:
                grads = [torch.zeros_like(k, dtype=self.grad_dtype), torch.zeros_like(v, dtype=self.grad_dtype)]
                self.entries[layer].append([k.clone(), v.clone()] + (grads if self.with_grads else [None, None]))

    @torch.no_grad()
    def pop(self, unit: UnitKV, row: int, length: int) -> None:
        """Row `row`'s subtree is done: move the K/V gradient it received into the unit."""
        if not self.preallocated:
            popped = {layer: self.entries[layer].pop() for layer in unit.keys}
        if not self.with_grads:
            return
        end = unit.start + length
        if unit.key_grads is None:
            unit.key_grads = {l: torch.zeros_like(k, dtype=self.grad_dtype) for l, k in unit.keys.items()}
            unit.value_grads = {l: torch.zeros_like(v, dtype=self.grad_dtype) for l, v in unit.values.items()}
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


class _TreeAttention(torch.autograd.Function):
    """Causal attention over own K/V merged with full attention over the path's ancestor K/V."""

    @staticmethod
    def forward(ctx, q, k, v, path: PathKV, layer: int, scale: float):
        unit = path.unit
        unit.keys[layer], unit.values[layer] = k, v
        rows, heads, length, _ = q.shape
        kv_heads = k.shape[1]
        groups = heads // kv_heads
        own_out, own_lse, own_saved = attend(q, _expand_heads(k, groups), _expand_heads(v, groups), scale, True)
        parts = [(own_out, own_lse)]
        anc_saved: tuple = ()
        if unit.start > 0:
            anc_k, anc_v = path.ancestors(layer, unit.start)
            anc_out, anc_lse, anc_saved = attend(_fold(q, kv_heads), anc_k, anc_v, scale, False)
            parts.append((_unfold(anc_out, rows, heads, length), _unfold(anc_lse, rows, heads, length)))
        out, lse = merge(parts)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.path, ctx.unit, ctx.layer, ctx.scale = path, unit, layer, scale
        ctx.own_saved, ctx.anc_saved = own_saved, anc_saved
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        path, unit, layer, scale = ctx.path, ctx.unit, ctx.layer, ctx.scale
        rows, heads, length, _ = q.shape
        kv_heads = k.shape[1]
        groups = heads // kv_heads
        dout = dout.contiguous()
        dq, dk, dv = attend_backward(
            dout, q, _expand_heads(k, groups), _expand_heads(v, groups), out, lse, ctx.own_saved, scale, True
        )
        dk, dv = _reduce_heads(dk, groups), _reduce_heads(dv, groups)
        if unit.start > 0:
            anc_k, anc_v = path.ancestors(layer, unit.start)
            fold = lambda x: _fold(x, kv_heads)
            dq_anc, dk_anc, dv_anc = attend_backward(
                fold(dout), fold(q), anc_k, anc_v, fold(out), fold(lse), ctx.anc_saved, scale, False
            )
            dq = dq + _unfold(dq_anc, rows, heads, length)
            path.add_ancestor_grads(layer, unit.start, dk_anc, dv_anc)
        if unit.key_grads is not None:
            dk = dk + unit.key_grads[layer].to(dk.dtype)
            dv = dv + unit.value_grads[layer].to(dv.dtype)
        return dq, dk, dv, None, None, None


_CURRENT: contextvars.ContextVar[PathKV | None] = contextvars.ContextVar("treerl_path_kv", default=None)


def tree_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: query `[G, H, R, D]` of one unit over the path."""
    path = _CURRENT.get()
    if path is None or path.unit is None:
        raise RuntimeError(f"attention '{ATTENTION_NAME}' called outside a treerl engine")
    scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    out = _TreeAttention.apply(query, key, value, path, module.layer_idx, scale)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION_NAME, tree_attention_forward)


def check_supported(model: PreTrainedModel) -> None:
    """Fail early on models whose attention the tree engine cannot reproduce exactly."""
    config = model.config
    layer_types = getattr(config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types) or getattr(config, "use_sliding_window", False):
        raise NotImplementedError(
            f"{type(model).__name__}: sliding-window / non-full attention layers are not supported by tree attention"
        )
    if model.training and getattr(config, "attention_dropout", 0.0):
        raise NotImplementedError(f"{type(model).__name__}: attention dropout > 0 in training mode is not supported")
    for name, sub in model.named_modules():
        if sub.__class__.__name__.endswith("Attention") and not hasattr(sub, "layer_idx"):
            raise NotImplementedError(f"{name}: attention module has no layer_idx; cannot route tree attention")


@contextlib.contextmanager
def attention_implementation(model: PreTrainedModel, name: str) -> Iterator[None]:
    """Switch `model`'s transformers attention implementation for the duration of the block."""
    previous = model.config._attn_implementation
    model.config._attn_implementation = name
    try:
        yield
    finally:
        model.config._attn_implementation = previous


@contextlib.contextmanager
def tree_attention(model: PreTrainedModel, path: PathKV) -> Iterator[PathKV]:
    """Route `model`'s attention through the path store for the duration of the block."""
    token = _CURRENT.set(path)
    try:
        with attention_implementation(model, ATTENTION_NAME):
            yield path
    finally:
        _CURRENT.reset(token)
