"""What every training loop (RL and SFT) shares: ranks, the policy, its optimizer, the engine, outputs.

    run = Run.start(config)              # ranks, seeds, tokenizer, model + DP wrapper, AdamW, schedule, resume
    for step in run.steps():             # from the resumed step on; a progress bar on rank 0
        metrics = run.update(minibatch, loss_fn)   # one optimizer step on a global minibatch
        run.end_step(step, metrics)      # LR schedule, metrics, checkpoint
    run.finish()

Under torchrun every rank holds the same global batch. `update` balances it over the ranks
(treerl.distributed.balance: trees kept together, micro-batches under `trainer.micro_batch_tokens`),
runs this rank's micro-batches inside one `gradient_step` (a single gradient sync, SUM over
ranks), clips and steps. The loss must be normalised by the GLOBAL minibatch
(`LossNormalizer.from_sequences(minibatch)`), so the summed gradient equals the one-process one.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import random
import sys
import warnings
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist
import yaml
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from treerl.algo import build_critic
from treerl.attention import UnsupportedModel
from treerl.distributed import (
    Assignment,
    CostModel,
    DistEnv,
    DistributedModel,
    balance,
    evaluate,
    init_distributed,
    tree_features,
)
from treerl.engine import AutocastEngine, DfsEngine, Engine, FlatEngine, LossFn, PackedEngine, PolicyHead, ValueHead
from treerl.engine.base import check_model
from treerl.engine.support import check_no_dropout
from treerl.errors import TrainingStopped
from treerl.models import add_lora, base_fingerprint, build_model, check_model_dir, is_lora
from treerl.rollout import load_tokenizer
from treerl.trainer.core.checkpoint import (
    CRITIC_DIR,
    Trainable,
    check_same_base,
    checkpoint_dir,
    load_checkpoint,
    prune_checkpoints,
    save_checkpoint,
)
from treerl.trainer.core.config import Config, ConfigError, EngineConfig, ModelConfig, TrainerConfig, to_yaml
from treerl.trainer.core.metrics import MetricsLogger, json_number, sum_over_ranks
from treerl.trainer.core.optim import build_optimizer, build_scheduler
from treerl.trainer.core.precision import autocast_dtype
from treerl.trainer.core.resume import apply_hyperparameters, choose_start
from treerl.trainer.core.stopping import StopSignals
from treerl.tree import TokenSequence

log = logging.getLogger("treerl.trainer")
T = TypeVar("T")

COST_WINDOW = 256  # most recent measured micro-batches the cost model is fitted on
COST_MIN_SAMPLES = 8


def build_train_engine(config: EngineConfig, temperature: float = 1.0, head: PolicyHead | ValueHead | None = None,
                       precision: str = "fp32") -> Engine:
    """The engine `engine.name` names; its log-probs are those of softmax(logits / temperature) (or `head`'s outputs).
    Under trainer.precision=bf16-mixed every call of it runs under autocast."""
    head = head or PolicyHead(temperature=temperature, chunk_rows=config.head_chunk_rows)
    engine: Engine
    if config.name == "dfs":
        engine = DfsEngine(head=head, chunk_tokens=config.chunk_tokens, batch_tokens=config.batch_tokens,
                           recompute=config.recompute, memory_budget_tokens=config.memory_budget_tokens,  # type: ignore[arg-type]
                           memory_budget_bytes=config.memory_budget_bytes)
    elif config.name == "packed":
        engine = PackedEngine(head=head, max_tokens=config.max_tokens)
    else:
        engine = FlatEngine(head=head, max_tokens=config.max_tokens)
    compute = autocast_dtype(precision)
    return AutocastEngine(engine, compute) if compute is not None else engine


def load_policy(config: ModelConfig, device: torch.device) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The model and tokenizer of `model.*`: a local checkpoint (checked first), or a random-init shape; with
    gradient checkpointing and LoRA adapters if configured."""
    if config.path is not None:
        check_model_dir(config.path, "model.path")
    tokenizer_path = config.tokenizer_path or config.path
    if config.tokenizer_path is not None and not Path(config.tokenizer_path).exists():
        raise ConfigError(f"model.tokenizer_path={config.tokenizer_path!r} does not exist")
    tokenizer = load_tokenizer(tokenizer_path, trust_remote_code=config.trust_remote_code)
    model = build_model(
        path=config.path, shape=config.shape, vocab_size=None if config.path else len(tokenizer),
        dtype=getattr(torch, config.dtype or "float32"), device=device, seed=config.seed,
        attn_implementation=config.attn_implementation, trust_remote_code=config.trust_remote_code,
    )
    model.eval()  # dropout off: the sampled and the trained policy must be one function, and recomputation exact
    vocab = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > vocab:
        raise ConfigError(f"the tokenizer has {len(tokenizer)} tokens but the model's vocabulary only {vocab}")
    if config.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    if config.lora.rank:
        model = add_lora(model, config.lora.rank, config.lora.alpha, config.lora.target_modules)
    return model, tokenizer


def enable_gradient_checkpointing(model: PreTrainedModel) -> None:
    """Recompute each decoder layer in backward (every engine is exact with it). transformers checkpoints only in
    training mode, which is the same function as eval mode only without dropout: a model with dropout is refused.
    Non-reentrant, so layers whose inputs need no gradient (a frozen base under LoRA) still pass one back."""
    if not model.supports_gradient_checkpointing:
        raise ConfigError(f"model.gradient_checkpointing=true: {type(model).__name__} does not support it")
    try:
        check_no_dropout(model)
    except UnsupportedModel as e:
        raise ConfigError(f"model.gradient_checkpointing=true needs the model in training mode: {e}") from None
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.train()


def device_for(config: ModelConfig, env: DistEnv) -> torch.device:
    return env.device if config.device == "auto" else torch.device(config.device)


def set_threads(trainer: TrainerConfig, device: torch.device) -> int:
    """Set torch's threads for this rank: `trainer.threads`, or the usable cores shared among the local ranks less
    the async workers' threads (never more than torch's own default). Warns when the CPU is oversubscribed or busy,
    which can make a step several times slower. Returns the count before."""
    before = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    workers = trainer.rollout_workers * trainer.worker_threads if trainer.mode == "async" else 0
    threads = trainer.threads or max(1, min(before, (cores - workers) // ranks))
    torch.set_num_threads(threads)
    if device.type != "cpu":
        return before
    used = threads * ranks + workers
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if used > cores:
        log.warning("%d torch threads x %d local ranks + %d async worker threads = %d threads on %d cores: threads "
                    "will wait on each other; lower trainer.threads / trainer.worker_threads", threads, ranks,
                    workers, used, cores)
    elif threads > 1 and load >= cores:
        log.warning("the CPU is busy (load average %.1f on %d cores): torch's %d threads may wait on each other and "
                    "make each step several times slower; trainer.threads=1 avoids that", load, cores, threads)
    return before


def on_main(env: DistEnv, fn: Callable[[], T]) -> T:
    """`fn()` on rank 0 only (e.g. a decision that reads and writes output_dir); its result, or its exception, on
    every rank."""
    if env.world_size == 1:
        return fn()
    box: list[Any] = [None]
    if env.is_main:
        try:
            box[0] = ("value", fn())
        except Exception as e:  # noqa: BLE001 (every rank must raise it, or the others would wait forever)
            box[0] = ("error", e)
    dist.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if kind == "error":
        raise value
    return value


def seed_everything(seed: int) -> None:
    """Python, numpy and torch generators (rollouts and minibatch order have their own, step-derived seeds)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


@dataclass
class Critic:
    """PPO's value model as this run trains it: data-parallel wrapper, AdamW, LR schedule, a ValueHead engine."""

    dp: DistributedModel
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    engine: Engine

    @property
    def model(self) -> PreTrainedModel:
        return self.dp.model


def build_run_critic(config: Config, strategy: str, vocab_size: int, device: torch.device) -> Critic:
    """The critic's body from `critic.path` (else the policy's checkpoint or shape) with a fresh value layer."""
    path = config.critic.path or config.model.path
    if config.critic.path is not None:
        check_model_dir(config.critic.path, "critic.path")
    model = build_critic(path=path, shape=config.model.shape, vocab_size=None if path else vocab_size,
                         dtype=getattr(torch, config.model.dtype), device=device, seed=config.critic.seed,
                         attn_implementation=config.model.attn_implementation,
                         trust_remote_code=config.model.trust_remote_code)
    model.eval()  # no dropout: the values the advantages use and the ones trained are one function
    schedule = dataclasses.replace(config.trainer, lr=config.critic.lr or config.trainer.lr)
    engine = build_train_engine(config.engine, head=ValueHead(), precision=config.trainer.precision)
    return Critic(*make_trainable(model, strategy, schedule), engine)


def make_trainable(model: PreTrainedModel, strategy: str, trainer: TrainerConfig,
                   ) -> tuple[DistributedModel, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """A model's data-parallel wrapper (FSDP2 gathers bfloat16 parameters under bf16-mixed), then AdamW over what
    this rank steps and trains (LoRA: the adapters only), and its LR schedule."""
    dp = DistributedModel(model, strategy, mixed_precision=autocast_dtype(trainer.precision))  # type: ignore[arg-type]
    optimizer = build_optimizer([p for p in dp.parameters() if p.requires_grad], trainer)
    return dp, optimizer, build_scheduler(optimizer, trainer)


@dataclass
class Run:
    """The state of one training run on this rank."""

    config: Config
    env: DistEnv
    tokenizer: PreTrainedTokenizerBase
    dp: DistributedModel
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    engine: Engine
    start_step: int = 0
    run_id: str = ""  # written into each checkpoint's manifest; a resumed run keeps its checkpoint's
    loop_state: dict[str, Any] = field(default_factory=dict)  # saved and restored with each checkpoint
    cost: CostModel = field(default_factory=CostModel)
    critic: Critic | None = None  # PPO's value model, when the advantages are GAE
    stop: StopSignals = field(default_factory=StopSignals)
    stopped_by: str | None = None  # "SIGINT" / "SIGTERM" when a signal ended the run early
    step: int = 0  # the step being trained
    threads_before: int = 0  # torch's thread count before the run set its own
    _saved: int = -1  # steps done at the last checkpoint
    _bar: Any = None
    _logger: MetricsLogger | None = None

    @classmethod
    def start(cls, config: Config, temperature: float = 1.0) -> Run:
        """Join the ranks, check output_dir and the checkpoint to resume, build everything, and resume."""
        config.check()
        env = init_distributed()
        if not env.is_main:  # every rank samples the same batch: rank 0 alone reports dropped samples
            logging.getLogger("treerl").setLevel(logging.ERROR)
        device = device_for(config.model, env)
        threads_before = set_threads(config.trainer, device)
        try:
            run = cls._build(config, env, device, temperature)
        except BaseException:
            torch.set_num_threads(threads_before)
            raise
        run.threads_before = threads_before
        run.stop.install()
        return run

    @classmethod
    def _build(cls, config: Config, env: DistEnv, device: torch.device, temperature: float) -> Run:
        """Claim output_dir, build the policy (and critic) with their optimizers, load the checkpoint to resume."""
        start = on_main(env, lambda: choose_start(config))  # before anything is built or written
        seed_everything(config.trainer.seed)
        model, tokenizer = load_policy(config.model, device)
        base = base_fingerprint(model) if is_lora(model) else None  # before sharding: the full frozen weights
        strategy = config.trainer.data_parallel
        if strategy == "auto":
            strategy = "ddp" if env.world_size > 1 else "none"
        dp, optimizer, scheduler = make_trainable(model, strategy, config.trainer)
        engine = build_train_engine(config.engine, temperature, precision=config.trainer.precision)
        run = cls(config, env, tokenizer, dp, optimizer, scheduler, engine, run_id=start.run_id,
                  loop_state={"skipped_steps": 0, "nonfinite_skipped": 0, "cost_samples": [], "lora_base": base})
        if config.algo.resolved().advantage == "gae":
            run.critic = build_run_critic(config, strategy, len(tokenizer), device)
        if start.path is not None:
            run.start_step, loop_state = load_checkpoint(start.path, run.trainables())
            check_same_base(start.path, loop_state.get("lora_base"), base)
            run.loop_state.update(loop_state)
            run._saved = run.start_step
            apply_hyperparameters(run.trainables()[""], config.trainer.lr, config.trainer)
            if run.critic is not None:
                critic_lr = config.critic.lr or config.trainer.lr
                apply_hyperparameters(run.trainables()[CRITIC_DIR], critic_lr, config.trainer)
            run._fit_cost_model()
            run.print(f"resumed from {start.path} at step {run.start_step}")
        return run

    @property
    def policy(self) -> PreTrainedModel:
        """The transformers model itself (what engines and the sampler call)."""
        return self.dp.model

    @property
    def logger(self) -> MetricsLogger | None:
        """metrics.jsonl and TensorBoard (rank 0; None elsewhere), opened at the first metric, so a run that fails
        while it sets up (a bad data row, a reward that does not import) writes nothing into output_dir."""
        if self._logger is None and self.env.is_main:
            trainer = self.config.trainer
            self._logger = MetricsLogger(trainer.output_dir, trainer.tensorboard, self.start_step,
                                         wandb_project=trainer.wandb_project if trainer.wandb else None,
                                         wandb_name=trainer.wandb_name, run_config=yaml.safe_load(to_yaml(self.config)))
        return self._logger

    def check_model(self, longest: int) -> None:
        """Refuse, before any compute or output, a model (or critic) the engine cannot train exactly."""
        parts = [(self.policy, self.engine)] + ([(self.critic.model, self.critic.engine)] if self.critic else [])
        for model, engine in parts:
            inner = engine.engine if isinstance(engine, AutocastEngine) else engine
            check_model(model, inner.head, not isinstance(inner, FlatEngine), longest)

    def trainables(self) -> dict[str, Trainable]:
        """What a checkpoint holds: the policy ("") and, with PPO, the critic."""
        parts = {"": Trainable(self.policy, self.optimizer, self.scheduler)}
        if self.critic is not None:
            parts[CRITIC_DIR] = Trainable(self.critic.model, self.critic.optimizer, self.critic.scheduler)
        return parts

    # ------------------------------------------------------------------ the loop
    def steps(self) -> Iterator[int]:
        """Training steps from the resumed one to `trainer.steps`, with a progress bar on rank 0. After a SIGINT or
        SIGTERM it stops after the current step, with a checkpoint (`stopped_by` names the signal)."""
        show = self.env.is_main and self.config.trainer.progress
        self._bar = tqdm(total=self.config.trainer.steps, initial=self.start_step, disable=not show,
                         desc="train", dynamic_ncols=True)
        for step in range(self.start_step, self.config.trainer.steps):
            self.step = step
            yield step
            self._bar.update(1)
            self.stopped_by = self.stop.agreed()
            if self.stopped_by:
                path = self.save(step + 1) if self._saved != step + 1 else checkpoint_dir(
                    self.config.trainer.output_dir, step + 1)
                self.print(f"{self.stopped_by}: stopped after step {step + 1} of {self.config.trainer.steps}; "
                           f"checkpoint {path} (continue with trainer.resume=auto)")
                break
        self._bar.close()

    @property
    def steps_done(self) -> int:
        """Steps completed so far (all of them, unless a signal stopped the run)."""
        return self.step + 1 if self.stopped_by else self.config.trainer.steps

    def update(self, minibatch: list[TokenSequence], loss_fn: LossFn) -> dict[str, float]:
        """One policy optimizer step on a global minibatch."""
        return self._optimizer_step(self.dp, self.optimizer, self.engine, minibatch, loss_fn, record_costs=True)

    def update_critic(self, minibatch: list[TokenSequence], loss_fn: LossFn) -> dict[str, float]:
        """One critic optimizer step on a global minibatch (its metrics under train/ too: the caller renames them)."""
        assert self.critic is not None
        return self._optimizer_step(self.critic.dp, self.critic.optimizer, self.critic.engine, minibatch, loss_fn,
                                    record_costs=False)

    def _optimizer_step(self, dp: DistributedModel, optimizer: torch.optim.Optimizer, engine: Engine,
                        minibatch: list[TokenSequence], loss_fn: LossFn, record_costs: bool) -> dict[str, float]:
        """This rank's micro-batches of a global minibatch, one gradient sync, clip, step (`record_costs`: the
        measured times refit the balancer's cost model, which prices the policy's engine calls). A non-finite loss
        or gradient norm never reaches the weights (`trainer.nonfinite`)."""
        assignment = self.assign(minibatch)
        local: dict[str, float] = {"train/loss": 0.0, "perf/flat_tokens": 0.0, "perf/model_tokens": 0.0}
        measured = []
        with dp.gradient_step() as model:
            for micro_batch in assignment.micro_batches(self.env.rank):
                part = [minibatch[i] for i in micro_batch]
                stats = engine.forward_backward(model, part, loss_fn)
                local["train/loss"] += stats.loss
                local["perf/flat_tokens"] += stats.flat_tokens
                local["perf/model_tokens"] += stats.model_tokens
                for key, value in stats.metrics.items():
                    local[f"train/{key}"] = local.get(f"train/{key}", 0.0) + value
                measured.append((tree_features(part), stats.seconds))
        if record_costs:
            self._record_costs(measured)
        metrics = sum_over_ranks(local)
        if self.env.world_size > 1:
            balance_stats = evaluate(assignment, minibatch, self.cost)
            metrics["dist/imbalance"] = balance_stats.imbalance  # estimated max / mean cost over ranks
            metrics["dist/compression_kept"] = balance_stats.compression_kept  # 1: no shared prefix computed twice
            metrics["dist/micro_batches"] = balance_stats.micro_batches
        metrics["train/grad_norm"] = self._clip_gradients(dp)
        metrics["train/lr"] = optimizer.param_groups[0]["lr"]
        # The loss is summed over ranks and the norm is of the synced gradients: every rank sees the same numbers,
        # so every rank takes the same branch.
        if not (math.isfinite(metrics["train/loss"]) and math.isfinite(metrics["train/grad_norm"])):
            optimizer.zero_grad(set_to_none=True)
            self._nonfinite(dp, metrics)
            metrics["train/nonfinite_skipped"] = 1.0
            return metrics
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        metrics["train/nonfinite_skipped"] = 0.0
        return metrics

    def _nonfinite(self, dp: DistributedModel, metrics: dict[str, float]) -> None:
        """A NaN/inf loss or gradient norm: stop (TrainingStopped), or count the skipped optimizer step."""
        which = "critic" if self.critic is not None and dp is self.critic.dp else "policy"
        what = (f"{which} loss {metrics['train/loss']}, gradient norm {metrics['train/grad_norm']} at step "
                f"{self.step}")
        if self.config.trainer.nonfinite == "stop":
            raise TrainingStopped(
                f"non-finite {what}: stopped before the optimizer step, so no weight changed and nothing was "
                "written (the newest checkpoint is the last good state). Look for NaN/inf in the model's weights "
                "and the rewards, lower trainer.lr or an algo coefficient, or set trainer.nonfinite=skip")
        self.loop_state["nonfinite_skipped"] = self.loop_state.get("nonfinite_skipped", 0) + 1
        log.warning("non-finite %s: optimizer step skipped (trainer.nonfinite=skip; %d so far)", what,
                    self.loop_state["nonfinite_skipped"])

    def assign(self, sequences: list[TokenSequence]) -> Assignment:
        """The same balanced assignment on every rank (a deterministic function of the batch and cost model)."""
        return balance(sequences, self.env.world_size, self.config.trainer.micro_batch_tokens, cost=self.cost)

    def end_step(self, step: int, metrics: dict[str, float], postfix: dict[str, float] | None = None) -> None:
        """After a step: advance the LR schedule, log (rank 0), checkpoint when due."""
        with warnings.catch_warnings():  # a skipped step (no samples) advances the schedule without an optimizer step
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
            self.scheduler.step()
            if self.critic is not None:
                self.critic.scheduler.step()
        trainer = self.config.trainer
        if self.logger is not None and (step % trainer.log_every == 0 or step + 1 == trainer.steps):
            self.logger.log(step, metrics)
        if postfix and self._bar is not None:
            self._bar.set_postfix({k: f"{v:.3f}" for k, v in postfix.items()}, refresh=False)
        done = step + 1
        if (trainer.save_every and done % trainer.save_every == 0) or (done == trainer.steps and trainer.save_final):
            self.save(done)

    def save(self, steps_done: int) -> Path:
        """A checkpoint after `steps_done` steps, policy and critic in one atomic directory (every rank calls this;
        rank 0 writes); then the run's own older checkpoints beyond `trainer.keep_checkpoints` are deleted."""
        path = checkpoint_dir(self.config.trainer.output_dir, steps_done)
        save_checkpoint(path, self.trainables(), self.tokenizer, steps_done, self.loop_state, to_yaml(self.config),
                        self.run_id, self.env.is_main)
        self._saved = steps_done
        if self.env.is_main:
            prune_checkpoints(self.config.trainer.output_dir, self.config.trainer.keep_checkpoints, self.run_id)
        return path

    def summarise(self, summary: dict[str, Any], line: str) -> None:
        """The run's last line on the console, and output_dir/summary.json (rank 0; NaN written as null)."""
        output = Path(self.config.trainer.output_dir)
        self.print(f"{line}; {summary['seconds']:.0f} s; metrics in {output / 'metrics.jsonl'}")
        if self.env.is_main:
            summary = {key: json_number(value) for key, value in summary.items()}
            output.mkdir(parents=True, exist_ok=True)
            (output / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")

    def print(self, message: str) -> None:
        """A line on rank 0's console that does not break the progress bar."""
        if self.env.is_main:
            tqdm.write(message)

    def finish(self) -> None:
        """Close the outputs, put back the signal handlers and torch's thread count.

        Called from `finally`: while an exception unwinds this rank, no barrier (the other ranks may be
        inside a collective this rank will never join; its exit ends them instead of a silent hang).
        """
        self.stop.restore()
        torch.set_num_threads(self.threads_before)
        if self._logger is not None:
            self._logger.close()
        if dist.is_available() and dist.is_initialized() and sys.exc_info()[0] is None:
            dist.barrier()

    # ------------------------------------------------------------------ internals
    def _clip_gradients(self, dp: DistributedModel) -> float:
        """The global gradient norm before clipping (gradients are already summed over ranks)."""
        parameters = [p for p in dp.parameters() if p.grad is not None]
        if not parameters:
            return 0.0
        max_norm = self.config.trainer.max_grad_norm
        norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm if max_norm is not None else float("inf"))
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    def _record_costs(self, measured: list[tuple[np.ndarray, float]]) -> None:
        """Keep every rank's measured (tree features, seconds) and refit the cost model the same way on each rank."""
        if self.env.world_size == 1 or not self.config.trainer.fit_cost_model:
            return
        gathered: list[list] = [[] for _ in range(self.env.world_size)]
        dist.all_gather_object(gathered, measured)
        samples = deque(self.loop_state["cost_samples"], maxlen=COST_WINDOW)
        samples.extend((features.tolist(), float(seconds))  # plain lists: a checkpoint holds no numpy objects
                       for rank_samples in gathered for features, seconds in rank_samples)
        self.loop_state["cost_samples"] = list(samples)
        self._fit_cost_model()

    def _fit_cost_model(self) -> None:
        samples = self.loop_state.get("cost_samples", [])
        if len(samples) >= COST_MIN_SAMPLES:
            fitted = CostModel.from_features([f for f, _ in samples], [s for _, s in samples])
            if any(w > 0 for w in fitted.weights):  # all zero would price every plan alike
                self.cost = fitted
