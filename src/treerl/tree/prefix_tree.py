"""The compressed prefix tree (trie) of a batch: each shared prefix stored once.

Step 5 (docs/architecture.md): the tree an engine builds from a micro-batch.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from treerl.tree.sequence import TokenSequence

ROOT = 0


@dataclass
class Node:
    """A run of tokens with one parent: positions [start, end) of every sequence that passes through it.

    Node 0 is a virtual root with no tokens; the first tokens of all sequences hang below it.
    `ends` lists the sequences whose last token lies in this node (a sequence may end inside a node,
    at its end, or at a leaf).
    """

    index: int
    parent: int
    start: int
    end: int
    tokens: torch.Tensor
    children: list[int] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class TreeStats:
    """What prefix sharing buys on one batch."""

    sequences: int
    flat_tokens: int  # T: sum of sequence lengths
    unique_tokens: int  # U: sum of node lengths
    nodes: int
    leaves: int
    max_depth: int  # longest sequence, in tokens
    max_path_nodes: int  # most nodes on one root-to-leaf path
    mean_branching: float  # children per internal node
    max_branching: int

    @property
    def compression(self) -> float:
        """T / U, the token compression ratio."""
        return self.flat_tokens / max(self.unique_tokens, 1)


class PrefixTree:
    """A batch of sequences merged into a compressed trie, visited depth-first by the engines."""

    def __init__(self, sequences: Sequence[TokenSequence], nodes: list[Node]) -> None:
        self.sequences = list(sequences)
        self.nodes = nodes
        self.end_node = [0] * len(self.sequences)
        for node in nodes:
            for s in node.ends:
                self.end_node[s] = node.index

    # ---------------------------------------------------------------- building
    @classmethod
    def build(cls, sequences: Sequence[TokenSequence]) -> PrefixTree:
        """Sort the sequences, take the longest common prefix of neighbours, and build the trie in one pass.

        Sequences are compared by their `merge_keys`: tokens, and an image only where it is the same image."""
        keys = [s.merge_keys for s in sequences]
        key_lists = [k.tolist() for k in keys]
        order = sorted(range(len(sequences)), key=key_lists.__getitem__)
        raw = _RawTree()
        path = [ROOT]  # nodes on the previous sequence's path
        previous: torch.Tensor | None = None
        for s in order:
            tokens = keys[s]
            shared = 0 if previous is None else _common_prefix(previous, tokens)
            while path[-1] != ROOT and raw.start[path[-1]] >= shared:
                path.pop()
            top = path[-1]
            if top != ROOT and raw.end[top] > shared:
                raw.split(top, shared, sequences)
            if len(tokens) > shared:
                path.append(raw.add(top, shared, len(tokens), s))
            raw.ends[path[-1]].append(s)
            previous = tokens
        raw.merge_chains()
        return cls(sequences, raw.finish(sequences))

    def chunked(self, chunk_tokens: int, whole_images: bool = False) -> PrefixTree:
        """The same tree with every node longer than `chunk_tokens` split into a chain of pieces; `whole_images`: never
        inside an image (a piece then ends before it, or after it when it starts the piece), for a model whose image
        tokens see each other both ways."""
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        if all(n.length <= chunk_tokens for n in self.nodes):
            return self
        raw = _RawTree()
        last_piece = {ROOT: ROOT}
        for node in self.nodes[1:]:  # preorder: a parent's pieces exist before its children's
            parent = last_piece[node.parent]
            source = self.sequences_through(node.index)
            images = [(i.start, i.end) for i in self.sequences[source].images] if whole_images else []
            for lo, hi in _pieces(node.start, node.end, chunk_tokens, images):
                parent = raw.add(parent, lo, hi, source)
                raw.ends[parent] = [s for s in node.ends if lo < len(self.sequences[s]) <= hi]
            last_piece[node.index] = parent
        return PrefixTree(self.sequences, raw.finish(self.sequences))

    # ---------------------------------------------------------------- queries
    def sequences_through(self, index: int) -> int:
        """One sequence that passes through node `index` (its tokens define the node's)."""
        node = self.nodes[index]
        while node.children:
            node = self.nodes[node.children[0]]
        return max(node.ends, key=lambda s: len(self.sequences[s]))  # a leaf's longest sequence ends at its end

    def path(self, seq: int) -> list[int]:
        """Nodes from the top of the tree down to the node where sequence `seq` ends."""
        out = []
        index = self.end_node[seq]
        while index != ROOT:
            out.append(index)
            index = self.nodes[index].parent
        return out[::-1]

    def dfs(self) -> Iterator[tuple[bool, Node]]:
        """Depth-first events: (True, node) on the way down, (False, node) on the way back up."""
        stack: list[tuple[bool, int]] = [(True, c) for c in reversed(self.nodes[ROOT].children)]
        while stack:
            entering, index = stack.pop()
            node = self.nodes[index]
            if entering:
                stack.append((False, index))
                stack.extend((True, c) for c in reversed(node.children))
            yield entering, node

    def stats(self) -> TreeStats:
        """Flat vs unique tokens, shape of the tree."""
        nodes = self.nodes[1:]
        internal = [len(n.children) for n in nodes if n.children]
        path_nodes = [0] * len(self.nodes)
        for n in nodes:
            path_nodes[n.index] = path_nodes[n.parent] + 1
        return TreeStats(
            sequences=len(self.sequences),
            flat_tokens=sum(len(s) for s in self.sequences),
            unique_tokens=sum(n.length for n in nodes),
            nodes=len(nodes),
            leaves=sum(1 for n in nodes if not n.children),
            max_depth=max(n.end for n in nodes),
            max_path_nodes=max(path_nodes),
            mean_branching=sum(internal) / len(internal) if internal else 0.0,
            max_branching=max(internal, default=0),
        )


def _pieces(start: int, end: int, size: int, whole: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """[start, end) cut into pieces of at most `size`, except that no cut falls inside a `whole` span."""
    pieces, lo = [], start
    while lo < end:
        hi = min(lo + size, end)
        for a, b in whole:
            if a < hi < b:
                hi = a if a > lo else b
        pieces.append((lo, hi))
        lo = hi
    return pieces


def _common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    """Length of the longest common prefix of two token tensors."""
    m = min(len(a), len(b))
    differ = (a[:m] != b[:m]).nonzero()
    return int(differ[0]) if len(differ) else m


class _RawTree:
    """Mutable parallel lists used while building; `finish` turns them into Nodes in preorder."""

    def __init__(self) -> None:
        self.start, self.end, self.source, self.parent = [0], [0], [-1], [-1]
        self.children: list[list[int]] = [[]]
        self.ends: list[list[int]] = [[]]

    def add(self, parent: int, start: int, end: int, source: int) -> int:
        self.start.append(start)
        self.end.append(end)
        self.source.append(source)
        self.parent.append(parent)
        self.children.append([])
        self.ends.append([])
        index = len(self.start) - 1
        self.children[parent].append(index)
        return index

    def split(self, index: int, at: int, sequences: Sequence[TokenSequence]) -> None:
        """Cut node `index` at absolute position `at`; the lower part keeps its children."""
        lower = len(self.start)
        self.start.append(at)
        self.end.append(self.end[index])
        self.source.append(self.source[index])
        self.parent.append(index)
        self.children.append(self.children[index])
        self.ends.append([s for s in self.ends[index] if len(sequences[s]) > at])
        for c in self.children[lower]:
            self.parent[c] = lower
        self.end[index] = at
        self.children[index] = [lower]
        self.ends[index] = [s for s in self.ends[index] if len(sequences[s]) <= at]

    def merge_chains(self) -> None:
        """Fold every node with exactly one child into that child: nodes become maximal branch-free runs."""
        stack = list(self.children[ROOT])
        while stack:
            x = stack.pop()
            while len(self.children[x]) == 1:
                c = self.children[x][0]
                self.end[x] = self.end[c]
                self.source[x] = self.source[c]
                self.ends[x] += self.ends[c]
                self.children[x] = self.children[c]
                for g in self.children[x]:
                    self.parent[g] = x
            stack.extend(self.children[x])

    def finish(self, sequences: Sequence[TokenSequence]) -> list[Node]:
        order: list[int] = []
        stack = [ROOT]
        while stack:
            x = stack.pop()
            order.append(x)
            stack.extend(reversed(self.children[x]))
        new_index = {old: new for new, old in enumerate(order)}
        nodes = []
        for old in order:
            src = self.source[old]
            tokens = sequences[src].tokens[self.start[old] : self.end[old]] if src >= 0 else torch.empty(0, dtype=torch.long)
            nodes.append(
                Node(
                    index=new_index[old],
                    parent=new_index.get(self.parent[old], -1),
                    start=self.start[old],
                    end=self.end[old],
                    tokens=tokens,
                    children=[new_index[c] for c in self.children[old]],
                    ends=sorted(self.ends[old]),
                )
            )
        return nodes
