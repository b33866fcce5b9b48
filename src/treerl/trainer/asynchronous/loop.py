"""Asynchronous RL (`trainer.mode=async`): rollout workers sample while the trainer updates (AReaL's design).

Drives steps 1 to 6 (docs/architecture.md) with step 1 in worker processes.

    weights = SharedWeights.of(policy, version)     # the policy in shared memory, tagged with its version
    pool = RolloutPool(config, task, weights, ...)  # trainer.rollout_workers processes, sampling continuously
    for step in steps:                              # the trainer's policy version is `step`
        batch = pool.next_batch(step)               # B groups, none more than trainer.max_staleness versions old
        learn(run, batch, reference, step)          # proximal log-probs (current weights), advantages, update
        weights.publish(policy, step + 1)           # workers take them before their next chunk (or segment)

With inference servers (`rollout.server_url`, one or several) the workers hold no model: they send
their requests to the servers (balanced), and the trainer pushes each new version to every server
before it admits groups of that version (`treerl.trainer.core.servers`). The servers tag every
token with the version that sampled it (vLLM with --enable-scale-out, SGLang), so staleness is
counted as with the embedded sampler. `trainer.on_update=finish` pushes with vLLM's pause mode
`wait` (SGLang: the load waits for the requests in flight): generations in flight finish on the
old weights; `interrupt` pauses with `keep` (SGLang: `retract`): they are frozen and resumed on the
new weights, and their later tokens carry the new version.

Agent tasks (`rollout.task=agent`, `agent_tools`) run the same way: each worker serves its own recording
proxy (`treerl.rollout.agents.proxy`) and plays a task's `group_size` episodes as one group, under the same
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

from treerl.rollout import EmbeddedSampler, Rollout, Sampler
from treerl.trainer.asynchronous.pool import RolloutPool
from treerl.trainer.asynchronous.weights import SharedWeights
from treerl.trainer.core.config import Config, ConfigError, trained_algo
from treerl.trainer.core.precision import autocast_dtype
from treerl.trainer.core.run import Run
from treerl.trainer.core.servers import ServerSampler, connect_servers
from treerl.trainer.rl.learn import TrainResult, evaluation_rollout, learn, load_reference, train_loop


@dataclass
class AsyncTrainResult(TrainResult):
    """`TrainResult` plus the pool's counters at the end (summary.json: "async")."""

    counters: dict[str, int] = field(default_factory=dict)


def train_async(config: Config) -> AsyncTrainResult:
    """Run asynchronous RL as configured; returns the start/end rewards and the counters."""
    started = time.perf_counter()
    config = replace(config, algo=trained_algo(config))
    client = connect_servers(config)  # before the model is built: an unreachable server is an error at once
    run = Run.start(config, temperature=config.rollout.temperature)  # its thread count leaves the workers theirs
    pool = evaluation = servers = None
    try:
        run.check_model(config.rollout.max_context_tokens)
        if run.env.world_size > 1:
            raise ConfigError("trainer.mode=async runs the trainer in one process (its rollout workers are its "
                              "children); data parallel training is synchronous only")
        weights = None
        if client is not None:  # the workers sample on the servers; each version is pushed before it is admitted
            servers = ServerSampler.start(run, client, pause="keep" if config.trainer.on_update == "interrupt" else "wait")
            sampler: Sampler = servers
        else:  # each worker samples with its own copy of the policy, pulled from shared memory
            sampler = EmbeddedSampler(run.policy, version=run.start_step,  # evaluation only
                                      autocast=autocast_dtype(config.trainer.precision))
            weights = SharedWeights.of(run.policy, version=run.start_step)
        task = Rollout(config.rollout, run.tokenizer, sampler, run.images).task
        pool = RolloutPool(config, task, weights, version=run.start_step)
        reference = load_reference(config, run) if config.algo.kl_coef > 0 else None
        source = f"{len(client.servers)} inference servers" if client is not None else "their own policy copies"
        run.report.print(f"async: {config.trainer.rollout_workers} rollout workers sampling on {source}, "
                         f"max_staleness {config.trainer.max_staleness}, loss {config.algo.loss}, "
                         f"on_update={config.trainer.on_update}")

        one_update = config.trainer.ppo_epochs == 1 and config.trainer.minibatches == 1

        def train_step(step: int) -> dict[str, float]:
            started = time.perf_counter()
            if servers is not None:
                servers.sync()  # the servers hold version `step` before its groups are admitted
            batch = pool.next_batch(step)
            metrics = learn(run, batch, reference, step, proximal_in_loss=one_update) | batch.metrics
            if servers is not None:
                metrics.update(servers.metrics())
                servers.version = step + 1  # pushed at the next step's start (or before the final evaluation)
            else:
                weights.publish(run.policy, step + 1)
            metrics["time/step"] = time.perf_counter() - started
            return metrics

        def counters() -> dict[str, dict[str, int]]:
            pool.counters.check()
            return {"async": asdict(pool.counters)}

        evaluation = evaluation_rollout(run, sampler)
        result = train_loop(run, evaluation, train_step, started, counters)
        pool.close()
        if servers is not None and not result.stopped_by:
            servers.finish()  # the servers end with the trained policy
        pool.counters.check()
        return AsyncTrainResult(**asdict(result), counters=asdict(pool.counters))
    finally:
        if pool is not None:
            pool.close()
        if evaluation is not None:
            evaluation.close()  # an agent task's proxy
        if servers is not None:
            servers.close()
        run.finish()
