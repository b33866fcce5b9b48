"""Engines: one interface, the same gradients; they differ only in what they compute twice.

Step 5 (docs/architecture.md): forward + backward over a micro-batch.
"""

from treerl.engine.autocast import AutocastEngine, autocast
from treerl.engine.base import Engine, LossFn, SequenceView, StepStats
from treerl.engine.dfs import DfsEngine
from treerl.engine.flat import FlatEngine
from treerl.engine.head import PolicyHead, ValueHead
from treerl.engine.packed import PackedEngine

__all__ = ["AutocastEngine", "DfsEngine", "Engine", "FlatEngine", "LossFn", "PackedEngine", "PolicyHead",
           "SequenceView", "StepStats", "ValueHead", "autocast"]
