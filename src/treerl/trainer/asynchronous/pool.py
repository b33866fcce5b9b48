"""The trainer's side of asynchronous RL: rollout workers, admission, staleness, faults, and counters that add up.

Step 1 (docs/architecture.md), the trainer's side: which samples reach step 2, and when.

    pool = RolloutPool(config, task, weights, version=step)   # spawns trainer.rollout_workers processes
    batch = pool.next_batch(version)     # B = rollout.prompts_per_step groups, none older than max_staleness
    ...train, then weights.publish(policy, version + 1)...
    pool.close()

The unit of work is a group: one prompt with its `group_size` samples, one multi-turn episode, or
one agent task with its `group_size` episodes.
Groups come from the same prompt stream as the synchronous loop (prompt i of step s is stream
position s * B + i), in chunks of `trainer.worker_prompts` per worker call.

Staleness. The trainer's policy version v is the number of optimizer steps taken. A group's lag
when it would be trained is v minus the version of its OLDEST generated token (AReaL's "head
off-policyness"; with on_update=interrupt a group may hold newer tokens too). A batch takes the
ready groups with the oldest tokens first; a ready group whose lag exceeds eta = max_staleness is
dropped (counted `dropped_stale`), never trained.

Admission (AReaL's rule). Work is handed out only while in_flight + ready < (eta + 1) * B, checked
when the trainer asks for batch v, after it has published the weights of version v; a worker
samples a chunk with the newest weights it finds, so every group starts at v or later. Had the
groups finished in order, each would be trained within eta versions, so workers do not produce
what would only be dropped. eta = 0 admits exactly the B groups of step v, sampled with the
weights of v, and waits for all of them: the synchronous loop.

Faults (`treerl.trainer.asynchronous.worker_set` says when a worker has failed). A failed worker
is restarted in its slot: results it had sent are kept, and its unfinished groups are counted lost
and re-queued ahead of new prompts; more than `trainer.max_worker_restarts` restarts stop the run.

Counters (groups), checked after every batch and at the end:
    admitted = produced + lost_to_crash + in_flight
    produced = trained + dropped_stale + dropped_failed + pending
where dropped_failed are groups whose every sample was dropped (reward function or environment
failures; each sample is also counted in rollout/dropped_*) and requeued == lost_to_crash.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from treerl.rollout import RolloutBatch, RolloutStats
from treerl.rollout.tasks import AgentTask, SingleTurnTask
from treerl.rollout.tasks.base import Prompt
from treerl.rollout.workflows.stats import REPORTED_SAMPLES
from treerl.trainer.asynchronous.weights import SharedWeights
from treerl.trainer.asynchronous.worker_set import Finished, WorkerSet
from treerl.trainer.asynchronous.workers import Job
from treerl.trainer.core.config import Config
from treerl.tree import TokenSequence

log = logging.getLogger("treerl.trainer")

POLL_SECONDS = 0.05  # how long the trainer waits for a worker message before it looks at the workers again


@dataclass
class Counters:
    """What happened to every group handed to the workers (see the module docstring for the identities)."""

    admitted: int = 0  # groups handed to a worker (a re-queued prompt again)
    produced: int = 0  # groups whose samples came back
    trained: int = 0  # groups in a trained batch
    dropped_stale: int = 0  # groups that would have been more than max_staleness versions old
    dropped_failed: int = 0  # groups whose every sample was dropped (the samples are in rollout/dropped_*)
    lost_to_crash: int = 0  # groups in flight on a worker that crashed or hung
    requeued: int = 0  # lost groups whose prompt was queued again
    restarts: int = 0  # workers restarted
    in_flight: int = 0  # handed out, not yet back
    pending: int = 0  # back, not yet trained or dropped

    def check(self) -> None:
        """The identities every run keeps; a violation is a bug in the pool, never a user error."""
        if self.admitted != self.produced + self.lost_to_crash + self.in_flight:
            raise RuntimeError(f"async counters do not add up (admitted != produced + lost + in flight): {self}")
        if self.produced != self.trained + self.dropped_stale + self.dropped_failed + self.pending:
            raise RuntimeError(f"async counters do not add up (produced != trained + dropped + pending): {self}")
        if self.requeued != self.lost_to_crash:
            raise RuntimeError(f"async counters: a lost group was not re-queued: {self}")


@dataclass
class ReadyGroup:
    """A group back from a worker, waiting to be trained."""

    job: Job
    sequences: list[TokenSequence]
    oldest: int  # version of its oldest generated token (the chunk's version if it has no sequence)
    newest: int


@dataclass
class AsyncBatch(RolloutBatch):
    """A training batch from the pool: the sequences of B groups, generation stats, and `async/` metrics."""

    groups: list[ReadyGroup] = field(default_factory=list)
    lags: list[int] = field(default_factory=list)  # per group: trainer version - oldest token version
    metrics: dict[str, float] = field(default_factory=dict)


class RolloutPool:
    """Hands prompt groups to rollout workers, collects them, and assembles batches within the staleness bound."""

    def __init__(self, config: Config, task: SingleTurnTask | AgentTask, weights: SharedWeights | None, version: int):
        trainer = config.trainer
        self.config, self.task = config, task
        self.batch_size = config.rollout.prompts_per_step
        self.max_staleness = trainer.max_staleness
        self.chunk_size = trainer.worker_prompts or math.ceil(self.batch_size / trainer.rollout_workers)
        self.next_index = version * self.batch_size  # the synchronous loop's prompts from this step on
        self.next_job = 0
        self.requeue: deque[tuple[int, Prompt]] = deque()  # (stream index, prompt) of lost groups
        self.ready: list[ReadyGroup] = []
        self.counters = Counters()
        self.stats = RolloutStats()  # what the workers generated since the last batch
        self.trained_indices: set[int] = set()
        self._prompts: tuple[int, list[Prompt]] = (-1, [])
        self.workers = WorkerSet(config, weights)

    # ------------------------------------------------------------------ the trainer's calls
    def next_batch(self, version: int) -> AsyncBatch:
        """The next B groups for the trainer at `version` (its weights already published); waits for them."""
        started = time.perf_counter()
        wait = 0.0
        while True:
            self._collect(self.workers.receive(wait))
            self._restart_failed()
            self._drop_stale(version)
            self._admit(version)  # before taking the batch, so the workers sample the next one meanwhile
            if len(self.ready) >= self.batch_size:
                break
            wait = POLL_SECONDS
        batch = self._take_batch(version)
        batch.metrics["time/rollout"] = time.perf_counter() - started
        return batch

    def close(self) -> None:
        """Stop every worker; their unfinished groups stay counted as in flight. Closing twice is harmless."""
        self.workers.close()
        self._update_gauges()

    # ------------------------------------------------------------------ admission
    def _admit(self, version: int) -> None:
        """Hand out groups while in flight + ready stays under (max_staleness + 1) x B, in chunks."""
        self._update_gauges()
        room = (self.max_staleness + 1) * self.batch_size - self.counters.in_flight - len(self.ready)
        jobs = [self._new_job() for _ in range(max(0, room))]
        for lo in range(0, len(jobs), self.chunk_size):
            chunk = jobs[lo : lo + self.chunk_size]
            self.counters.admitted += len(chunk)
            self.workers.send(chunk, version)

    def _new_job(self) -> Job:
        """A re-queued prompt first, else the next one of the stream."""
        if self.requeue:
            index, prompt = self.requeue.popleft()
        else:
            index, prompt = self.next_index, self._prompt(self.next_index)
            self.next_index += 1
        self.next_job += 1
        return Job(self.next_job - 1, index, prompt)

    def _prompt(self, index: int) -> Prompt:
        """Prompt `index` of the stream: the synchronous loop's prompt index % B of step index // B."""
        step, i = divmod(index, self.batch_size)
        if self._prompts[0] != step:
            self._prompts = (step, self.task.prompts(step, self.batch_size))
        return self._prompts[1][i]

    # ------------------------------------------------------------------ results, staleness, batches
    def _collect(self, finished: Iterable[Finished]) -> None:
        """Finished chunks become ready groups, dated by the versions of their oldest and newest tokens."""
        for chunk in finished:
            for job, result in chunk.results:
                sequences = result.sequences()
                versions = [v for s in sequences for v in s.fields["versions"].tolist() if v >= 0]
                oldest, newest = (min(versions), max(versions)) if versions else (result.version, result.version)
                self.ready.append(ReadyGroup(job, sequences, oldest, newest))
                self.counters.produced += 1
            merge_stats(self.stats, chunk.stats)

    def _drop_stale(self, version: int) -> None:
        """Ready groups more than max_staleness versions old are dropped, never trained."""
        stale = [g for g in self.ready if version - g.oldest > self.max_staleness]
        if stale:
            self.ready = [g for g in self.ready if version - g.oldest <= self.max_staleness]
            self.counters.dropped_stale += len(stale)
            log.info("async: dropped %d groups older than %d versions at version %d", len(stale),
                     self.max_staleness, version)

    def _take_batch(self, version: int) -> AsyncBatch:
        """The B ready groups with the oldest tokens (a group whose samples were all dropped counts, untrained)."""
        self.ready.sort(key=lambda g: (g.oldest, g.job.id))
        groups, self.ready = self.ready[: self.batch_size], self.ready[self.batch_size :]
        sequences = []
        for group in groups:
            if group.job.index in self.trained_indices:
                raise RuntimeError(f"async: prompt {group.job.index} would be trained twice")
            if group.sequences:
                self.trained_indices.add(group.job.index)
                self.counters.trained += 1
                sequences.extend(group.sequences)
            else:
                self.counters.dropped_failed += 1
        stats, self.stats = self.stats, RolloutStats()
        stats.rewards = trajectory_rewards(sequences)  # rollout/reward_* describe the trained batch
        lags = [version - g.oldest for g in groups]
        self._update_gauges()
        self.counters.check()
        metrics = {f"async/{k}": float(v) for k, v in asdict(self.counters).items()}
        metrics.update({
            "async/version": version, "async/lag_mean": statistics.fmean(lags), "async/lag_max": max(lags),
            "async/newest_lag_min": min(version - g.newest for g in groups),
        })
        return AsyncBatch(sequences, stats, groups=groups, lags=lags, metrics=metrics)

    def _update_gauges(self) -> None:
        """The counters that are states, not events: groups in flight and ready groups."""
        self.counters.in_flight = self.workers.in_flight()
        self.counters.pending = len(self.ready)

    # ------------------------------------------------------------------ faults
    def _restart_failed(self) -> None:
        """Restart each failed worker: keep what it had sent, count and re-queue what it held."""
        for worker, reason in self.workers.failed():
            self.workers.wait_for_end(worker)
            self._collect(self.workers.receive(0.0))
            lost = sorted(worker.outstanding.values(), key=lambda job: job.index)
            self.counters.lost_to_crash += len(lost)
            self.requeue.extendleft(reversed([(job.index, job.prompt) for job in lost]))
            self.counters.requeued += len(lost)
            self.counters.restarts += 1
            log.warning("rollout worker %d (pid %s) %s; %d groups re-queued; restarting it", worker.slot,
                        worker.process.pid, reason, len(lost))
            if self.counters.restarts > self.config.trainer.max_worker_restarts:
                raise RuntimeError(f"rollout workers were restarted {self.counters.restarts} times "
                                   f"(trainer.max_worker_restarts={self.config.trainer.max_worker_restarts}); last: "
                                   f"worker {worker.slot} {reason}")
            self.workers.replace(worker)


def trajectory_rewards(sequences: list[TokenSequence]) -> list[float]:
    """One reward per trajectory (a multi-turn trajectory has a sequence per model call, each with its return)."""
    rewards: dict[Any, float] = {}
    for seq in sequences:
        rewards.setdefault(seq.info.get("trajectory", seq.name), seq.info["reward"])
    return list(rewards.values())


def merge_stats(total: RolloutStats, part: RolloutStats) -> None:
    """Add one chunk's rollout counters to a running total."""
    for f in fields(RolloutStats):
        value = getattr(part, f.name)
        if f.name == "dropped_samples":
            total.dropped_samples.extend(value[: REPORTED_SAMPLES - len(total.dropped_samples)])
        elif isinstance(value, Counter):
            total.dropped.update(value)
        elif isinstance(value, list):
            getattr(total, f.name).extend(value)
        else:
            setattr(total, f.name, getattr(total, f.name) + value)
