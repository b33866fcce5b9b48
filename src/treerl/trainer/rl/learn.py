"""What both RL modes share: learning from one batch, evaluation, the reference policy, the step loop.

Steps 3 to 6 (docs/architecture.md), shared by both RL modes.

    learn(run, batch, reference, step)              # prepare (reference / proximal log-probs, advantages,
                                                    # checks), then update (ppo_epochs x minibatches)
    train_loop(run, evaluation, train_step, ...)    # evaluate, every step: train_step + log + checkpoint

The synchronous loop (`treerl.trainer.rl.sync`) gets each batch by sampling it with the current
policy; the asynchronous one (`treerl.trainer.asynchronous`) from rollout workers. Both hand a
`RolloutBatch` (training sequences + counters) to the same `learn`.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import statistics
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from treerl.algo import (
    AlgoConfig,
    LossNormalizer,
    build_loss,
    build_value_loss,
    compute_advantages,
    correct_rollout,
    fill_fields,
    validate_batch,
)
from treerl.algo.config import corrects_rollout, uses_proximal
from treerl.algo.mismatch import correction_metrics, measured_tokens, mismatch_metrics
from treerl.algo.policy import kl_penalty
from treerl.distributed import Assignment
from treerl.engine import LossFn, SequenceView
from treerl.errors import ServerError, TrainingStopped
from treerl.models import is_lora
from treerl.rollout import Rollout, RolloutBatch, RolloutStats, Sampler, tool_format_warning
from treerl.rollout.workflows.stats import environment_metrics
from treerl.rollout.workflows.trajectories import sample_rows
from treerl.trainer.core.build import load_policy
from treerl.trainer.core.config import Config, measures_mismatch
from treerl.trainer.core.learner import Learner
from treerl.trainer.core.metrics import ENV_METRICS, summarise_environments, summarise_mismatch, tree_metrics
from treerl.trainer.core.run import Run, on_main
from treerl.trainer.core.servers import ServerSampler
from treerl.trainer.core.update import update
from treerl.tree import TokenSequence

log = logging.getLogger("treerl.trainer")
EVAL_STEP = 10**9  # the "step" whose prompts and sampling seed form the fixed evaluation set
REWARD_WINDOW = 20  # training steps averaged for the first / last training reward


@dataclass
class TrainResult:
    """What `treerl train` reports at the end (also written to output_dir/summary.json)."""

    reward_start: float  # evaluation of the initial policy (NaN without evaluation)
    reward_end: float  # evaluation of the final policy
    train_reward_first: float  # mean rollout reward of the first REWARD_WINDOW steps run
    train_reward_last: float  # ... and of the last REWARD_WINDOW steps
    steps: int  # steps done (fewer than trainer.steps if a signal stopped the run)
    skipped_steps: int  # steps whose samples were all dropped
    dropped_samples: int
    seconds: float
    output_dir: str
    nonfinite_skipped: int = 0  # optimizer steps skipped for a NaN/inf loss or gradient (trainer.nonfinite=skip)
    mismatch: dict[str, float] = field(default_factory=dict)  # mismatch/* over the steps measured (summarise_mismatch)
    environments: dict[str, dict[str, float]] = field(default_factory=dict)  # rollout.env's, per environment
    # (summarise_environments): its training reward and metrics over the steps, its evaluation at start and end
    stopped_by: str | None = None  # "SIGINT" / "SIGTERM": stopped early, after a checkpoint
    held_out: dict[str, Any] = field(default_factory=dict)  # which items evaluation asks (HeldOut.summary): none
    # that training draws, unless "held_out" is false (then "how" says why)


def train_loop(run: Run, evaluation: Rollout | None, train_step: Callable[[int], dict[str, float]], started: float,
               summary: Callable[[], dict[str, Any]] = dict) -> TrainResult:
    """Evaluate, run `train_step(step)` for every step (logging, evaluating, checkpointing), evaluate again,
    write summary.json (with the keys `summary()` adds). An agent task whose tool calls no parser reads is warned
    about first."""
    config = run.config
    if warning := tool_format_warning(config.rollout, run.tokenizer):
        log.warning(warning)  # once a run, before its first episode
    done = run.start_step  # steps complete (the model is their result)
    try:
        evaluated: dict[str, dict[str, float]] = {}  # "start" / "end" -> the evaluation's per-environment metrics
        reward_start = evaluate(run, evaluation, run.start_step, "start", evaluated)
        rewards: deque[float] = deque(maxlen=REWARD_WINDOW)
        first: list[float] = []
        dropped = 0
        failing: Counter[str] = Counter()  # reason -> samples dropped in the latest steps in a row that all failed
        mismatch: list[dict[str, float]] = []  # each measured step's mismatch/* metrics
        environments: list[dict[str, float]] = []  # each step's env/* and metrics/* metrics
        for step in run.steps():
            metrics = train_step(step)
            reward = metrics["rollout/reward_mean"]
            mismatch.append({key: value for key, value in metrics.items() if key.startswith("mismatch/")})
            environments.append({key: value for key, value in metrics.items() if key.startswith(ENV_METRICS)})
            dropped += int(metrics["rollout/dropped"])
            if run.failed_steps:  # this step's every sample was dropped too (a step that trains clears them)
                failing += dropped_by_reason(metrics)
            else:
                failing = Counter()
            if not math.isnan(reward):  # NaN: a step whose samples were all dropped
                rewards.append(reward)
                if len(first) < REWARD_WINDOW:
                    first.append(reward)
            run.end_step(step, metrics, {"reward": reward, "loss": metrics.get("train/loss", float("nan")),
                                         "compression": metrics.get("batch/compression", float("nan"))})
            done = step + 1
            if done < config.trainer.steps and config.trainer.eval_every and done % config.trainer.eval_every == 0:
                evaluate(run, evaluation, done, None)  # after the step is complete: a failing server meets a whole one
            check_failed_steps(run, failing)
        check_some_step_trained(run, failing)
        reward_end = (float("nan") if run.stopped_by
                      else evaluate(run, evaluation, config.trainer.steps, "end", evaluated))
    except ServerError as e:
        raise stopped_by_server(run, done, e) from None
    result = TrainResult(
        reward_start=reward_start, reward_end=reward_end,
        train_reward_first=_mean(first), train_reward_last=_mean(rewards),
        steps=run.steps_done, skipped_steps=run.loop_state.skipped_steps, dropped_samples=dropped,
        seconds=time.perf_counter() - started, output_dir=config.trainer.output_dir,
        nonfinite_skipped=run.loop_state.nonfinite_skipped, stopped_by=run.stopped_by,
        mismatch=summarise_mismatch(mismatch), environments=summarise_environments(environments, evaluated),
        held_out=held_out_summary(evaluation),
    )
    run.report.summarise(asdict(result) | summary(), f"training reward: first {len(first)} steps "
                  f"{result.train_reward_first:.3f} -> last {len(rewards)} steps {result.train_reward_last:.3f}")
    return result


def stopped_by_server(run: Run, done: int, error: ServerError) -> ServerError:
    """An inference server failed after `done` complete steps: they are checkpointed (unless they already are), and
    the error's one line says where the run stands and how it goes on."""
    if done >= run.config.trainer.steps:
        where = (f"every step trained; checkpoint {run.checkpoint(done)}; the final evaluation could not run (the "
                 "checkpoint serves as the trained policy: treerl export)")
    elif done > run.start_step:
        where = (f"stopped after step {done} of {run.config.trainer.steps}; checkpoint {run.checkpoint(done)} "
                 "(continue with trainer.resume=auto once the server runs again)")
    elif done > 0:
        where = f"nothing trained since the resume at step {done} (continue with trainer.resume=auto)"
    else:
        where = "nothing was trained"
    return ServerError(f"{error}; {where}", status=error.status)


def learn(run: Run, batch: RolloutBatch, reference: Reference | None, step: int,
          proximal_in_loss: bool = False) -> dict[str, float]:
    """Prepare and update on one batch (or skip the step if every sample was dropped); the step's metrics.

    `proximal_in_loss` (decoupled PPO with one optimizer step per batch): the proximal policy is the
    very policy the update differentiates, so its log-probs are taken, detached, from the update's
    own forward instead of an extra no-grad pass over the batch (see `policy_loss`); each rank then
    shares those of its sequences. A decoupled `rollout_correction` preset fixes its weights and
    rejections before the update, so it takes the pass.
    """
    metrics = batch.stats.metrics() | environment_metrics(batch.sequences)
    report_dropped(run, step, batch.stats)
    report_samples(run, step, batch, "train")
    if batch.sequences:
        run.failed_steps.clear()
        metrics.update(tree_metrics(batch.sequences))
        algo = run.config.algo.resolved()
        proximal_in_loss = proximal_in_loss and uses_proximal(algo) and not corrects_rollout(algo)
        prepared = time.perf_counter()
        behaviour = prepare(run, batch.sequences, reference, proximal_in_loss)
        metrics["time/logprobs"] = time.perf_counter() - prepared
        computed: list[TokenSequence] = []  # with proximal_in_loss: the sequences whose loss ran on this rank
        metrics.update(update(run, batch.sequences, step,
                              lambda minibatch: policy_loss(algo, minibatch, proximal_in_loss, computed)))
        if proximal_in_loss:
            share_computed(batch.sequences, computed, ["prox_logprobs"])
        if behaviour is not None:  # after the update: with proximal_in_loss its forward gave the trainer's log-probs
            metrics.update(step_mismatch(run.config, batch.sequences, behaviour, step))
        if run.critic is not None:
            metrics.update(update_critic(run, batch.sequences, step, algo))
    else:  # every sample was dropped: nothing to learn from, the schedule still advances
        run.loop_state.skipped_steps += 1
        run.failed_steps.append((step, first_failure(batch.stats)))
        run.report.print(f"step {step}: every sample was dropped ({dict(batch.stats.dropped)}); step skipped")
    metrics["trainer/skipped_steps"] = run.loop_state.skipped_steps
    return metrics


def first_failure(stats: RolloutStats) -> str:
    """Why a step's first sample was dropped, on one line (or its counts, when no sample was reported)."""
    if not stats.dropped_samples:
        return f"dropped: {dict(stats.dropped)}" if stats.dropped else "the step had no samples"
    sample = stats.dropped_samples[0]
    reason = " ".join(sample.reason.split())  # an exception's message may span lines
    return f"[{sample.group}] {reason[:500]}"


def dropped_by_reason(metrics: dict[str, float]) -> Counter[str]:
    """A step's dropped samples by reason, from its `rollout/dropped_<reason>` metrics."""
    prefix = "rollout/dropped_"
    return Counter({key.removeprefix(prefix): int(value) for key, value in metrics.items() if key.startswith(prefix)})


def check_failed_steps(run: Run, failing: Counter[str]) -> None:
    """Stop the run after `trainer.max_failed_steps` consecutive steps whose every sample was dropped: a broken reward,
    agent or server, not bad luck; the reasons, what to change and the first failure are named (all are in
    dropped.jsonl)."""
    limit, failed = run.config.trainer.max_failed_steps, run.failed_steps
    if not limit or len(failed) < limit:
        return
    raise TrainingStopped(f"every sample of {len(failed)} steps in a row (steps {failed[0][0]}-{failed[-1][0]}) was "
                          f"dropped ({reasons(failing)}; trainer.max_failed_steps={limit}): "
                          f"{why_dropped(run, failing)}")


def check_some_step_trained(run: Run, failing: Counter[str]) -> None:
    """A run none of whose steps trained (every sample of every step dropped, in fewer steps than
    `trainer.max_failed_steps`, or with it 0) stops with exit code 3 naming why and what to change: it did not
    finish, whatever its NaN reward would say. A run a signal stopped is left to the signal."""
    failed, ran = run.failed_steps, run.steps_done - run.start_step
    if run.stopped_by or not ran or len(failed) < ran:
        return
    steps = f"step {failed[0][0]}" if ran == 1 else f"steps {failed[0][0]}-{failed[-1][0]}"
    raise TrainingStopped(f"no step of this run trained: every sample of {steps} was dropped ({reasons(failing)}): "
                          f"{why_dropped(run, failing)}")


def reasons(dropped: Counter[str]) -> str:
    """The reasons samples were dropped, with their counts, the most frequent first: "context_limit: 12, ..."."""
    return ", ".join(f"{kind}: {count}" for kind, count in dropped.most_common()) or "no samples"


# What to change so that samples dropped for a reason are kept (reward_* and agent_* reasons not named here: the
# reward function or the agent itself).
DROP_REMEDIES = {
    "context_limit": "raise rollout.max_context_tokens (a prompt and its reply budget, rollout.max_new_tokens, must "
                     "fit in it)",
    "agent_context_limit": "raise rollout.max_context_tokens (every call of an episode must fit in it)",
    "reward_timeout": "raise rollout.reward_timeout",
    "env_timeout": "raise rollout.env_timeout",
    "agent_timeout": "raise rollout.episode_timeout",
}


def drop_remedy(kind: str) -> str:
    """What to change so that samples dropped for `kind` (a RolloutStats.dropped reason) are kept."""
    if kind in DROP_REMEDIES:
        return DROP_REMEDIES[kind]
    if kind.startswith("reward_"):
        return "fix the reward (rollout.reward_fn, or what the agent or environment returns)"
    if kind.startswith("agent_"):
        return "fix the agent (rollout.agent)"
    if kind.startswith("env_"):
        return "fix the environment or its arguments (rollout.env, rollout.env_args)"
    return f"see dropped.jsonl for why ({kind})"


def why_dropped(run: Run, failing: Counter[str]) -> str:
    """What to change for the reasons in `failing`, the first failure of the failed steps, and where all of them are."""
    remedies = "; ".join(dict.fromkeys(drop_remedy(kind) for kind in failing)) or "see the warnings above"
    return (f"{remedies}; the first failure: {run.failed_steps[0][1]}; all of them in "
            f"{Path(run.config.trainer.output_dir) / 'dropped.jsonl'}")


def update_critic(run: Run, sequences: list[TokenSequence], step: int, algo: AlgoConfig) -> dict[str, float]:
    """The critic's passes over the batch (the policy's epochs and minibatches), towards the GAE returns;
    its metrics under critic/ (value_loss, value_clip_fraction, grad_norm, lr) and time/critic_update."""
    metrics = update(run, sequences, step,
                     lambda minibatch: build_value_loss(algo, LossNormalizer.from_sequences(minibatch)),
                     learner=run.critic)
    renamed = {f"critic/{key.removeprefix('train/')}": value for key, value in metrics.items()
               if key.startswith("train/") and key not in ("train/loss", "train/updates")}
    renamed["time/critic_update"] = metrics["time/update"]
    return renamed


# ---------------------------------------------------------------------- rollout
def collect(run: Run, rollout: Rollout, step: int) -> RolloutBatch:
    """The global batch of `step`, the same on every rank (with servers: sampled by their current policy version,
    pushed first if they lag)."""
    servers = rollout.sampler if isinstance(rollout.sampler, ServerSampler) else None
    if servers is not None:
        servers.sync()
    if run.env.world_size == 1:
        return rollout.collect(step)
    if rollout.proxy is not None and servers is None:
        raise RuntimeError("agent tasks under torchrun need an inference server (rollout.server_url): their episodes "
                           "are not reproducible, so the ranks cannot each sample the same batch")
    if servers is not None:  # a server's samples need not be reproducible: rank 0 asks (its failure raised on all)
        return on_main(run.env, lambda: rollout.collect(step))
    with run.actor.dp.gathered():
        batch = rollout.collect(step)
    check_same_batch(batch.sequences)
    return batch


def check_same_batch(sequences: list[TokenSequence]) -> None:
    """Every rank must have sampled the same batch; compare a fingerprint (tokens and rewards) across ranks."""
    digest = hashlib.sha256(repr([(s.name, s.info.get("reward")) for s in sequences]).encode())
    for seq in sequences:
        digest.update(seq.tokens.numpy().tobytes())
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, digest.hexdigest())
    if len(set(gathered)) != 1:
        raise RuntimeError(
            "the ranks sampled different batches (their weights or rollout configs differ); every rank must "
            "start from the same model and config"
        )


def evaluation_rollout(run: Run, sampler: Sampler) -> Rollout | None:
    """The fixed evaluation set (`trainer.eval_prompts` prompts of the task's held-out items), sampled like the
    training rollout; None: no evaluation."""
    config = run.config
    if not config.trainer.eval_prompts:
        return None
    return Rollout(replace(config.rollout, prompts_per_step=config.trainer.eval_prompts), run.tokenizer, sampler,
                   run.images, held_out=True)


def held_out_summary(evaluation: Rollout | None) -> dict[str, Any]:
    """summary.json's "held_out": which items evaluation asked, and how many prompts ({} without evaluation)."""
    if evaluation is None:
        return {}
    return evaluation.task.held_out.summary(evaluation.config.prompts_per_step)


def evaluate(run: Run, evaluation: Rollout | None, step: int, label: str | None,
             environments: dict[str, dict[str, float]] | None = None) -> float:
    """Mean reward of the current policy on the fixed evaluation prompts (logged as eval/*; printed with a label, and
    its per-environment metrics kept in `environments[label]`)."""
    if evaluation is None:
        return float("nan")
    batch = collect(run, evaluation, EVAL_STEP)
    report_samples(run, step, batch, "eval")
    stats = batch.stats
    metrics = {f"eval/{k.removeprefix('rollout/')}": v
               for k, v in (stats.metrics() | environment_metrics(batch.sequences)).items()}
    run.report.log(step, metrics)
    if label is not None and environments is not None:  # per environment, for summary.json
        environments[label] = environment_metrics(batch.sequences)
    if label is not None:
        config = run.config.rollout
        if label == "start":  # which items: once, after the first evaluation drew them
            held_out = evaluation.task.held_out
            line = f"evaluation asks {held_out.how}"
            if held_out.held_out:
                run.report.print(line)
            else:
                log.warning(line)
        run.report.print(f"mean reward at {label}: {stats.reward_mean:.3f} (evaluation: {stats.samples} samples of "
                  f"{config.task}, {evaluation.config.prompts_per_step} prompts x {config.group_size}, step {step})")
    return stats.reward_mean


def report_samples(run: Run, step: int, batch: RolloutBatch, split: str) -> None:
    """`trainer.log_samples` of the batch's trajectories (spread over its prompts) and the dropped samples it reported,
    as text, to output_dir/samples.jsonl; `split`: "train", or "eval" (an evaluation before step `step`)."""
    limit = run.config.trainer.log_samples
    if limit and run.env.is_main:
        rows = sample_rows(batch.sequences, batch.stats, run.tokenizer, limit)
        run.report.write_jsonl("samples.jsonl", [{"step": step, "split": split, **row} for row in rows])


def report_dropped(run: Run, step: int, stats: RolloutStats) -> None:
    """Dropped samples, with their text, go to output_dir/dropped.jsonl (the counters go to the metrics)."""
    if stats.dropped_samples:
        run.report.write_jsonl("dropped.jsonl", [{"step": step, **asdict(s)} for s in stats.dropped_samples])


# ---------------------------------------------------------------------- batch preparation
@dataclass
class Reference:
    """The policy the KL penalty measures against: the initial policy, frozen.

    A full copy of it (`copy`), or with LoRA the policy itself with its adapters switched off
    (`adapters_of`): its base is the initial policy, and no second model is held in memory.
    """

    copy: torch.nn.Module | None = None
    adapters_of: Learner | None = None

    @contextlib.contextmanager
    def model(self) -> Iterator[torch.nn.Module]:
        """The reference model, for the duration of the block."""
        if self.copy is not None:
            yield self.copy
            return
        assert self.adapters_of is not None
        with self.adapters_of.dp.gathered() as policy, policy.disable_adapter():
            yield policy


def load_reference(config: Config, run: Run) -> Reference:
    """The frozen initial policy (with LoRA: the base under the adapters; else a full copy on every rank)."""
    if is_lora(run.policy):
        return Reference(adapters_of=run.actor)
    model, _ = load_policy(config.model, next(run.policy.parameters()).device)
    model.eval()
    model.requires_grad_(False)
    return Reference(copy=model)


def prepare(run: Run, sequences: list[TokenSequence], reference: Reference | None,
            proximal_in_loss: bool = False) -> list[torch.Tensor] | None:
    """Fill the log-prob fields the loss reads, then the advantages; every check before the first update. Returns the
    sampler's log-probs of each sequence when the step measures the mismatch (None when it does not).

    `old_logprobs` are the rollout's behaviour log-probs unless `trainer.recompute_logprobs`.
    Each rank runs the no-grad forwards for its own share of the batch and the fields are then
    shared, so every rank ends with the same complete batch. With `proximal_in_loss` the
    `prox_logprobs` field is a copy of `old_logprobs` that the loss replaces before reading it.
    A step that measures the mismatch with no pass of the trainer's own runs one for `prox_logprobs`.
    """
    algo = run.config.algo.resolved()
    assignment = run.balancer.assign(sequences)
    behaviour = [seq.fields["old_logprobs"] for seq in sequences] if measures_mismatch(run.config) else None
    proximal = uses_proximal(algo) and not proximal_in_loss
    policy_fields = (["old_logprobs"] if run.config.trainer.recompute_logprobs else []) + (
        ["prox_logprobs"] if proximal else [])
    if behaviour is not None and not policy_fields and not proximal_in_loss:
        policy_fields = ["prox_logprobs"]  # the trainer's log-probs the sampler's are measured against
    # every rank enters each gathered() (FSDP2: a collective), whatever its share holds
    parts = _parts_of_this_rank(run, assignment, sequences)
    if policy_fields:
        with run.actor.dp.gathered() as policy:
            _fill(run.actor, policy, sequences, parts, {"logprobs": policy_fields[0]})
        for _, indices in parts:
            for i in indices:
                for name in policy_fields[1:]:
                    sequences[i].fields[name] = sequences[i].fields[policy_fields[0]].clone()
    if reference is not None:
        with reference.model() as model:
            _fill(run.actor, model, sequences, parts, {"logprobs": "ref_logprobs"})
    if run.critic is not None:  # V(s_t) for GAE, and V_old for the clipped value loss
        with run.critic.dp.gathered() as critic:
            _fill(run.critic, critic, sequences, parts, {"values": "values"})
    filled = [i for _, indices in parts for i in indices]
    share_fields(sequences, filled, policy_fields + (["ref_logprobs"] if reference is not None else [])
                 + (["values"] if run.critic is not None else []))
    if proximal_in_loss:
        for seq in sequences:
            seq.fields["prox_logprobs"] = seq.fields["old_logprobs"].clone()
    compute_advantages(algo, sequences)
    correct_rollout(algo, sequences)  # after the advantages: they read the loss mask as sampled
    validate_batch(algo, sequences)
    return behaviour


def step_mismatch(config: Config, sequences: list[TokenSequence], behaviour: list[torch.Tensor],
                  version: int) -> dict[str, float]:
    """mismatch/*: the sampler's log-probs against the trainer's at the weights of `version` (the proximal pass, or
    old_logprobs recomputed), on the tokens that version sampled; rollout_correction/*: what a decoupled preset did."""
    algo = config.algo.resolved()
    recomputed = config.trainer.recompute_logprobs and "prox_logprobs" not in sequences[0].fields
    name = "old_logprobs" if recomputed else "prox_logprobs"  # a missing pass fails here, never measures 0
    metrics = mismatch_metrics([seq.fields[name] for seq in sequences], behaviour,
                               [measured_tokens(seq, version) for seq in sequences])
    if corrects_rollout(algo):
        metrics.update(correction_metrics(sequences))
    return metrics


def _fill(learner: Learner, model: torch.nn.Module, sequences: list[TokenSequence],
          parts: list[tuple[bool, list[int]]], outputs: dict[str, str]) -> None:
    """`fill_fields` on this rank's parts with the learner's engine: unsplit for the sequences the rank runs alone."""
    for alone, indices in parts:
        if indices:
            engine = learner.engine_alone if alone else learner.engine
            fill_fields(engine, model, [sequences[i] for i in indices], outputs)


def _parts_of_this_rank(run: Run, assignment: Assignment, sequences: list[TokenSequence]
                        ) -> list[tuple[bool, list[int]]]:
    """The sequences this rank's no-grad passes run: its group's share, under context parallelism those its group
    splits and (alone: True) those it runs by itself, as its updates do (`Balancer.context_split`)."""
    split = run.balancer.context_split(assignment, sequences)
    if split is None:
        return [(False, assignment.sequences(run.balancer.data_rank))]
    return [(False, [i for batch in split.together for i in batch]),
            (True, [i for batch in split.alone[run.balancer.context_rank] for i in batch])]


def share_fields(sequences: list[TokenSequence], filled: list[int], names: list[str]) -> None:
    """Each rank filled `names` for its sequences `filled` (context-parallel peers the same ones); afterwards every
    rank has them for all."""
    if not names or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    local = {i: {n: sequences[i].fields[n].cpu() for n in names} for i in filled}
    gathered: list[dict] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, local)
    for part in gathered:
        for i, values in part.items():
            sequences[i].fields.update(values)


def share_computed(sequences: list[TokenSequence], computed: list[TokenSequence], names: list[str]) -> None:
    """Fields this rank's losses wrote into `computed` (some of `sequences`), afterwards on every rank for all."""
    index = {id(seq): i for i, seq in enumerate(sequences)}
    share_fields(sequences, sorted({index[id(seq)] for seq in computed}), names)


# ---------------------------------------------------------------------- the loss
def policy_loss(algo: AlgoConfig, minibatch: list[TokenSequence], proximal_in_loss: bool = False,
                computed: list[TokenSequence] | None = None) -> LossFn:
    """The algorithm's loss normalised over the whole (global) minibatch, plus `approx_kl` to the old policy.

    `proximal_in_loss`: decoupled PPO's proximal log-probs are the current ones, detached (valid
    only when the minibatch is the whole batch and its only update: then the proximal policy is
    the policy being differentiated); each sequence given them is appended to `computed`.
    """
    normalizer = LossNormalizer.from_sequences(minibatch)
    loss_fn = build_loss(algo, normalizer)

    def with_approx_kl(view: SequenceView):
        if proximal_in_loss:
            view.fields["prox_logprobs"] = view.logprobs.detach()
            if computed is not None:
                computed.append(view.sequence)
        loss, metrics = loss_fn(view)
        logp = view.logprobs.detach()
        mask = view.fields["loss_mask"].to(logp)
        kl = kl_penalty(view.fields["old_logprobs"].to(logp), logp, mask, "k3")  # KL(pi_old || pi) from old's samples
        metrics["approx_kl"] = normalizer.aggregate(kl, mask, "token_mean")
        return loss, metrics

    return with_approx_kl


def _mean(values) -> float:
    values = list(values)
    return statistics.fmean(values) if values else float("nan")
