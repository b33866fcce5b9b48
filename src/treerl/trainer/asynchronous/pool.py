"""The trainer's side of asynchronous RL: rollout workers, admission, staleness, faults, and counters that add up.

    pool = RolloutPool(config, task, weights, version=step)   # spawns trainer.rollout_workers processes
    batch = pool.next_batch(version)     # B = rollout.prompts_per_step groups, none older than max_staleness
    ...train, then weights.publish(policy, version + 1)...
    pool.close()

The unit of work is a group: one prompt with its `group_size` samples, or one multi-turn episode.
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

Faults. A worker is restarted in its slot (killed first if it still runs) when its process exited;
when it has been stopped (SIGSTOP, a debugger: its state in /proc) for `trainer.worker_timeout`
seconds, whatever it was doing, its imports included; when it showed no sign of life for that long
(a thread in it pulses a shared clock once its code runs: a frozen process, idle or busy); when it
holds work and made no model forward or reward call for that long (hung); or when it has not built
its model after STARTUP_SECONDS. Results it had sent are kept, and its unfinished
groups are counted lost and re-queued ahead of new prompts. Work goes to workers that are ready
when there are any, so a worker slow to start does not sit on groups another could sample.
A Python error inside a worker is not retried: the run stops with the worker's traceback.

Counters (groups), checked after every batch and at the end:
    admitted = produced + lost_to_crash + in_flight
    produced = trained + dropped_stale + dropped_failed + pending
where dropped_failed are groups whose every sample was dropped (reward function or environment
failures; each sample is also counted in rollout/dropped_*) and requeued == lost_to_crash.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import signal
import statistics
import threading
import time
from collections import Counter, deque
from dataclasses import asdict, dataclass, field, fields
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from treerl.rollout import RolloutBatch, RolloutStats
from treerl.rollout.stats import REPORTED_SAMPLES
from treerl.rollout.tasks import AgentTask, SingleTurnTask
from treerl.rollout.tasks.base import Prompt
from treerl.trainer.asynchronous.weights import SPAWN, SharedWeights
from treerl.trainer.asynchronous.workers import Chunk, GroupResult, Job, receive, send, worker_main
from treerl.trainer.core.config import Config
from treerl.tree import TokenSequence

log = logging.getLogger("treerl.trainer")

POLL_SECONDS = 0.05  # how long the trainer waits for a worker message before it looks at the workers again
STARTUP_SECONDS = 600.0  # a worker still building its model (imports, loading a checkpoint) is hung only after this


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


@dataclass
class WorkerHandle:
    """The trainer's view of one worker process and the jobs it holds."""

    slot: int
    process: BaseProcess
    jobs: Connection  # trainer -> worker
    results: Connection  # worker -> trainer
    outstanding: dict[int, Job] = field(default_factory=dict)  # job id -> job, sent and not back
    ready: bool = False  # its model is built (it said "ready")
    started: float = 0.0  # time.monotonic() when it was spawned
    stopped_since: float | None = None  # when it was first seen stopped (SIGSTOP), if it still is
    reader: threading.Thread | None = None  # moves its messages into the pool's inbox


class RolloutPool:
    """Hands prompt groups to rollout workers, collects them, and assembles batches within the staleness bound."""

    def __init__(self, config: Config, task: SingleTurnTask | AgentTask, weights: SharedWeights, version: int):
        trainer = config.trainer
        self.config, self.task, self.weights = config, task, weights
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
        self.heartbeats = SPAWN.RawArray("d", trainer.rollout_workers)  # a worker's last model forward or reward call
        self.pulses = SPAWN.RawArray("d", trainer.rollout_workers)  # a worker's last sign of life (0: none yet)
        self.inbox: queue.Queue[tuple[WorkerHandle, tuple]] = queue.Queue()  # (sender, message), from reader threads
        self.closed = False
        self.workers = [self._spawn(slot) for slot in range(trainer.rollout_workers)]

    # ------------------------------------------------------------------ the trainer's calls
    def next_batch(self, version: int) -> AsyncBatch:
        """The next B groups for the trainer at `version` (its weights already published); waits for them."""
        started = time.perf_counter()
        wait = 0.0
        while True:
            self._receive(wait)
            self._check_workers()
            self._drop_stale(version)
            self._admit(version)  # before taking the batch, so the workers sample the next one meanwhile
            if len(self.ready) >= self.batch_size:
                break
            wait = POLL_SECONDS
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
            "async/newest_lag_min": min(version - g.newest for g in groups), "time/rollout": time.perf_counter() - started,
        })
        return AsyncBatch(sequences, stats, groups=groups, lags=lags, metrics=metrics)

    def close(self) -> None:
        """Stop every worker; their unfinished groups stay counted as in flight. Closing twice is harmless."""
        if self.closed:
            return
        self.closed = True
        for worker in self.workers:
            try:
                send(worker.jobs, None)
            except OSError:
                pass
        deadline = time.monotonic() + 2.0
        for worker in self.workers:
            worker.process.join(timeout=max(0.0, deadline - time.monotonic()))
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join()
            worker.jobs.close()
            worker.results.close()
            worker.reader.join(timeout=5)  # type: ignore[union-attr]
        self._update_gauges()

    # ------------------------------------------------------------------ admission
    def _admit(self, version: int) -> None:
        """Hand out groups while in flight + ready stays under (max_staleness + 1) x B, in chunks."""
        self._update_gauges()
        room = (self.max_staleness + 1) * self.batch_size - self.counters.in_flight - len(self.ready)
        jobs = [self._new_job() for _ in range(max(0, room))]
        for lo in range(0, len(jobs), self.chunk_size):
            chunk = jobs[lo : lo + self.chunk_size]
            ready = [w for w in self.workers if w.ready] or self.workers  # not a worker still loading its model
            worker = min(ready, key=lambda w: (len(w.outstanding), w.slot))
            if not worker.outstanding:
                self.heartbeats[worker.slot] = time.monotonic()  # the hang clock starts now, not when it went idle
            worker.outstanding.update({job.id: job for job in chunk})
            self.counters.admitted += len(chunk)
            try:
                send(worker.jobs, Chunk(chunk, version))
            except OSError:  # the worker died: _check_workers re-queues its jobs
                pass

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

    # ------------------------------------------------------------------ results and staleness
    def _receive(self, timeout: float) -> None:
        """Handle every message the reader threads have queued, waiting up to `timeout` for the first."""
        try:
            item = self.inbox.get(timeout=timeout) if timeout > 0 else self.inbox.get_nowait()
            while True:
                self._handle(*item)
                item = self.inbox.get_nowait()
        except queue.Empty:
            pass

    def _handle(self, worker: WorkerHandle, message: tuple) -> None:
        kind = message[0]
        if kind == "ready":
            worker.ready = True
            self.heartbeats[worker.slot] = time.monotonic()
        if kind == "error":
            raise RuntimeError(f"rollout worker {worker.slot} (pid {worker.process.pid}) failed:\n{message[1]}")
        if kind == "done":
            results: list[GroupResult] = message[1]
            for result in results:
                job = worker.outstanding.pop(result.job)
                sequences = result.sequences()
                versions = [v for s in sequences for v in s.fields["versions"].tolist() if v >= 0]
                oldest, newest = (min(versions), max(versions)) if versions else (result.version, result.version)
                self.ready.append(ReadyGroup(job, sequences, oldest, newest))
                self.counters.produced += 1
            merge_stats(self.stats, message[2])

    def _drop_stale(self, version: int) -> None:
        """Ready groups more than max_staleness versions old are dropped, never trained."""
        stale = [g for g in self.ready if version - g.oldest > self.max_staleness]
        if stale:
            self.ready = [g for g in self.ready if version - g.oldest <= self.max_staleness]
            self.counters.dropped_stale += len(stale)
            log.info("async: dropped %d groups older than %d versions at version %d", len(stale),
                     self.max_staleness, version)

    def _update_gauges(self) -> None:
        self.counters.in_flight = sum(len(w.outstanding) for w in self.workers)
        self.counters.pending = len(self.ready)

    # ------------------------------------------------------------------ faults
    def _check_workers(self) -> None:
        """Restart (killing it first) a worker that exited, stopped pulsing, hangs holding work, or never got ready."""
        timeout = self.config.trainer.worker_timeout
        for worker in self.workers:
            now, pulse = time.monotonic(), self.pulses[worker.slot]
            stopped = process_stopped(worker.process.pid)  # type: ignore[arg-type]
            worker.stopped_since = (worker.stopped_since or now) if stopped else None
            if not worker.process.is_alive():
                reason = f"exited with code {worker.process.exitcode}"
            elif worker.stopped_since is not None and now - worker.stopped_since > timeout:
                reason = f"has been stopped (SIGSTOP or a debugger) for {timeout:g} s (killed)"
            elif pulse and now - pulse > timeout:
                reason = f"showed no sign of life for {timeout:g} s (stopped or frozen; killed)"
            elif worker.ready and worker.outstanding and now - self.heartbeats[worker.slot] > timeout:
                reason = f"made no progress for {timeout:g} s (killed)"
            elif not worker.ready and now - worker.started > STARTUP_SECONDS:
                reason = f"did not build its model in {STARTUP_SECONDS:g} s (killed)"
            else:
                continue
            if worker.process.is_alive():
                os.kill(worker.process.pid, signal.SIGKILL)  # type: ignore[arg-type]
            self._restart(worker, reason)

    def _restart(self, worker: WorkerHandle, reason: str) -> None:
        """Keep what it had sent, count and re-queue what it held, start a fresh process in its slot."""
        worker.process.join()
        worker.reader.join()  # type: ignore[union-attr]  # it queues every complete message, then the pipe ends
        self._receive(0.0)
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
        worker.jobs.close()
        worker.results.close()
        self.workers[worker.slot] = self._spawn(worker.slot)

    def _spawn(self, slot: int) -> WorkerHandle:
        worker_jobs, trainer_jobs = SPAWN.Pipe(duplex=False)  # (receiving end, sending end)
        trainer_results, worker_results = SPAWN.Pipe(duplex=False)
        process = SPAWN.Process(target=worker_main, name=f"treerl-rollout-worker-{slot}", daemon=True,
                                args=(slot, self.config, self.weights, worker_jobs, worker_results, self.heartbeats,
                                      self.pulses))
        self.heartbeats[slot] = time.monotonic()
        self.pulses[slot] = 0.0
        started = time.monotonic()
        process.start()
        worker_jobs.close()  # the worker's ends, closed here so that a dead worker reads as end-of-file
        worker_results.close()
        handle = WorkerHandle(slot, process, jobs=trainer_jobs, results=trainer_results, started=started)
        handle.reader = threading.Thread(target=self._read, args=(handle,), daemon=True)
        handle.reader.start()
        return handle

    def _read(self, worker: WorkerHandle) -> None:
        """A reader thread: a worker's messages into the inbox, until its pipe ends. Blocking here, not in the
        trainer's loop, means a worker frozen halfway through a message cannot stop the trainer."""
        while True:
            try:
                message = receive(worker.results)
            except (EOFError, OSError):
                return
            self.inbox.put((worker, message))


def process_stopped(pid: int) -> bool:
    """The process is stopped (state T or t in /proc/PID/stat: SIGSTOP, SIGTSTP, a debugger); False without /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


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
