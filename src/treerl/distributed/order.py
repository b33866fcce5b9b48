"""The batch in trie order: exact prefix-tree features of any subset of sequences, without building its tree.

Step 4 (docs/architecture.md): how the balancer reads a batch.

Sort the sequences lexicographically (the order `PrefixTree.build` and its depth-first walk use).
For sorted strings, the longest common prefix of two of them is the minimum of the neighbour
LCPs between them, so the tree of ANY subset, taken in this order, is described by its members'
lengths and the LCP of each member with the previous one: each member adds its tokens beyond
that LCP. This is what lets the balancer price a candidate piece in O(1) and cut a tree along
its subtrees: a contiguous run in this order is a set of whole subtrees plus two partial ones at
its ends, and cutting it at position i recomputes exactly the prefix `lcp[i]` on both sides.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from treerl.tree import TokenSequence

# What a tree's step cost is estimated from (see treerl.distributed.cost.CostModel), in this order.
FEATURES = ("calls", "unique_tokens", "attention", "leaves", "sequences", "flat_tokens")


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    m = min(len(a), len(b))
    differ = np.flatnonzero(a[:m] != b[:m])
    return int(differ[0]) if len(differ) else m


def _triangle(n: np.ndarray) -> np.ndarray:
    """Sum of (position + 1) over positions 0..n-1: the keys that n causal query tokens attend to."""
    n = n.astype(np.float64)
    return n * (n + 1) / 2


class TrieOrder:
    """Sequences sorted in trie order, with each one's LCP with its predecessor."""

    def __init__(self, sequences: Sequence[TokenSequence]) -> None:
        tokens = [s.tokens.tolist() for s in sequences]
        self.order = np.array(sorted(range(len(tokens)), key=lambda i: (tokens[i], i)), dtype=np.int64)
        self.position = np.empty_like(self.order)
        self.position[self.order] = np.arange(len(self.order))
        self.length = np.array([len(tokens[i]) for i in self.order], dtype=np.int64)
        self.lcp = np.zeros(len(self.order), dtype=np.int64)  # lcp[0] = 0: nothing before the first
        arrays = [np.asarray(tokens[i]) for i in self.order]
        for p in range(1, len(arrays)):
            self.lcp[p] = _common_prefix(arrays[p - 1], arrays[p])

    def __len__(self) -> int:
        return len(self.order)

    def trees(self, below: int = 0) -> list[tuple[int, int]]:
        """Runs [a, b) of positions whose sequences share more than `below` tokens: the batch's trees."""
        cuts = [0] + [p for p in range(1, len(self)) if self.lcp[p] <= below] + [len(self)]
        return list(itertools.pairwise(cuts))

    def common_prefix(self) -> int:
        """Tokens shared by every sequence of the batch (a system prompt), 0 when there are several trees."""
        return int(self.lcp[1:].min()) if len(self) > 1 else 0

    def subset(self, positions: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Lengths and predecessor-LCPs of the members at sorted `positions` (the subset's own trie order)."""
        positions = np.asarray(positions, dtype=np.int64)
        lcp = np.zeros(len(positions), dtype=np.int64)
        if len(positions) > 1:
            lcp[1:] = np.minimum.reduceat(self.lcp[: positions[-1] + 1], positions[:-1] + 1)
        return self.length[positions], lcp

    def features(self, positions: Sequence[int] | np.ndarray) -> np.ndarray:
        """FEATURES of the prefix tree of the sequences at sorted `positions`, as if built on their own."""
        length, lcp = self.subset(positions)
        return run_features(length, lcp)


def run_features(length: np.ndarray, lcp: np.ndarray) -> np.ndarray:
    """FEATURES of the tree of a trie-ordered run; lcp[0] is ignored (the first member adds all its tokens)."""
    if len(length) == 0:
        return np.zeros(len(FEATURES))
    lcp = lcp.copy()
    lcp[0] = 0
    prefix_of_next = lcp[1:] == length[:-1]  # such a member ends inside the next one's path: not a leaf
    return np.array(
        [
            1.0,
            float((length - lcp).sum()),
            float((_triangle(length) - _triangle(lcp)).sum()),
            float(len(length) - prefix_of_next.sum()),
            float(len(length)),
            float(length.sum()),
        ]
    )
