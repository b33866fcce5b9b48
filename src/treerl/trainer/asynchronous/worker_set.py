"""The trainer's side of the rollout worker processes: spawn, read, check, restart, close.

Step 1 (docs/architecture.md): the worker processes, seen from the trainer.

    workers = WorkerSet(config, weights)      # trainer.rollout_workers processes, one per slot (weights: None with servers)
    workers.send(jobs, version)               # a chunk to the least loaded ready worker
    for finished in workers.receive(timeout): # the chunks that came back
        ...
    for worker, reason in workers.failed():   # killed if it still runs
        workers.wait_for_end(worker); ...; workers.replace(worker)
    workers.close()

What the jobs are, and what happens to a failed worker's jobs, is the pool's business
(`treerl.trainer.asynchronous.pool`); this module only tracks which jobs each process holds.

Faults. A worker has failed when its process exited; when it has been stopped (SIGSTOP, a
debugger: its state in /proc) for `trainer.worker_timeout` seconds, whatever it was doing, its
imports included; when it showed no sign of life for that long (a thread in it pulses a shared
clock once its code runs: a frozen process, idle or busy); when it holds work and made no model
forward or reward call for that long (hung); or when it has not built its model after
STARTUP_SECONDS. Work goes to workers that are ready when there are any, so a worker slow to
start does not sit on groups another could sample. A Python error inside a worker is not
retried: the run stops with the worker's traceback; a failed inference server stops it with one line
(a `ServerError`, after the trainer checkpoints its last complete step).
"""

from __future__ import annotations

import os
import queue
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

from treerl.errors import ServerError
from treerl.rollout import RolloutStats
from treerl.trainer.asynchronous.weights import SPAWN, SharedWeights
from treerl.trainer.asynchronous.workers import Chunk, GroupResult, Job, receive, send, worker_main
from treerl.trainer.core.config import Config

STARTUP_SECONDS = 600.0  # a worker still building its model (imports, loading a checkpoint) is hung only after this


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
    reader: threading.Thread | None = None  # moves its messages into the inbox


@dataclass
class Finished:
    """A chunk back from a worker: each of its jobs with what came of it, and the chunk's rollout counters."""

    results: list[tuple[Job, GroupResult]]
    stats: RolloutStats


class WorkerSet:
    """The rollout worker processes, each with its pipes, reader thread and clocks, and the jobs each one holds."""

    def __init__(self, config: Config, weights: SharedWeights | None):
        self.config, self.weights = config, weights
        count = config.trainer.rollout_workers
        self.heartbeats = SPAWN.RawArray("d", count)  # a worker's last model forward or reward call
        self.pulses = SPAWN.RawArray("d", count)  # a worker's last sign of life (0: none yet)
        self.inbox: queue.Queue[tuple[WorkerHandle, tuple]] = queue.Queue()  # (sender, message), from reader threads
        self.closed = False
        self.handles = [self._spawn(slot) for slot in range(count)]

    def __getitem__(self, slot: int) -> WorkerHandle:
        return self.handles[slot]

    def in_flight(self) -> int:
        """Jobs sent to a worker and not back yet."""
        return sum(len(w.outstanding) for w in self.handles)

    def send(self, jobs: list[Job], version: int) -> None:
        """A chunk to the ready worker holding the fewest jobs (any worker while none is ready)."""
        ready = [w for w in self.handles if w.ready] or self.handles  # not a worker still loading its model
        worker = min(ready, key=lambda w: (len(w.outstanding), w.slot))
        if not worker.outstanding:
            self.heartbeats[worker.slot] = time.monotonic()  # the hang clock starts now, not when it went idle
        worker.outstanding.update({job.id: job for job in jobs})
        try:
            send(worker.jobs, Chunk(jobs, version))
        except OSError:  # the worker died: `failed` reports it, and its jobs are still outstanding
            pass

    def receive(self, timeout: float) -> Iterator[Finished]:
        """Every message the reader threads have queued, waiting up to `timeout` for the first: the finished chunks.
        A worker's "error" raises with its traceback."""
        try:
            item = self.inbox.get(timeout=timeout) if timeout > 0 else self.inbox.get_nowait()
            while True:
                finished = self._handle(*item)
                if finished is not None:
                    yield finished
                item = self.inbox.get_nowait()
        except queue.Empty:
            return

    def _handle(self, worker: WorkerHandle, message: tuple) -> Finished | None:
        """One message: "ready" marks the worker ready, "error" and "server-error" raise, "done" is a finished chunk."""
        kind = message[0]
        if kind == "ready":
            worker.ready = True
            self.heartbeats[worker.slot] = time.monotonic()
        if kind == "error":
            raise RuntimeError(f"rollout worker {worker.slot} (pid {worker.process.pid}) failed:\n{message[1]}")
        if kind == "server-error":
            raise ServerError(f"rollout worker {worker.slot}: {message[1]}")
        if kind == "done":
            results: list[GroupResult] = message[1]
            return Finished([(worker.outstanding.pop(result.job), result) for result in results], message[2])
        return None

    def failed(self) -> Iterator[tuple[WorkerHandle, str]]:
        """Each worker that exited, stopped pulsing, hangs holding work, or never got ready (killed), and why."""
        timeout = self.config.trainer.worker_timeout
        for worker in self.handles:
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
            yield worker, reason

    def wait_for_end(self, worker: WorkerHandle) -> None:
        """A failed worker's process and reader ended: every complete message it sent is in the inbox."""
        worker.process.join()
        worker.reader.join()  # type: ignore[union-attr]  # it queues every complete message, then the pipe ends

    def replace(self, worker: WorkerHandle) -> None:
        """A fresh process in an ended worker's slot."""
        worker.jobs.close()
        worker.results.close()
        self.handles[worker.slot] = self._spawn(worker.slot)

    def close(self) -> None:
        """Stop every worker (killed after 2 s); the jobs they held stay outstanding. Closing twice is harmless."""
        if self.closed:
            return
        self.closed = True
        for worker in self.handles:
            try:
                send(worker.jobs, None)
            except OSError:
                pass
        deadline = time.monotonic() + 2.0
        for worker in self.handles:
            worker.process.join(timeout=max(0.0, deadline - time.monotonic()))
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join()
            worker.jobs.close()
            worker.results.close()
            worker.reader.join(timeout=5)  # type: ignore[union-attr]

    def _spawn(self, slot: int) -> WorkerHandle:
        """Start a worker process in `slot`, with its two pipes and a reader thread."""
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
