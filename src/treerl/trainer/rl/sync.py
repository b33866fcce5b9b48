"""Synchronous RL: each step samples a batch with the current policy, then updates the policy on it.

Drives steps 1 to 6 (docs/architecture.md) one after the other.

    for step in steps:
        batch = collect(run, rollout, step)         # prompts -> samples -> rewards -> sequences (RolloutBatch)
        learn(run, batch, reference, step)          # prepare + update (treerl.trainer.rl.learn)

Under torchrun every rank must hold the same global batch. With the embedded sampler every rank
runs the same seeded rollout (a step's prompts and sampling seed depend only on the config and
the step, and the weights are identical on every rank): no communication, and under FSDP2 the
sampler's forwards through the sharded model run in lockstep on all ranks, as they must. A
fingerprint of the batch is compared across ranks, so a divergence is an error, not a silent
mismatch. With an inference server (`rollout.server_url`) rank 0 collects and broadcasts.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch.distributed as dist

from treerl.rollout import CompletionsClient, Rollout, Sampler, build_sampler
from treerl.trainer.core.checkpoint import full_weights, write_pretrained_atomically
from treerl.trainer.core.config import Config
from treerl.trainer.core.precision import autocast_dtype
from treerl.trainer.core.run import Run
from treerl.trainer.rl.learn import (
    Reference,
    TrainResult,
    collect,
    evaluation_rollout,
    learn,
    load_reference,
    train_loop,
)


def train_sync(config: Config) -> TrainResult:
    """Synchronous RL as configured; returns the start/end rewards."""
    started = time.perf_counter()
    client = server_client(config)  # before the model is built: an unreachable server is an error at once
    run = Run.start(config, temperature=config.rollout.temperature)
    rollouts: list[Rollout] = []
    try:
        run.check_model(config.rollout.max_context_tokens)
        sampler = client if client is not None else build_sampler(
            config.rollout, run.policy, autocast=autocast_dtype(config.trainer.precision))
        sampler.version = run.start_step
        rollout = Rollout(config.rollout, run.tokenizer, sampler)
        rollouts.append(rollout)
        reference = load_reference(config, run) if config.algo.kl_coef > 0 else None
        evaluation = evaluation_rollout(run, sampler)
        if evaluation is not None:
            rollouts.append(evaluation)
        return train_loop(run, evaluation, lambda step: train_step(run, rollout, reference, step), started)
    finally:
        for each in rollouts:
            each.close()
        run.finish()


def server_client(config: Config) -> Sampler | None:
    """The client of `rollout.server_url`, checked reachable before any compute (None: no server, sample in
    process)."""
    if not config.rollout.server_url:
        return None
    config.check()  # a bad URL is named as such, not as a server that cannot be reached
    return build_sampler(config.rollout)


def train_step(run: Run, rollout: Rollout, reference: Reference | None, step: int) -> dict[str, float]:
    """One step: collect, prepare, update; returns its metrics."""
    started = time.perf_counter()
    batch = collect(run, rollout, step)
    metrics = learn(run, batch, reference, step)
    rollout.sampler.version = step + 1
    push_weights(run, rollout, step + 1)
    metrics["time/rollout"] = batch.stats.seconds
    metrics["time/step"] = time.perf_counter() - started
    return metrics


def push_weights(run: Run, rollout: Rollout, version: int) -> None:
    """With an inference server: write the updated policy to disk and have the server load it."""
    client = rollout.sampler
    if not isinstance(client, CompletionsClient):
        return
    run.claim_output()
    weights = full_weights(run.policy)
    if run.env.is_main:
        path = (Path(run.config.trainer.output_dir) / "server_weights").resolve()
        write_pretrained_atomically(path, run.policy, weights, run.tokenizer)
        client.update_weights_from_disk(str(path), version)
    if run.env.world_size > 1:
        dist.barrier()
