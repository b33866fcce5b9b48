"""Attention of a packed tree: all unique tokens in one row, each seeing only its ancestors.

Step 5 (docs/architecture.md): PackedEngine's attention, the tree as one masked sequence.

The packed engine lays the tree's nodes out in preorder, every token at its absolute position
(its depth). Token q may see token k iff k comes no later and q's node lies in the subtree of
k's node; a layer's sliding window or chunk further hides keys by position distance.

Kernels: PyTorch SDPA with a boolean mask where the scores are plain, an exact math version
where the layer soft-caps scores or has attention sinks, and on CUDA transformers'
FlexAttention function with a block mask that skips the blocks no token may see.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from treerl.attention.dispatch import LayerAttention
from treerl.attention.kernels import AttentionSpec


class PackedCall:
    """The ancestor mask of one pack, handed to every layer through the attention kwargs.

    A plain class (see TreeCall): wrappers such as FSDP2 rebuild dataclasses found in kwargs.
    """

    def __init__(self, positions: torch.Tensor, node_of: torch.Tensor, subtree_end: torch.Tensor, flex: bool = False):
        self.positions = positions  # [n] absolute position (depth) of each packed token
        self.node_of = node_of  # [n] pack-local preorder index of each token's node
        self.subtree_end = subtree_end  # [n] last pack-local node index in the subtree of each token's node
        self.flex = flex  # CUDA: FlexAttention block masks
        self.layers_called: set[int] = set()
        self._masks: dict = {}

    def __call__(self, module, query, key, value, layer: LayerAttention) -> torch.Tensor:
        self.layers_called.add(module.layer_idx)
        spec = layer.spec
        if self.flex:
            out, _ = ALL_ATTENTION_FUNCTIONS["flex_attention"](
                module, query, key, value, self._block_mask(spec),
                scaling=spec.scale, softcap=spec.softcap, s_aux=layer.sinks,
            )
            return out
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        mask = self._mask(spec)
        if spec.softcap is None and layer.sinks is None:
            out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=spec.scale)
        else:
            out = _math_attention(query, key, value, mask, spec, layer.sinks)
        return out.transpose(1, 2).contiguous()

    def allowed(self, spec: AttentionSpec, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """Whether packed token q may see packed token k (elementwise over broadcast index tensors)."""
        ok = (k <= q) & (self.node_of[q] <= self.subtree_end[k])
        distance = self.positions[q] - self.positions[k]
        if spec.window is not None:
            ok = ok & (distance < spec.window)
        if spec.chunk is not None:
            ok = ok & (self.positions[q] // spec.chunk == self.positions[k] // spec.chunk)
        return ok

    @torch.no_grad()  # built once per pack and spec: a layer recomputed by gradient checkpointing reuses it
    def _mask(self, spec: AttentionSpec) -> torch.Tensor:
        key = (spec.window, spec.chunk)
        if key not in self._masks:
            i = torch.arange(len(self.positions), device=self.positions.device)
            self._masks[key] = self.allowed(spec, i[:, None], i[None, :])[None, None]
        return self._masks[key]

    @torch.no_grad()
    def _block_mask(self, spec: AttentionSpec):
        key = ("flex", spec.window, spec.chunk)
        if key not in self._masks:
            from torch.nn.attention.flex_attention import create_block_mask

            n = len(self.positions)
            mask_mod = lambda b, h, q, k: self.allowed(spec, q, k)
            self._masks[key] = create_block_mask(mask_mod, B=None, H=None, Q_LEN=n, KV_LEN=n, device=self.positions.device)
        return self._masks[key]


def _math_attention(q, k, v, mask, spec: AttentionSpec, sinks: torch.Tensor | None) -> torch.Tensor:
    """Soft-capped scores and/or sink logits, by plain autograd ops."""
    compute = torch.promote_types(q.dtype, torch.float32)
    scores = (q.to(compute) @ k.to(compute).transpose(-1, -2)) * spec.scale
    if spec.softcap is not None:
        scores = torch.tanh(scores / spec.softcap) * spec.softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink = sinks.to(compute).view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return probs.to(v.dtype) @ v
