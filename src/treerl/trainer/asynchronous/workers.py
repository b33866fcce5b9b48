"""A rollout worker: a process that samples prompt groups with its own copy of the policy, one chunk after another.

Step 1 (docs/architecture.md), inside a worker process.

    trainer -> worker   Chunk(jobs, version)            prompts to sample, and the policy version they need at least
    worker  -> trainer  ("ready", pid)                  once, when the model is built
                        ("done", [GroupResult], stats)  the training sequences of each job of a chunk
                        ("error", traceback)            a Python error: the trainer stops with it
                        ("server-error", message)       a server failed: the trainer stops with this one line
    weights             SharedWeights, pulled before each chunk (and each segment, with on_update=interrupt);
                        with inference servers (rollout.server_url) none: the worker samples on the servers,
                        which the trainer keeps at the newest version (treerl.trainer.core.servers)
    heartbeat           a shared float per worker, set at every model forward, before every reward /
                        environment call (each limited by rollout.reward_timeout) and every second while
                        agent episodes run (their event loop is alive), so a hung worker shows
    pulse               another shared float, set every PULSE_SECONDS by a thread of its own from the start,
                        so a stopped (SIGSTOP) or frozen process shows, busy or idle, ready or still loading
    signals             SIGINT and SIGTERM are ignored: the trainer stops its workers when it stops

Every message is pickled to bytes with the standard pickler and sent over the worker's own pipes,
so a killed worker can break only its own pipes (a shared queue's lock held by a killed process
would block every other worker). A thread sends the results, so sampling goes on while the
trainer is busy and not reading.
"""

from __future__ import annotations

import os
import pickle
import queue
import signal
import threading
import time
import traceback
from collections import defaultdict
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Callable

import torch

from treerl.errors import ServerError, UserError
from treerl.rollout import EmbeddedSampler, Rollout, RolloutStats
from treerl.rollout.collect import server_client
from treerl.rollout.sampling.prefix_sharing import PrefixCounts
from treerl.rollout.tasks.base import Prompt, rng_for
from treerl.trainer.asynchronous.interruptible import InterruptibleSampler
from treerl.trainer.asynchronous.weights import SharedWeights
from treerl.trainer.core.build import load_policy, policy_images, policy_tokenizer
from treerl.trainer.core.config import Config
from treerl.trainer.core.precision import autocast_dtype
from treerl.tree import ImageSpan, TokenSequence


@dataclass
class Job:
    """One prompt group to sample: a prompt with its `group_size` samples, or one multi-turn episode."""

    id: int  # one per admission: a re-queued prompt gets a new id
    index: int  # position in the prompt stream: prompt index % prompts_per_step of step index // prompts_per_step
    prompt: Prompt


@dataclass
class Chunk:
    """Jobs a worker samples in one workflow run (one sampler call per turn for all of them)."""

    jobs: list[Job]
    version: int  # the trainer's policy version when it admitted them: the worker samples with this one or newer


@dataclass
class GroupResult:
    """What came of one job: its training sequences (none if every sample was dropped)."""

    job: int
    packed: list[tuple]  # the sequences as numpy arrays: pickling 128 small tensors takes ~0.1 s, arrays ~2 ms
    version: int  # the policy version the worker held when it started the chunk

    @classmethod
    def of(cls, job: int, sequences: list[TokenSequence], version: int) -> GroupResult:
        packed = [(s.tokens.numpy(), {k: v.numpy() for k, v in s.fields.items()}, s.info, s.name,
                   [(i.start, i.length, i.pixel_values.numpy(), None if i.grid_thw is None else i.grid_thw.numpy())
                    for i in s.images]) for s in sequences]
        return cls(job, packed, version)

    def sequences(self) -> list[TokenSequence]:
        return [TokenSequence(torch.from_numpy(tokens), {k: torch.from_numpy(v) for k, v in fields.items()}, info, name,
                              images=tuple(ImageSpan(start, length, torch.from_numpy(pixels),
                                                     None if grid is None else torch.from_numpy(grid))
                                           for start, length, pixels, grid in images))
                for tokens, fields, info, name, images in self.packed]


def send(connection: Connection, message: Any) -> None:
    connection.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def receive(connection: Connection) -> Any:
    return pickle.loads(connection.recv_bytes())


PULSE_SECONDS = 0.2


def worker_main(slot: int, config: Config, weights: SharedWeights | None, jobs: Connection, results: Connection,
                heartbeats: Any, pulses: Any) -> None:
    """The worker process: build the policy, then sample every chunk that arrives until told to stop (None)."""
    threading.Thread(target=pulse, args=(pulses, slot), name="treerl-pulse", daemon=True).start()
    for sig in (signal.SIGINT, signal.SIGTERM):  # a Ctrl-C reaches the whole process group: the trainer decides
        signal.signal(sig, signal.SIG_IGN)
    torch.set_num_threads(config.trainer.worker_threads)
    outbox = Outbox(results)

    def beat(*_: Any) -> None:
        heartbeats[slot] = time.monotonic()

    try:
        rollout, held = (server_rollout if config.rollout.server_urls else embedded_rollout)(config, weights, beat)
        outbox.put(("ready", os.getpid()))
        while (chunk := receive(jobs)) is not None:
            beat()
            outbox.put(("done", *sample_chunk(rollout, chunk, held(chunk.version))))
    except EOFError:  # the trainer is gone
        pass
    except ServerError as e:  # a server died or refused: the trainer stops with this line, not a traceback
        outbox.put(("server-error", str(e)))
    except BaseException:
        outbox.put(("error", traceback.format_exc()))
        raise
    finally:
        outbox.close()


def embedded_rollout(config: Config, weights: SharedWeights | None,
                     beat: Callable[..., None]) -> tuple[Rollout, Callable[[int], int]]:
    """The worker's own copy of the policy, sampling in process; its weights pulled from the trainer before each
    chunk (and each segment, with on_update=interrupt). Returns the rollout and `held(version)`: the version the
    worker samples a chunk of `version` with, after waiting for it."""
    assert weights is not None
    model, tokenizer = load_policy(config.model, torch.device("cpu"))
    model.register_forward_pre_hook(beat)
    embedded = EmbeddedSampler(model, version=weights.pull(model, have=-1),
                               autocast=autocast_dtype(config.trainer.precision),
                               return_routed_experts=config.rollout.return_routed_experts,
                               prefix_sharing=config.rollout.prefix_sharing,
                               prefix_cache_tokens=config.rollout.prefix_cache_tokens)

    def refresh() -> None:
        embedded.version = weights.pull(model, embedded.version)

    sampler = embedded if config.trainer.on_update == "finish" else InterruptibleSampler(
        embedded, refresh, config.trainer.interrupt_tokens)
    rollout = Rollout(config.rollout, tokenizer, sampler, policy_images(config.model, len(tokenizer)))
    rollout.watch(beat)

    def held(version: int) -> int:
        refresh()
        while embedded.version < version:  # published before the chunk was sent, so this never waits long
            time.sleep(0.001)
            refresh()
        return embedded.version

    return rollout, held


def server_rollout(config: Config, weights: SharedWeights | None,
                   beat: Callable[..., None]) -> tuple[Rollout, Callable[[int], int]]:
    """Sampling on the inference servers: no model here. The trainer pushed the chunk's version to every server
    before it sent the chunk, and the servers tag each token with the version that sampled it."""
    client = server_client(config.rollout)
    client.on_wait = beat  # a sign of life every second while a request is out (rollout.request_timeout bounds it)
    try:
        client.connect()
    except UserError as e:  # the servers answered when the run started: one that does not now has failed
        raise ServerError(str(e)) from None
    tokenizer = policy_tokenizer(config.model)
    rollout = Rollout(config.rollout, tokenizer, client, policy_images(config.model, len(tokenizer)))
    rollout.watch(beat)
    return rollout, lambda version: version


def pulse(pulses: Any, slot: int) -> None:
    """Show the trainer this process runs: its slot's clock, every PULSE_SECONDS, until the process ends."""
    while True:
        pulses[slot] = time.monotonic()
        time.sleep(PULSE_SECONDS)


def sample_chunk(rollout: Rollout, chunk: Chunk, version: int) -> tuple[list[GroupResult], RolloutStats]:
    """Sample every job of the chunk in one workflow run; the sequences sorted back into their groups.

    The sampling seed is the synchronous loop's seed of the step the first prompt belongs to, or for
    a chunk starting later in the step one derived from it and that place: a chunk holding exactly
    one step's prompts samples what the synchronous loop would (with max_staleness = 0 and one
    worker the two runs are the same).
    """
    stats = RolloutStats()
    started = time.perf_counter()
    step, place = divmod(chunk.jobs[0].index, rollout.config.prompts_per_step)
    seed = rng_for("sampling", rollout.config.seed, step).getrandbits(62)
    if place:  # a seed of its own, not the step's plus place: seeds one apart would repeat each other's streams
        seed = rng_for("chunk", seed, place).getrandbits(62)
    counts = PrefixCounts.of(rollout.sampler)
    sequences = rollout.workflow.run(rollout.sampler, [job.prompt for job in chunk.jobs], stats, seed=seed)
    stats.count_prefills(counts and PrefixCounts.of(rollout.sampler) - counts)
    stats.seconds = time.perf_counter() - started
    by_group: dict[str, list[TokenSequence]] = defaultdict(list)
    for seq in sequences:
        by_group[seq.info["group"]].append(seq)
    return [GroupResult.of(job.id, by_group.pop(job.prompt.id, []), version) for job in chunk.jobs], stats


class Outbox:
    """Sends messages from a thread, so the worker samples on while the trainer is not reading its pipe."""

    def __init__(self, connection: Connection):
        self.connection = connection
        self.queue: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._send_all, daemon=True)
        self.thread.start()

    def put(self, message: Any) -> None:
        self.queue.put(message)

    def close(self) -> None:
        """Send what is queued, then stop."""
        self.queue.put(None)
        self.thread.join(timeout=60)

    def _send_all(self) -> None:
        while (message := self.queue.get()) is not None:
            try:
                send(self.connection, message)
            except OSError:  # the trainer closed the pipe
                return
