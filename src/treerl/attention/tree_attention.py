"""Attention for one tree node: its queries see `[ancestor K/V | own K/V]` at absolute positions.

The engine keeps, per layer, a preallocated K/V store for the current root-to-node path and a
matching gradient store. A node's own K/V (after RoPE) is written into the store at its
positions; attention reads the store's prefix, so no `torch.cat` per node. In backward, the
gradient that flows into the ancestors' part is added to the gradient store (their own
backward picks it up later), and the gradient that the node's descendants left there is added
to the node's own K/V gradient. This is how the DFS engine passes K/V gradients up the tree
without holding the descendants' graphs.

The function is registered with transformers' `AttentionInterface`, so any causal LM that
dispatches attention through it (Qwen2/2.5/3, Llama, ...) runs unchanged.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right
from transformers import AttentionInterface, PreTrainedModel

ATTENTION_NAME = "treerl_tree"


@dataclass
class PathKV:
    """Per-layer K/V of the current root-to-node path, and the K/V gradient flowing back up it."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    key_grads: list[torch.Tensor] | None
    value_grads: list[torch.Tensor] | None
    start: int = 0  # absolute position of the first token of the node being computed

    @classmethod
    def allocate(cls, model: PreTrainedModel, capacity: int, with_grads: bool) -> PathKV:
        """One `[1, kv_heads, capacity, head_dim]` store per layer (plus gradient stores when training)."""
        config = model.config
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        param = next(model.parameters())
        shape = (1, kv_heads, capacity, head_dim)
        layers = config.num_hidden_layers

        def stores(dtype: torch.dtype) -> list[torch.Tensor]:
            return [torch.zeros(shape, dtype=dtype, device=param.device) for _ in range(layers)]

        # Gradients of many descendants are summed here: keep them at least in float32.
        grad_dtype = torch.promote_types(param.dtype, torch.float32)
        return cls(
            keys=stores(param.dtype),
            values=stores(param.dtype),
            key_grads=stores(grad_dtype) if with_grads else None,
            value_grads=stores(grad_dtype) if with_grads else None,
        )


class _AttachToPath(torch.autograd.Function):
    """Write a node's K or V into the path store; return the store's `[0, start + L)` prefix."""

    @staticmethod
    def forward(ctx, own: torch.Tensor, store: torch.Tensor, grad_store: torch.Tensor | None, start: int):
        end = start + own.shape[2]
        # `.data` writes leave the store's version counter alone: the saved prefixes of the
        # ancestors' graphs cover positions < start and are not touched.
        store.data[:, :, start:end] = own
        ctx.grad_store, ctx.start, ctx.end = grad_store, start, end
        return store.data[:, :, :end]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gs, start, end = ctx.grad_store, ctx.start, ctx.end
        if gs is None:
            raise RuntimeError("tree attention: backward through a path allocated without gradient stores")
        gs[:, :, :start] += grad[:, :, :start]
        own = grad[:, :, start:end] + gs[:, :, start:end]
        gs[:, :, start:end] = 0  # the slot is reused by the next subtree
        return own, None, None, None


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
    """transformers attention function: query `[1, H, L, D]` against the path store's prefix."""
    path = _CURRENT.get()
    if path is None:
        raise RuntimeError(f"attention '{ATTENTION_NAME}' called outside treerl.attention.tree_attention(...)")
    layer = module.layer_idx
    key_grads = path.key_grads[layer] if path.key_grads is not None else None
    value_grads = path.value_grads[layer] if path.value_grads is not None else None
    k = _AttachToPath.apply(key, path.keys[layer], key_grads, path.start)
    v = _AttachToPath.apply(value, path.values[layer], value_grads, path.start)
    q_len, kv_len = query.shape[2], k.shape[2]
    mask = None if q_len == kv_len else causal_lower_right(q_len, kv_len)
    out = F.scaled_dot_product_attention(
        query,
        k,
        v,
        attn_mask=mask,
        is_causal=mask is None,
        dropout_p=dropout,
        scale=scaling,
        enable_gqa=query.shape[1] != k.shape[1],
    )
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
    for name, sub in model.named_modules():
        if sub.__class__.__name__.endswith("Attention") and not hasattr(sub, "layer_idx"):
            raise NotImplementedError(f"{name}: attention module has no layer_idx; cannot route tree attention")


@contextlib.contextmanager
def tree_attention(model: PreTrainedModel, path: PathKV) -> Iterator[PathKV]:
    """Route `model`'s attention through the path store for the duration of the block."""
    previous = model.config._attn_implementation
    token = _CURRENT.set(path)
    model.config._attn_implementation = ATTENTION_NAME
    try:
        yield path
    finally:
        model.config._attn_implementation = previous
        _CURRENT.reset(token)
