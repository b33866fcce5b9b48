"""The update on one batch, shared by RL and SFT: `trainer.ppo_epochs` passes, `trainer.minibatches` steps each.

Steps 4 to 6 (docs/architecture.md), repeated: epochs x minibatches on one batch.

A minibatch holds whole groups (the samples of one prompt, the paths of one conversation), so a
tree is never cut between two optimizer steps; the order of the groups is shuffled with a
generator seeded by (trainer.seed, step), so resuming at a step repeats it exactly.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from treerl.engine import LossFn
from treerl.trainer.core.learner import Learner
from treerl.trainer.core.metrics import Mean
from treerl.trainer.core.run import Run
from treerl.tree import TokenSequence


def update(run: Run, sequences: list[TokenSequence], step: int, loss_for: Callable[[list[TokenSequence]], LossFn],
           learner: Learner | None = None) -> dict[str, float]:
    """Optimizer steps on the batch; `loss_for(minibatch)` builds the loss normalised over that (global) minibatch.

    `learner` (default `run.actor`, the policy) takes the steps: `run.critic` trains the critic over the same
    minibatches.
    """
    learner = learner or run.actor
    trainer = run.config.trainer
    generator = torch.Generator().manual_seed(trainer.seed * 1_000_003 + step)
    mean = Mean()
    updates = 0
    started = time.perf_counter()
    for _ in range(trainer.ppo_epochs):
        for part in minibatch_indices(sequences, trainer.minibatches, generator):
            minibatch = [sequences[i] for i in part]
            mean.add(learner.update(minibatch, loss_for(minibatch), step))
            updates += 1
    seconds = time.perf_counter() - started
    metrics = mean.result()
    metrics["perf/train_tokens_per_second"] = metrics.pop("perf/flat_tokens") * updates / seconds
    metrics["perf/model_tokens_per_second"] = metrics.pop("perf/model_tokens") * updates / seconds
    metrics["train/updates"] = updates
    metrics["time/update"] = seconds
    return metrics


def minibatch_indices(sequences: Sequence[TokenSequence], count: int, generator: torch.Generator) -> list[list[int]]:
    """Whole groups (`info["group"]`) in a seeded random order, cut into `count` parts of about equal flat tokens.

    With fewer groups than `count`, one group per part; one part is the whole batch in its order.
    """
    if count == 1:
        return [list(range(len(sequences)))]
    groups: dict[object, list[int]] = {}
    for i, seq in enumerate(sequences):
        groups.setdefault(seq.info.get("group", ("sequence", i)), []).append(i)
    members = list(groups.values())
    members = [members[j] for j in torch.randperm(len(members), generator=generator).tolist()]
    count = min(count, len(members))
    sizes = [sum(len(sequences[i]) for i in g) for g in members]
    total, done = sum(sizes), 0
    parts: list[list[int]] = [[] for _ in range(count)]
    for group, size in zip(members, sizes):
        parts[min(count - 1, int((done + size / 2) / total * count))].extend(group)
        done += size
    return [p for p in parts if p]
