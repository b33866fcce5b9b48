"""Data parallelism: load-balanced assignment of prefix trees to ranks, and one gradient sync per step."""

from treerl.dist.assign import Assignment, BalanceStats, balance, evaluate, first_fit, lpt
from treerl.dist.cost import CostModel, tree_features
from treerl.dist.order import FEATURES, TrieOrder
from treerl.dist.parallel import DataParallel, DistEnv, global_sum, init_distributed

__all__ = [
    "FEATURES", "Assignment", "BalanceStats", "CostModel", "DataParallel", "DistEnv", "TrieOrder",
    "balance", "evaluate", "first_fit", "global_sum", "init_distributed", "lpt", "tree_features",
]
