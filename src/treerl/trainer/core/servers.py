"""The inference servers as the trainer's sampler: each policy version reaches every server before it samples.

From step 6 back to step 1 (docs/architecture.md), with `rollout.server_url`.

    servers = ServerSampler.start(run, client, pause)   # pushes the policy of run.start_step (a resumed run's too)
    ...
    servers.sync()                 # every rank, before sampling: a newer version is written and pushed
    batch = rollout.collect(step)  # samples from the servers (rank 0 under torchrun)
    ...update...
    servers.version = step + 1     # pushed by the next sync
    servers.close()                # the weights written under /dev/shm are removed

A push writes the policy as a transformers checkpoint (safetensors) and has every server load it
in place (`CompletionsClient.push_weights`). Where it is written: `rollout.weights_dir/treerl-<run
id>`, else `/dev/shm/treerl-<run id>` when every server runs on this machine (a loopback URL) and
/dev/shm has room for twice the weights (so the file lives in memory, as with a shared-memory
transfer; removed at the end of the run), else `output_dir/server_weights` (removed at the end if
no step trained). Pushing lazily, at the next sync, means a failed push or a server
that died always meets a run whose last step is complete: the caller checkpoints it and stops
(`treerl.trainer.rl.learn.train_loop`). The time of each push is in the metrics
(`time/weight_push`, with `weights/pushed_mb`).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
import urllib.parse
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from treerl.errors import ServerError
from treerl.rollout import Completion, CompletionsClient, SamplingParams, build_sampler
from treerl.rollout.collect import server_client
from treerl.rollout.sampling.sampler import images_kwarg
from treerl.trainer.core.checkpoint import full_weights, write_pretrained_atomically
from treerl.trainer.core.config import Config, ConfigError
from treerl.trainer.core.run import Run, on_main
from treerl.tree import ImageSpan

log = logging.getLogger("treerl.trainer")
SHARED_MEMORY = Path("/dev/shm")
LOOPBACK = ("localhost", "127.0.0.1", "::1")


@dataclass
class ServerSampler:
    """A `Sampler` over inference servers whose weights follow the trainer's policy version."""

    run: Run
    client: CompletionsClient
    pause: str = "wait"  # generations in flight during a push: wait (finish on the old weights) | keep (resume on the new)
    version: int = 0  # the trainer's policy version; pushed by the next `sync`
    pushed: int | None = None  # the version the servers hold
    directory: Path = field(default_factory=Path)  # where pushed weights are written
    in_shared_memory: bool = False  # removed at the end of the run (it takes memory)
    in_output_dir: bool = False  # removed at the end unless a step trained (then it is the run's output)
    last_push: dict[str, float] = field(default_factory=dict)  # the last push's metrics, taken by `metrics()`

    @classmethod
    def start(cls, run: Run, client: CompletionsClient, pause: str = "wait") -> ServerSampler:
        """The servers' sampler, holding the policy of the run's first step (pushed now: a fresh run's servers may
        run another checkpoint, a resumed run's do)."""
        directory, where = weights_directory(run, client)
        sampler = cls(run, client, pause, version=run.start_step, directory=directory,
                      in_shared_memory=where == "shared memory", in_output_dir=where == "output_dir")
        try:
            sampler.sync()
        except BaseException:
            sampler.close()
            raise
        return sampler

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 images: list[tuple[ImageSpan, ...]] | None = None) -> list[list[Completion]]:
        return self.client.generate(prompts, params, **images_kwarg(images or []))

    def sync(self) -> None:
        """Every rank: if the servers hold an older version, write the policy and have every server load it (rank 0
        pushes; a failure is raised on every rank)."""
        if self.pushed == self.version:
            return
        started = time.perf_counter()
        weights = full_weights(self.run.policy)  # a collective under FSDP2
        path = self.directory / "weights"

        def push() -> None:
            write_pretrained_atomically(path, self.run.policy, weights, self.run.tokenizer)
            self.client.push_weights(str(path), self.version, self.pause)

        on_main(self.run.env, push)
        self.pushed = self.version
        self.last_push = {"time/weight_push": time.perf_counter() - started,
                          "weights/pushed_mb": sum(t.numel() * t.element_size() for t in weights.values()) / 2**20}

    def finish(self) -> None:
        """After the last step: the servers load the trained policy. The run is complete and checkpointed by then,
        so a server that fails here is said, not a failed run."""
        try:
            self.sync()
        except ServerError as e:
            log.warning("training finished, but the servers could not load the final policy: %s", e)

    def metrics(self) -> dict[str, float]:
        """The last push's metrics, once."""
        metrics, self.last_push = self.last_push, {}
        return metrics

    def close(self) -> None:
        """Remove the weights written under /dev/shm (they take memory until removed), and those in output_dir when
        no step trained (a run that failed while it set up leaves nothing there, so running it again just works)."""
        unclaimed = self.in_output_dir and not self.run.report.opened
        if (self.in_shared_memory or unclaimed) and self.run.env.is_main:
            shutil.rmtree(self.directory, ignore_errors=True)


def connect_servers(config: Config) -> CompletionsClient | None:
    """The client of the `rollout.server_url` servers, connected before any compute: each one reachable, able to serve
    RL, and able to do what this run asks (per-token versions for async training, the log-probs of truncated
    sampling); None: no server, sample in process."""
    if not config.rollout.server_urls:
        return None
    config.check()  # a bad URL is named as such, not as a server that cannot be reached
    if int(os.environ.get("RANK", "0")) != 0:  # under torchrun rank 0 alone talks to the servers
        return server_client(config.rollout)
    client = build_sampler(config.rollout)
    assert isinstance(client, CompletionsClient)
    for server in client.servers:
        info = server.info
        assert info is not None
        if config.trainer.mode == "async" and not info.versions_per_token:
            raise ConfigError(f"trainer.mode=async with rollout.server_url: the {info.kind} server at {server.url} "
                              f"does not say which weights sampled each token (its {info.generate_route} route): "
                              "start vLLM with --enable-scale-out")
        if config.rollout.truncates and info.kind == "sglang":
            raise ConfigError(f"rollout.top_p / top_k / min_p with the SGLang server at {server.url}: SGLang returns "
                              "the log-prob of the untruncated distribution, not of the one it sampled from; sample "
                              "untruncated, or use vLLM (--logprobs-mode processed_logprobs)")
    return client


def weights_directory(run: Run, client: CompletionsClient) -> tuple[Path, str]:
    """Where pushed weights go (see the module docstring), a directory of this run's own, and which kind of place
    it is ("configured", "shared memory" or "output_dir")."""
    own = f"treerl-{run.run_id or uuid.uuid4().hex}"  # two runs sharing rollout.weights_dir never mix their weights
    configured = run.config.rollout.weights_dir
    if configured:
        return (Path(configured) / own).resolve(), "configured"
    local = all(urllib.parse.urlsplit(s.url).hostname in LOOPBACK for s in client.servers)
    size = sum(p.numel() * p.element_size() for p in run.policy.parameters())
    if local and SHARED_MEMORY.is_dir() and shutil.disk_usage(SHARED_MEMORY).free > 2 * size:
        return SHARED_MEMORY / own, "shared memory"
    return (Path(run.config.trainer.output_dir) / "server_weights").resolve(), "output_dir"
