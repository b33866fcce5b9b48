"""FLOP counts from the model config: what flat and tree training must compute at the least.

Beside the steps (docs/architecture.md): the FLOP ideal step 5 is measured against.

Forward FLOPs of one token = 2 x (weights it multiplies: attention projections, MLP, LM head)
+ 4 x heads x head_dim x (keys it attends to) per layer. Backward costs a fixed multiple of
forward for both, so the ratio flat/tree is the FLOP-ideal speedup of prefix sharing.
"""

from __future__ import annotations

from transformers import PretrainedConfig

from treerl.models import model_geometry
from treerl.tree import PrefixTree


def linear_flops_per_token(config: PretrainedConfig) -> int:
    """2 x multiply-adds of every weight matrix a token passes through (layers and LM head)."""
    g = model_geometry(config)
    attention = g.hidden * g.heads * g.head_dim * 2 + g.hidden * g.kv_heads * g.head_dim * 2  # q, o and k, v
    mlp = 3 * g.hidden * g.ffn
    return 2 * (g.layers * (attention + mlp) + g.hidden * g.vocab)


def attention_flops_per_key(config: PretrainedConfig) -> int:
    """q.k and p.v for one query-key pair, all layers and heads."""
    g = model_geometry(config)
    return 4 * g.heads * g.head_dim * g.layers


def tree_flops(tree: PrefixTree, config: PretrainedConfig) -> tuple[int, int]:
    """(flat, tree) forward FLOPs: every sequence on its own vs every unique token once."""
    per_token, per_key = linear_flops_per_token(config), attention_flops_per_key(config)

    def causal(start: int, end: int) -> int:  # sum of (position + 1) over positions [start, end)
        return (end * (end + 1) - start * (start + 1)) // 2

    flat = sum(len(s) * per_token + causal(0, len(s)) * per_key for s in tree.sequences)
    unique = sum(n.length * per_token + causal(n.start, n.end) * per_key for n in tree.nodes[1:])
    return flat, unique
