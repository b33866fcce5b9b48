"""Attention routed through transformers' AttentionInterface: tree (DFS) and packed (tree mask) calls.

Step 5 (docs/architecture.md): each layer's attention along the tree.
"""

from treerl.attention.dispatch import (
    ATTENTION_NAME,
    CALL_KWARG,
    LayerAttention,
    UnsupportedModel,
    all_configs,
    engine_attention,
    routed_call,
)
from treerl.attention.kernels import AttentionSpec
from treerl.attention.packed_attention import PackedCall
from treerl.attention.tree_attention import Block, PathKV, Segment, TreeCall, UnitKV, UnitLayout

__all__ = [
    "ATTENTION_NAME",
    "CALL_KWARG",
    "AttentionSpec",
    "Block",
    "LayerAttention",
    "PackedCall",
    "PathKV",
    "Segment",
    "TreeCall",
    "UnitKV",
    "UnitLayout",
    "UnsupportedModel",
    "all_configs",
    "engine_attention",
    "routed_call",
]
