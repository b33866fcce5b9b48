"""What every training loop (RL and SFT) shares: ranks, the policy, its optimizer, the engine, outputs.

    run = Run.start(config)              # ranks, seeds, tokenizer, model + DP wrapper, AdamW, schedule, resume
    for step in run.steps():             # from the resumed step on; a progress bar on rank 0
        metrics = run.update(minibatch, loss_fn)   # one optimizer step on a global minibatch
        run.end_step(step, metrics)      # LR schedule, metrics, checkpoint
    run.finish()

Under torchrun every rank holds the same global batch. `update` balances it over the ranks
(treerl.dist.balance: trees kept together, micro-batches under `trainer.micro_batch_tokens`),
runs this rank's micro-batches inside one `gradient_step` (a single gradient sync, SUM over
ranks), clips and steps. The loss must be normalised by the GLOBAL minibatch
(`LossNormalizer.from_sequences(minibatch)`), so the summed gradient equals the one-process one.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import warnings
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
import torch.distributed as dist
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from treerl.algo import build_critic
from treerl.dist import (
    Assignment,
    CostModel,
    DataParallel,
    DistEnv,
    balance,
    evaluate,
    init_distributed,
    tree_features,
)
from treerl.engine import DfsEngine, Engine, FlatEngine, LossFn, PackedEngine, PolicyHead, ValueHead
from treerl.models import build_model
from treerl.rollout import load_tokenizer
from treerl.trainer.checkpoint import (
    checkpoint_dir,
    find_resume_path,
    load_checkpoint,
    prune_checkpoints,
    save_checkpoint,
)
from treerl.trainer.config import Config, ConfigError, EngineConfig, ModelConfig, TrainerConfig, to_yaml
from treerl.trainer.metrics import MetricsLogger, sum_over_ranks
from treerl.trainer.optim import build_optimizer, build_scheduler
from treerl.tree import Sequence

log = logging.getLogger("treerl.trainer")

COST_WINDOW = 256  # most recent measured micro-batches the cost model is fitted on
COST_MIN_SAMPLES = 8
CRITIC_DIR = "critic"  # the critic's checkpoint, inside the policy's


def build_train_engine(config: EngineConfig, temperature: float = 1.0,
                       head: PolicyHead | ValueHead | None = None) -> Engine:
    """The engine `engine.name` names; its log-probs are those of softmax(logits / temperature) (or `head`'s outputs)."""
    head = head or PolicyHead(temperature=temperature, chunk_rows=config.head_chunk_rows)
    if config.name == "dfs":
        return DfsEngine(head=head, chunk_tokens=config.chunk_tokens, batch_tokens=config.batch_tokens,
                         recompute=config.recompute, memory_budget_bytes=config.memory_budget_bytes)  # type: ignore[arg-type]
    if config.name == "packed":
        return PackedEngine(head=head, max_tokens=config.max_tokens)
    return FlatEngine(head=head, max_tokens=config.max_tokens)


def load_policy(config: ModelConfig, device: torch.device) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The model and tokenizer of `model.*`: a local checkpoint (checked first), or a random-init shape."""
    if config.path is not None and not Path(config.path).exists():
        raise ConfigError(f"model.path={config.path!r} does not exist (treerl only loads local checkpoints)")
    tokenizer_path = config.tokenizer_path or config.path
    if tokenizer_path is not None and not Path(tokenizer_path).exists():
        raise ConfigError(f"model.tokenizer_path={tokenizer_path!r} does not exist")
    tokenizer = load_tokenizer(tokenizer_path)
    model = build_model(
        path=config.path, shape=config.shape, vocab_size=None if config.path else len(tokenizer),
        dtype=getattr(torch, config.dtype), device=device, seed=config.seed,
        attn_implementation=config.attn_implementation,
    )
    model.eval()  # dropout off: the sampled and the trained policy must be one function, and recomputation exact
    vocab = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > vocab:
        raise ConfigError(f"the tokenizer has {len(tokenizer)} tokens but the model's vocabulary only {vocab}")
    return model, tokenizer


def device_for(config: ModelConfig, env: DistEnv) -> torch.device:
    return env.device if config.device == "auto" else torch.device(config.device)


def seed_everything(seed: int) -> None:
    """Python, numpy and torch generators (rollouts and minibatch order have their own, step-derived seeds)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


@dataclass
class Critic:
    """PPO's value model as this run trains it: data-parallel wrapper, AdamW, LR schedule, a ValueHead engine."""

    dp: DataParallel
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    engine: Engine

    @property
    def model(self) -> PreTrainedModel:
        return self.dp.model


def build_run_critic(config: Config, strategy: str, vocab_size: int, device: torch.device) -> Critic:
    """The critic's body from `critic.path` (else the policy's checkpoint or shape) with a fresh value layer."""
    path = config.critic.path or config.model.path
    model = build_critic(path=path, shape=config.model.shape, vocab_size=None if path else vocab_size,
                         dtype=getattr(torch, config.model.dtype), device=device, seed=config.critic.seed,
                         attn_implementation=config.model.attn_implementation)
    model.eval()  # no dropout: the values the advantages use and the ones trained are one function
    schedule = dataclasses.replace(config.trainer, lr=config.critic.lr or config.trainer.lr)
    return Critic(*make_trainable(model, strategy, schedule), build_train_engine(config.engine, head=ValueHead()))


def make_trainable(model: PreTrainedModel, strategy: str, trainer: TrainerConfig,
                   ) -> tuple[DataParallel, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """A model's data-parallel wrapper, then AdamW over what this rank steps, and its LR schedule."""
    dp = DataParallel(model, strategy)  # type: ignore[arg-type]
    optimizer = build_optimizer(dp.parameters(), trainer)
    return dp, optimizer, build_scheduler(optimizer, trainer)


@dataclass
class Run:
    """The state of one training run on this rank."""

    config: Config
    env: DistEnv
    tokenizer: PreTrainedTokenizerBase
    dp: DataParallel
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    engine: Engine
    logger: MetricsLogger | None  # rank 0 only
    start_step: int = 0
    loop_state: dict[str, Any] = field(default_factory=dict)  # saved and restored with each checkpoint
    cost: CostModel = field(default_factory=CostModel)
    critic: Critic | None = None  # PPO's value model, when the advantages are GAE
    _bar: Any = None

    @classmethod
    def start(cls, config: Config, temperature: float = 1.0) -> Run:
        """Join the ranks, build everything, and resume from `trainer.resume` if set."""
        config.check()
        env = init_distributed()
        if not env.is_main:  # every rank samples the same batch: rank 0 alone reports dropped samples
            logging.getLogger("treerl").setLevel(logging.ERROR)
        seed_everything(config.trainer.seed)
        model, tokenizer = load_policy(config.model, device_for(config.model, env))
        strategy = config.trainer.data_parallel
        if strategy == "auto":
            strategy = "ddp" if env.world_size > 1 else "none"
        dp, optimizer, scheduler = make_trainable(model, strategy, config.trainer)
        run = cls(config, env, tokenizer, dp, optimizer, scheduler, build_train_engine(config.engine, temperature),
                  logger=None, loop_state={"skipped_steps": 0, "cost_samples": []})
        if config.algo.resolved().advantage == "gae":
            run.critic = build_run_critic(config, strategy, len(tokenizer), device_for(config.model, env))
        resume = find_resume_path(config.trainer.resume, config.trainer.output_dir)
        if resume is not None:
            run.start_step, run.loop_state = load_checkpoint(resume, dp.model, optimizer, scheduler)
            if run.critic is not None:
                if not (resume / CRITIC_DIR).exists():
                    raise FileNotFoundError(f"checkpoint {resume} has no {CRITIC_DIR}/ (it was not written by a run "
                                            "with a critic) but algo.advantage=gae needs one")
                load_checkpoint(resume / CRITIC_DIR, run.critic.model, run.critic.optimizer, run.critic.scheduler)
            run._fit_cost_model()
            run.print(f"resumed from {resume} at step {run.start_step}")
        if env.is_main:
            trainer = config.trainer
            run.logger = MetricsLogger(trainer.output_dir, trainer.tensorboard, run.start_step,
                                       wandb_project=trainer.wandb_project if trainer.wandb else None,
                                       wandb_name=trainer.wandb_name, run_config=yaml.safe_load(to_yaml(config)))
        return run

    @property
    def policy(self) -> PreTrainedModel:
        """The transformers model itself (what engines and the sampler call)."""
        return self.dp.model

    # ------------------------------------------------------------------ the loop
    def steps(self) -> Iterator[int]:
        """Training steps from the resumed one to `trainer.steps`, with a progress bar on rank 0."""
        show = self.env.is_main and self.config.trainer.progress
        self._bar = tqdm(total=self.config.trainer.steps, initial=self.start_step, disable=not show,
                         desc="train", dynamic_ncols=True)
        for step in range(self.start_step, self.config.trainer.steps):
            yield step
            self._bar.update(1)
        self._bar.close()

    def update(self, minibatch: list[Sequence], loss_fn: LossFn) -> dict[str, float]:
        """One policy optimizer step on a global minibatch."""
        return self._optimizer_step(self.dp, self.optimizer, self.engine, minibatch, loss_fn, record_costs=True)

    def update_critic(self, minibatch: list[Sequence], loss_fn: LossFn) -> dict[str, float]:
        """One critic optimizer step on a global minibatch (its metrics under train/ too: the caller renames them)."""
        assert self.critic is not None
        return self._optimizer_step(self.critic.dp, self.critic.optimizer, self.critic.engine, minibatch, loss_fn,
                                    record_costs=False)

    def _optimizer_step(self, dp: DataParallel, optimizer: torch.optim.Optimizer, engine: Engine,
                        minibatch: list[Sequence], loss_fn: LossFn, record_costs: bool) -> dict[str, float]:
        """This rank's micro-batches of a global minibatch, one gradient sync, clip, step (`record_costs`: the
        measured times refit the balancer's cost model, which prices the policy's engine calls)."""
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
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return metrics

    def assign(self, sequences: list[Sequence]) -> Assignment:
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
        """A checkpoint after `steps_done` steps (every rank calls this; rank 0 writes)."""
        path = checkpoint_dir(self.config.trainer.output_dir, steps_done)
        save_checkpoint(path, self.policy, self.optimizer, self.scheduler, self.tokenizer, steps_done,
                        self.loop_state, to_yaml(self.config), self.env.is_main)
        if self.critic is not None:  # after the policy's: writing that replaces the whole directory
            save_checkpoint(path / CRITIC_DIR, self.critic.model, self.critic.optimizer, self.critic.scheduler,
                            self.tokenizer, steps_done, {}, to_yaml(self.config), self.env.is_main)
        if self.env.is_main:
            prune_checkpoints(self.config.trainer.output_dir, self.config.trainer.keep_checkpoints)
        return path

    def summarise(self, summary: dict[str, Any], line: str) -> None:
        """The run's last line on the console, and output_dir/summary.json (rank 0)."""
        output = Path(self.config.trainer.output_dir)
        self.print(f"{line}; {summary['seconds']:.0f} s; metrics in {output / 'metrics.jsonl'}")
        if self.env.is_main:
            (output / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")

    def print(self, message: str) -> None:
        """A line on rank 0's console that does not break the progress bar."""
        if self.env.is_main:
            tqdm.write(message)

    def finish(self) -> None:
        if self.logger is not None:
            self.logger.close()
        if dist.is_available() and dist.is_initialized():
            dist.barrier()

    # ------------------------------------------------------------------ internals
    def _clip_gradients(self, dp: DataParallel) -> float:
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
        samples.extend(sample for rank_samples in gathered for sample in rank_samples)
        self.loop_state["cost_samples"] = list(samples)
        self._fit_cost_model()

    def _fit_cost_model(self) -> None:
        samples = self.loop_state.get("cost_samples", [])
        if len(samples) >= COST_MIN_SAMPLES:
            fitted = CostModel.from_features([f for f, _ in samples], [s for _, s in samples])
            if any(w > 0 for w in fitted.weights):  # all zero would price every plan alike
                self.cost = fitted
