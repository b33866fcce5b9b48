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
mismatch. With inference servers (`rollout.server_url`) rank 0 collects and broadcasts, and each
policy version is pushed to the servers before its first sample (`treerl.trainer.core.servers`).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import replace

from treerl.rollout import EmbeddedSampler, Rollout, build_sampler
from treerl.rollout.workflows.single_turn import SingleTurnWorkflow
from treerl.trainer.core.config import Config, trained_algo
from treerl.trainer.core.precision import autocast_dtype
from treerl.trainer.core.run import Run
from treerl.trainer.core.servers import ServerSampler, connect_servers
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
    config = replace(config, algo=trained_algo(config))  # decoupled PPO for truncated sampling
    client = connect_servers(config)  # before the model is built: an unreachable server is an error at once
    run = Run.start(config, temperature=config.rollout.temperature)
    rollouts: list[Rollout] = []
    servers = None
    try:
        run.check_model(config.rollout.max_context_tokens)
        if client is not None:
            servers = ServerSampler.start(run, client)
            sampler = servers
        else:
            sampler = build_sampler(config.rollout, run.policy, autocast=autocast_dtype(config.trainer.precision))
            sampler.version = run.start_step
        rollout = Rollout(config.rollout, run.tokenizer, sampler, run.images)
        rollouts.append(rollout)
        reference = load_reference(config, run) if config.algo.kl_coef > 0 else None
        evaluation = evaluation_rollout(run, sampler)
        if evaluation is not None:
            rollouts.append(evaluation)
        result = train_loop(run, evaluation, lambda step: train_step(run, rollout, reference, step), started)
        if servers is not None and not result.stopped_by:
            servers.finish()  # the servers end with the trained policy
        return result
    finally:
        for each in rollouts:
            each.close()
        if servers is not None:
            servers.close()
        run.finish()


def train_step(run: Run, rollout: Rollout, reference: Reference | None, step: int) -> dict[str, float]:
    """One step: collect, prepare, update; returns its metrics."""
    started = time.perf_counter()
    embedded = rollout.sampler if isinstance(rollout.sampler, EmbeddedSampler) else None
    one_call = embedded is not None and isinstance(rollout.workflow, SingleTurnWorkflow)
    with embedded.unread() if one_call else contextlib.nullcontext():  # type: ignore[union-attr]
        batch = collect(run, rollout, step)
    if embedded is not None:  # the update changes the weights: its K/V are never read again
        embedded.cache.clear()
    metrics = learn(run, batch, reference, step)
    rollout.sampler.version = step + 1
    if isinstance(rollout.sampler, ServerSampler):
        metrics.update(rollout.sampler.metrics())
    metrics["time/rollout"] = batch.stats.seconds
    metrics["time/step"] = time.perf_counter() - started
    return metrics
