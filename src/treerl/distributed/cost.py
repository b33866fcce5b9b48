"""How long a forward_backward over one prefix tree takes, estimated from the tree's shape.

Step 4 (docs/architecture.md): the price the balancer puts on a micro-batch.

A DFS step costs: a constant per call, the linear layers on every unique token, attention of each
unique token over its prefix (the "attention" feature: sum over unique tokens of position + 1, i.e.
sum over nodes of length x (depth + length/2)), per-leaf work (a root-to-leaf walk, node launches),
per-sequence loss evaluation and per-flat-token log-prob gathering. The cost is a non-negative
combination of these features, fitted by least squares from measured (tree, seconds) pairs; until
it is fitted it is the unique-token count, which is what prefix sharing saves.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import nnls

from treerl.distributed.order import FEATURES, TrieOrder
from treerl.tree import PrefixTree, TokenSequence

UNFITTED = tuple(1.0 if name == "unique_tokens" else 0.0 for name in FEATURES)


def tree_features(batch: PrefixTree | Sequence[TokenSequence]) -> np.ndarray:
    """FEATURES of one micro-batch's prefix tree (see treerl.distributed.order.FEATURES)."""
    sequences = batch.sequences if isinstance(batch, PrefixTree) else batch
    order = TrieOrder(sequences)
    return order.features(np.arange(len(order)))


@dataclass(frozen=True)
class CostModel:
    """Estimated seconds of one DFS forward_backward: `weights . FEATURES(tree)`, weights >= 0."""

    weights: tuple[float, ...] = UNFITTED

    def __post_init__(self) -> None:
        if len(self.weights) != len(FEATURES):
            raise ValueError(f"CostModel needs {len(FEATURES)} weights ({', '.join(FEATURES)}), got {len(self.weights)}")
        if any(not np.isfinite(w) or w < 0 for w in self.weights):
            raise ValueError(f"CostModel weights must be finite and >= 0, got {self.weights}")

    @property
    def fitted(self) -> bool:
        return self.weights != UNFITTED

    @property
    def vector(self) -> np.ndarray:
        return np.asarray(self.weights, dtype=np.float64)

    def __call__(self, batch: PrefixTree | Sequence[TokenSequence]) -> float:
        """Estimated cost of one forward_backward over `batch`."""
        return float(self.vector @ tree_features(batch))

    @classmethod
    def fit(cls, samples: Iterable[tuple[PrefixTree | Sequence[TokenSequence], float]]) -> CostModel:
        """Non-negative least squares on measured (micro-batch, seconds) pairs, e.g. a trainer's step timings.

        Columns are scaled to unit norm first so that features of very different magnitudes
        (calls ~ 1, attention ~ 1e8) are weighed alike; a feature that never varies is left at 0.
        """
        rows, seconds = [], []
        for batch, t in samples:
            rows.append(tree_features(batch))
            seconds.append(float(t))
        return cls.from_features(rows, seconds)

    @classmethod
    def from_features(cls, rows: Sequence[np.ndarray], seconds: Sequence[float]) -> CostModel:
        """`fit` on precomputed `tree_features` rows (what a trainer keeps of its measured micro-batches)."""
        for t in seconds:
            if not np.isfinite(t) or t < 0:
                raise ValueError(f"CostModel.fit: measured seconds must be finite and >= 0, got {t}")
        if len(rows) == 0:
            raise ValueError("CostModel.fit needs at least one (tree, seconds) sample")
        x, y = np.stack(rows), np.asarray(seconds, dtype=np.float64)
        scale = np.linalg.norm(x, axis=0)
        scale[scale == 0] = 1.0
        w, _ = nnls(x / scale, y)
        return cls(tuple(float(v) for v in w / scale))

    def describe(self) -> str:
        """One line naming each non-zero weight."""
        parts = [f"{name}={w:.3g}" for name, w in zip(FEATURES, self.weights) if w > 0]
        return ("fitted: " if self.fitted else "unfitted: ") + ", ".join(parts or ["all zero"])
