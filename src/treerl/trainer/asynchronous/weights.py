"""Policy weights from the trainer to its rollout workers, each copy tagged with a policy version.

From step 6 back to step 1 (docs/architecture.md): each new policy version reaches the workers.

    shared = SharedWeights.of(policy, version=0)      # trainer: every tensor copied into shared memory
    ... pass `shared` to worker processes (torch.multiprocessing, spawn) ...
    shared.publish(policy, version=step + 1)           # trainer, after each optimizer step
    have = shared.pull(worker_model, have)             # worker: loads newer weights if any; returns their version

The tensors live in CPU shared memory (`share_memory_()`): publishing is one copy by the trainer,
pulling one copy by each worker, and nothing is serialised or written to disk. The copies stay
consistent without a lock (a worker killed while holding a lock would block every other process)
through a sequence number that is odd while the trainer writes (a seqlock): a worker copies, then
checks the number did not move; if it did, the weights changed under it and it copies again.

On GPU, across nodes, the same interface would be served by an NCCL broadcast from the trainer to
the workers (docs/training.md#asynchronous-rl-trainermodeasync describes it); it is not implemented: workers sample
on CPU, and a trainer on GPU publishes into CPU shared memory.
"""

from __future__ import annotations

import time

import torch
import torch.multiprocessing as mp
from torch import nn

SPAWN = mp.get_context("spawn")


class SharedWeights:
    """A copy of a model's state dict in shared memory plus its version; picklable to spawned processes."""

    def __init__(self, tensors: dict[str, torch.Tensor], version: int):
        self.tensors = tensors
        self._sequence = SPAWN.RawValue("q", 0)  # odd while the trainer writes
        self._version = SPAWN.RawValue("q", version)

    @classmethod
    def of(cls, model: nn.Module, version: int) -> SharedWeights:
        """Shared-memory copies of `model`'s state dict (parameters and persistent buffers), at `version`."""
        tensors = {name: t.detach().to("cpu", copy=True).share_memory_() for name, t in model.state_dict().items()}
        return cls(tensors, version)

    @property
    def version(self) -> int:
        return self._version.value

    def publish(self, model: nn.Module, version: int) -> None:
        """Trainer: copy `model`'s current weights in and announce them as `version`."""
        state = model.state_dict()
        self._sequence.value += 1
        with torch.no_grad():
            for name, shared in self.tensors.items():
                shared.copy_(state[name])
        self._version.value = version
        self._sequence.value += 1

    def pull(self, model: nn.Module, have: int) -> int:
        """Worker: if a version newer than `have` is published, load it into `model`; the version `model` now holds."""
        while True:
            before = self._sequence.value
            if before % 2:  # the trainer is writing: its copy takes milliseconds
                time.sleep(0.001)
                continue
            version = self._version.value
            if version <= have:
                return have
            with torch.no_grad():
                model.load_state_dict(self.tensors, strict=True)
            if self._sequence.value == before:
                return version
