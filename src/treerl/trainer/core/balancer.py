"""How a run splits each global minibatch over its ranks, priced by a cost model it learns as it trains.

Step 4 (docs/architecture.md): the run's balancer, and its cost model refitted from measured times.

    balancer = Balancer(env, config.trainer, loop_state)
    assignment = balancer.assign(minibatch)      # the same on every rank
    balancer.record(measured)                    # (tree features, seconds) of this rank's micro-batches
    metrics |= balancer.metrics(assignment, minibatch)

The measured samples live in the run's `LoopState` (saved with every checkpoint), so a resumed run
prices batches as the run it continues did.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch.distributed as dist

from treerl.distributed import Assignment, ContextSplit, CostModel, DistEnv, Mesh, balance, evaluate, split_over_context
from treerl.trainer.core.config import TrainerConfig
from treerl.trainer.core.loop_state import LoopState
from treerl.tree import TokenSequence

COST_WINDOW = 256  # most recent measured micro-batches the cost model is fitted on
COST_MIN_SAMPLES = 8


@dataclass
class Balancer:
    """treerl.distributed.balance under a cost model refitted from the measured micro-batch times of every rank."""

    env: DistEnv
    trainer: TrainerConfig  # micro_batch_tokens, fit_cost_model
    loop_state: LoopState  # the run's checkpointed state: the measured samples are its cost_samples
    cost: CostModel = field(default_factory=CostModel)
    mesh: Mesh | None = None  # data parallel x context parallel (trainer.context_parallel); None: all data parallel

    @property
    def data_rank(self) -> int:
        """This rank's data-parallel group: the micro-batches it trains (with its context-parallel peers)."""
        return self.mesh.data_rank if self.mesh is not None else self.env.rank

    @property
    def data_size(self) -> int:
        return self.mesh.data_size if self.mesh is not None else self.env.world_size

    @property
    def context_rank(self) -> int:
        """This rank's place in its context-parallel group (0: it reports the group's measurements and metrics)."""
        return self.mesh.context.rank if self.mesh is not None and self.mesh.context is not None else 0

    def assign(self, sequences: list[TokenSequence]) -> Assignment:
        """The same balanced assignment on every rank (a deterministic function of the batch and cost model), over
        the data-parallel groups."""
        return balance(sequences, self.data_size, self.trainer.micro_batch_tokens, cost=self.cost)

    def context_split(self, assignment: Assignment, sequences: list[TokenSequence], group: int | None = None
                      ) -> ContextSplit | None:
        """Under context parallelism, which of a group's sequences (default: this rank's group) its ranks split and
        which each trains alone (`trainer.context_parallel_min_tokens`; treerl.distributed.split_over_context); None
        without."""
        if self.mesh is None or self.mesh.context is None:
            return None
        group = self.data_rank if group is None else group
        if self.trainer.context_parallel_min_tokens == 0:  # every sequence split: the group's micro-batches as they are
            return ContextSplit(assignment.micro_batches(group), [[] for _ in range(self.mesh.context.size)])
        return split_over_context(sequences, assignment.sequences(group), self.mesh.context.size,
                                  self.trainer.context_parallel_min_tokens, self.trainer.micro_batch_tokens, self.cost)

    def record(self, measured: list[tuple[np.ndarray, float]]) -> None:
        """Keep every rank's measured (tree features, seconds) and refit the cost model the same way on each rank."""
        if self.env.world_size == 1 or not self.trainer.fit_cost_model:
            return
        gathered: list[list] = [[] for _ in range(self.env.world_size)]
        dist.all_gather_object(gathered, measured)
        samples = deque(self.loop_state.cost_samples, maxlen=COST_WINDOW)
        samples.extend((features.tolist(), float(seconds))  # plain lists: a checkpoint holds no numpy objects
                       for rank_samples in gathered for features, seconds in rank_samples)
        self.loop_state.cost_samples = list(samples)
        self.fit()

    def fit(self) -> None:
        """Refit the cost model on the kept samples (also after a resume), once there are enough of them."""
        samples = self.loop_state.cost_samples
        if len(samples) >= COST_MIN_SAMPLES:
            fitted = CostModel.from_features([f for f, _ in samples], [s for _, s in samples])
            if any(w > 0 for w in fitted.weights):  # all zero would price every plan alike
                self.cost = fitted

    def metrics(self, assignment: Assignment, minibatch: list[TokenSequence]) -> dict[str, float]:
        """The `dist/` metrics of an assignment: how even and how shared the split over data-parallel groups was
        (with several), and under context parallelism the share of sequences whose calls the ranks split."""
        metrics = {}
        if self.mesh is not None and self.mesh.context is not None:
            splits = [self.context_split(assignment, minibatch, group) for group in range(self.data_size)]
            metrics["dist/context_split"] = sum(len(i) for s in splits for i in s.together) / len(minibatch)
        if self.data_size == 1:
            return metrics
        stats = evaluate(assignment, minibatch, self.cost)
        return metrics | {
            "dist/imbalance": stats.imbalance,  # estimated max / mean cost over ranks
            "dist/compression_kept": stats.compression_kept,  # 1: no shared prefix computed twice
            "dist/micro_batches": stats.micro_batches,
        }
