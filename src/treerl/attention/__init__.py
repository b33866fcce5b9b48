"""Attention functions registered with transformers' AttentionInterface."""

from treerl.attention.tree_attention import (
    ATTENTION_NAME,
    PathKV,
    UnitKV,
    attention_implementation,
    check_supported,
    tree_attention,
)

__all__ = ["ATTENTION_NAME", "PathKV", "UnitKV", "attention_implementation", "check_supported", "tree_attention"]
