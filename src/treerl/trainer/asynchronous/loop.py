"""Asynchronous RL (`trainer.mode=async`): rollout workers sample while the trainer updates (AReaL's design).

Drives steps 1 to 6 (docs/architecture.md) with step 1 in worker processes.

    weights = SharedWeights.of(policy, version)     # the policy in shared memory, tagged with its version
    pool = RolloutPool(config, task, weights, ...)  # trainer.rollout_workers processes, sampling continuously
    for step in steps:                              # the trainer's policy version is `step`
        batch = pool.next_batch(step)               # B groups, none more than trainer.max_staleness versions old
        learn(run, batch, reference, step)          # proximal log-probs (current weights), advantages, update
        weights.publish(policy, step + 1)           # workers take them before their next chunk (or segment)

Agent tasks (`rollout.task=agent`, `agent_tools`) run the same way: each worker serves its own recording
proxy (`treerl.rollout.proxy`) and plays a task's `group_size` episodes as one group, under the same
admission, staleness bound and counters; a worker beats its heartbeat every second while its episodes run.

Only the source of the batch differs from the synchronous loop (`treerl.trainer.rl.sync`): preparation,
the update, evaluation, checkpoints and metrics are the same functions. Generation never waits for
training and training waits only when no batch within the staleness bound is ready.

Off-policy correction: by default (`trainer.decoupled_loss`) the configured loss is trained as
decoupled PPO with the same advantages and aggregation: the clipped ratio is taken against the
proximal policy (the trainer's weights before this update, recomputed by `prepare`), and each
token is weighted by pi_prox / pi_behav, the behaviour log-probs being those recorded when the
token was sampled, by whichever policy version sampled it.

Resuming restarts the prompt stream at the checkpoint's step; groups in flight when it was written
are sampled again (an asynchronous run is not reproducible bit for bit: which version samples a
group depends on timing).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace

from treerl.algo import AlgoConfig
from treerl.rollout import EmbeddedSampler, Rollout
from treerl.trainer.asynchronous.pool import RolloutPool
from treerl.trainer.asynchronous.weights import SharedWeights
from treerl.trainer.core.config import Config, ConfigError
from treerl.trainer.core.precision import autocast_dtype
from treerl.trainer.core.run import Run
from treerl.trainer.rl.learn import TrainResult, evaluation_rollout, learn, load_reference, train_loop

DECOUPLABLE = ("ppo", "grpo", "dr_grpo", "rloo", "reinforce_pp")  # losses with a per-token ratio to the old policy


@dataclass
class AsyncTrainResult(TrainResult):
    """`TrainResult` plus the pool's counters at the end (summary.json: "async")."""

    counters: dict[str, int] = field(default_factory=dict)


def decoupled(algo: AlgoConfig) -> AlgoConfig:
    """The same objective with decoupled PPO's ratio: advantages, aggregation and clipping as the loss had them."""
    if algo.loss not in DECOUPLABLE:
        return algo
    return replace(algo.resolved(), loss="decoupled_ppo")


def train_async(config: Config) -> AsyncTrainResult:
    """Run asynchronous RL as configured; returns the start/end rewards and the counters."""
    started = time.perf_counter()
    if config.trainer.decoupled_loss:
        config = replace(config, algo=decoupled(config.algo))
    run = Run.start(config, temperature=config.rollout.temperature)  # its thread count leaves the workers theirs
    pool = evaluation = None
    try:
        run.check_model(config.rollout.max_context_tokens)
        if run.env.world_size > 1:
            raise ConfigError("trainer.mode=async runs the trainer in one process (its rollout workers are its "
                              "children); data parallel training is synchronous only")
        sampler = EmbeddedSampler(run.policy, version=run.start_step,  # evaluation only
                                 autocast=autocast_dtype(config.trainer.precision))
        task = Rollout(config.rollout, run.tokenizer, sampler).task
        weights = SharedWeights.of(run.policy, version=run.start_step)
        pool = RolloutPool(config, task, weights, version=run.start_step)
        reference = load_reference(config, run) if config.algo.kl_coef > 0 else None
        run.report.print(f"async: {config.trainer.rollout_workers} rollout workers, max_staleness "
                  f"{config.trainer.max_staleness}, loss {config.algo.loss}, on_update={config.trainer.on_update}")

        one_update = config.trainer.ppo_epochs == 1 and config.trainer.minibatches == 1

        def train_step(step: int) -> dict[str, float]:
            started = time.perf_counter()
            batch = pool.next_batch(step)
            metrics = learn(run, batch, reference, step, proximal_in_loss=one_update) | batch.metrics
            weights.publish(run.policy, step + 1)
            metrics["time/step"] = time.perf_counter() - started
            return metrics

        def counters() -> dict[str, dict[str, int]]:
            pool.counters.check()
            return {"async": asdict(pool.counters)}

        evaluation = evaluation_rollout(run, sampler)
        result = train_loop(run, evaluation, train_step, started, counters)
        pool.close()
        pool.counters.check()
        return AsyncTrainResult(**asdict(result), counters=asdict(pool.counters))
    finally:
        if pool is not None:
            pool.close()
        if evaluation is not None:
            evaluation.close()  # an agent task's proxy
        run.finish()

