"""The trie: every sequence is recoverable, U is the number of distinct prefixes, chunks cover nodes."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from treerl.tree import ROOT, PrefixTree, TokenSequence

token_lists = st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=12), min_size=1, max_size=10)


def _seqs(lists: list[list[int]]) -> list[TokenSequence]:
    return [TokenSequence(torch.tensor(t)) for t in lists]


def _rebuild(tree: PrefixTree, s: int) -> list[int]:
    n = len(tree.sequences[s])
    return torch.cat([tree.nodes[i].tokens for i in tree.path(s)])[:n].tolist()


def _check_tree(tree: PrefixTree, lists: list[list[int]]) -> None:
    for s, tokens in enumerate(lists):
        assert _rebuild(tree, s) == tokens
        end = tree.nodes[tree.end_node[s]]
        assert end.start < len(tokens) <= end.end
    for node in tree.nodes[1:]:
        parent = tree.nodes[node.parent]
        assert node.start == parent.end and node.length == len(node.tokens) > 0
        assert node.index in parent.children
    for node in tree.nodes:
        firsts = [tree.nodes[c].tokens[0].item() for c in node.children]
        assert len(firsts) == len(set(firsts)), "siblings must start with different tokens"


@settings(max_examples=200, deadline=None)
@given(token_lists)
def test_tree_holds_every_sequence_and_each_prefix_once(lists):
    tree = PrefixTree.build(_seqs(lists))
    _check_tree(tree, lists)
    stats = tree.stats()
    distinct_prefixes = {tuple(t[:k]) for t in lists for k in range(1, len(t) + 1)}
    assert stats.unique_tokens == len(distinct_prefixes)
    assert stats.flat_tokens == sum(map(len, lists))
    # compressed: a node with a single child exists only where a sequence ends inside it... never:
    # chains are merged, so every node other than the root has 0 or >= 2 children.
    assert all(len(n.children) != 1 for n in tree.nodes[1:])


@settings(max_examples=100, deadline=None)
@given(token_lists, st.integers(1, 5))
def test_chunked_tree_splits_long_nodes_and_keeps_everything(lists, chunk):
    tree = PrefixTree.build(_seqs(lists)).chunked(chunk)
    _check_tree(tree, lists)
    assert all(n.length <= chunk for n in tree.nodes[1:])
    assert tree.stats().unique_tokens == PrefixTree.build(_seqs(lists)).stats().unique_tokens


@settings(max_examples=50, deadline=None)
@given(token_lists)
def test_dfs_enters_parents_before_children_and_leaves_after(lists):
    tree = PrefixTree.build(_seqs(lists))
    entered, exited = {ROOT}, set()
    for entering, node in tree.dfs():
        if entering:
            assert node.parent in entered and node.parent not in exited
            entered.add(node.index)
        else:
            assert all(c in exited for c in node.children)
            exited.add(node.index)
    assert exited == set(range(1, len(tree.nodes)))


def test_degenerate_batches():
    one = PrefixTree.build(_seqs([[5, 6, 7]]))
    assert one.stats().nodes == 1 and one.stats().compression == 1.0
    dup = PrefixTree.build(_seqs([[1, 2, 3], [1, 2, 3], [1, 2, 3]]))
    assert dup.stats().unique_tokens == 3 and dup.nodes[1].ends == [0, 1, 2]
    prefix = PrefixTree.build(_seqs([[1, 2, 3, 4, 5], [1, 2]]))
    assert prefix.stats().nodes == 1 and prefix.nodes[1].ends == [0, 1]  # ends inside the node
    disjoint = PrefixTree.build(_seqs([[1, 2], [3, 4], [5]]))
    assert disjoint.stats().unique_tokens == 5 and disjoint.stats().leaves == 3
    fork = PrefixTree.build(_seqs([[1, 2, 3], [1, 2, 4], [1, 5]]))
    stats = fork.stats()
    assert (stats.nodes, stats.leaves, stats.unique_tokens, stats.max_branching) == (5, 3, 5, 2)
    assert round(stats.compression, 4) == round(8 / 5, 4)
