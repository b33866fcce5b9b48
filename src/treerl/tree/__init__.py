"""Prefix trees: a batch of token sequences merged into a compressed trie.

Steps 2 and 5 (docs/architecture.md): the sequences, and the tree an engine builds from them.
"""

from treerl.tree.prefix_tree import ROOT, Node, PrefixTree, TreeStats
from treerl.tree.sequence import BatchError, ImageSpan, TokenSequence, validate_sequences

__all__ = ["ROOT", "BatchError", "ImageSpan", "Node", "PrefixTree", "TokenSequence", "TreeStats", "validate_sequences"]
