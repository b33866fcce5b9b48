"""One optimizer step on a global minibatch, for each model a run trains (the policy, and PPO's critic).

Steps 4 to 6 (docs/architecture.md) for one model: split, forward + backward per micro-batch, optimizer step.

    metrics = run.actor.update(minibatch, loss_fn, step)     # the policy; run.critic.update(...) the critic

Under torchrun every rank holds the same global batch. `update` balances it over the ranks
(treerl.distributed.balance: trees kept together, micro-batches under `trainer.micro_batch_tokens`),
runs this rank's micro-batches inside one `gradient_step` (a single gradient sync, SUM over
ranks), clips and steps. The loss must be normalised by the GLOBAL minibatch
(`LossNormalizer.from_sequences(minibatch)`), so the summed gradient equals the one-process one.
A non-finite loss or gradient norm never reaches the weights (`trainer.nonfinite`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from dataclasses import dataclass

import numpy as np
import torch
from transformers import PreTrainedModel

from treerl.distributed import Assignment, DistributedModel, tree_features
from treerl.engine import Engine, LossFn
from treerl.engine.autocast import AutocastEngine
from treerl.engine.routing import RoutingReplayEngine
from treerl.errors import TrainingStopped
from treerl.trainer.core.balancer import Balancer
from treerl.trainer.core.checkpoint import Trainable
from treerl.trainer.core.loop_state import LoopState
from treerl.trainer.core.metrics import sum_over_ranks
from treerl.tree import TokenSequence

log = logging.getLogger("treerl.trainer")


@dataclass
class NonfiniteGuard:
    """`trainer.nonfinite` for every learner of a run: stop before the optimizer step, or skip it and count it."""

    action: str  # "stop" | "skip"
    loop_state: LoopState  # the run's checkpointed state: it counts the skipped steps (nonfinite_skipped)

    def skip(self, learner: str, metrics: dict[str, float], step: int) -> None:
        """A NaN/inf loss or gradient norm: stop (TrainingStopped), or count the skipped optimizer step."""
        what = f"{learner} loss {metrics['train/loss']}, gradient norm {metrics['train/grad_norm']} at step {step}"
        if self.action == "stop":
            raise TrainingStopped(
                f"non-finite {what}: stopped before the optimizer step, so no weight changed and nothing was "
                "written (the newest checkpoint is the last good state). Look for NaN/inf in the model's weights "
                "and the rewards, lower trainer.lr or an algo coefficient, or set trainer.nonfinite=skip")
        self.loop_state.nonfinite_skipped += 1
        log.warning("non-finite %s: optimizer step skipped (trainer.nonfinite=skip; %d so far)", what,
                    self.loop_state.nonfinite_skipped)


def without_context_parallel(engine: Engine) -> Engine:
    """`engine` (a DfsEngine, or one under autocast) with its calls no longer split over context-parallel ranks."""
    if isinstance(engine, (AutocastEngine, RoutingReplayEngine)):
        return dataclasses.replace(engine, engine=without_context_parallel(engine.engine))
    return dataclasses.replace(engine, context_parallel=None)


@dataclass
class Learner:
    """One trained model on this rank: data-parallel wrapper, AdamW, LR schedule, engine, and its optimizer step."""

    name: str  # "policy" or "critic", as messages name it
    dp: DistributedModel
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    engine: Engine
    balancer: Balancer
    guard: NonfiniteGuard
    max_grad_norm: float | None  # trainer.max_grad_norm; None: no clipping
    records_costs: bool = False  # the balancer's cost model prices the policy's engine calls: only they refit it

    @property
    def model(self) -> PreTrainedModel:
        """The transformers model itself (what engines and the sampler call)."""
        return self.dp.model

    def trainable(self) -> Trainable:
        """What a checkpoint saves and restores of this learner."""
        return Trainable(self.model, self.optimizer, self.scheduler)

    def update(self, minibatch: list[TokenSequence], loss_fn: LossFn, step: int) -> dict[str, float]:
        """One optimizer step on a global minibatch at training step `step`; its metrics, the same on every rank."""
        assignment = self.balancer.assign(minibatch)
        balance = self.balancer.metrics(assignment, minibatch)  # before `record` refits the cost model
        local, measured = self._forward_backward(minibatch, loss_fn, assignment)
        if self.records_costs:
            self.balancer.record(measured)
        metrics = sum_over_ranks(local) | balance
        metrics["train/grad_norm"] = self.clip_gradients()
        metrics["train/lr"] = self.optimizer.param_groups[0]["lr"]
        # The loss is summed over ranks and the norm is of the synced gradients: every rank sees the same numbers,
        # so every rank takes the same branch.
        if not (math.isfinite(metrics["train/loss"]) and math.isfinite(metrics["train/grad_norm"])):
            self.optimizer.zero_grad(set_to_none=True)
            self.guard.skip(self.name, metrics, step)
            metrics["train/nonfinite_skipped"] = 1.0
            return metrics
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        metrics["train/nonfinite_skipped"] = 0.0
        return metrics

    def _forward_backward(self, minibatch: list[TokenSequence], loss_fn: LossFn, assignment: Assignment,
                          ) -> tuple[dict[str, float], list[tuple[np.ndarray, float]]]:
        """This rank's micro-batches under one gradient sync: summed stats, and (tree features, seconds) of each.

        Under context parallelism the group's ranks first run the micro-batches they split (reported by the group's
        rank 0, the same calls on every rank; timed as one rank's work, R x the seconds), then each its own alone."""
        local: dict[str, float] = {"train/loss": 0.0, "perf/flat_tokens": 0.0, "perf/model_tokens": 0.0}
        measured = []
        split = self.balancer.context_split(assignment, minibatch)
        # (engine, micro-batch, what one rank's seconds of it count as in the cost model; 0: another rank reports it)
        if split is None:
            runs = [(self.engine, batch, 1) for batch in assignment.micro_batches(self.balancer.data_rank)]
        else:
            ranks, reports = len(split.alone), self.balancer.context_rank == 0
            runs = [(self.engine, batch, ranks if reports else 0) for batch in split.together]
            runs += [(self.engine_alone, batch, 1) for batch in split.alone[self.balancer.context_rank]]
        # every rank holds the whole minibatch, so all agree whether a call shows images
        with self.dp.gradient_step(images=any(s.images for s in minibatch)) as model:
            for engine, micro_batch, scale in runs:
                part = [minibatch[i] for i in micro_batch]
                stats = engine.forward_backward(model, part, loss_fn)
                if not scale:  # a context-parallel peer: its group's rank 0 reports these calls
                    continue
                local["train/loss"] += stats.loss
                local["perf/flat_tokens"] += stats.flat_tokens
                local["perf/model_tokens"] += stats.model_tokens
                for key, value in stats.metrics.items():
                    local[f"train/{key}"] = local.get(f"train/{key}", 0.0) + value
                measured.append((tree_features(part), stats.seconds * scale))
        return local, measured

    @functools.cached_property
    def engine_alone(self) -> Engine:
        """The engine for the micro-batches a context-parallel rank trains alone (its calls not split)."""
        return without_context_parallel(self.engine)

    def clip_gradients(self) -> float:
        """The global gradient norm before clipping (gradients are already summed over ranks)."""
        parameters = [p for p in self.dp.parameters() if p.grad is not None]
        if not parameters:
            return 0.0
        max_norm = self.max_grad_norm if self.max_grad_norm is not None else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm)
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
