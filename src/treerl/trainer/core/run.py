"""What every training loop (RL and SFT) shares: the run's context, and the wiring of what it trains and writes.

Around steps 1 to 6 (docs/architecture.md): the run's context and wiring.

    run = Run.start(config)              # ranks, seeds, tokenizer, policy (+ critic) learners, resume
    for step in run.steps():             # from the resumed step on; a progress bar on rank 0
        metrics = update(run, batch, step, loss_for)   # treerl.trainer.core.update: run.actor's optimizer steps
        run.end_step(step, metrics)      # LR schedule, metrics, checkpoint
    run.finish()

The pieces, each in its own module: `Learner` (learner.py: one model's optimizer step, clipping and
non-finite guard), `Balancer` (balancer.py: how a minibatch is split over the ranks, and the cost
model it learns), `Reporter` (reporter.py: progress bar, console, metrics, summary.json), and the
builders of the models, engines and learners (build.py).
"""

from __future__ import annotations

import logging
import os
import random
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from treerl.distributed import DistEnv, Mesh, build_mesh, init_distributed
from treerl.engine import AutocastEngine, DfsEngine, FlatEngine
from treerl.engine.base import check_model
from treerl.engine.routing import RoutingReplayEngine
from treerl.models import base_fingerprint, check_device, is_lora
from treerl.rollout.conversations.images import ImageProcessor
from treerl.trainer.core.balancer import Balancer
from treerl.trainer.core.build import build_critic_learner, build_policy_learner, load_policy, policy_images
from treerl.trainer.core.checkpoint import (
    CRITIC_DIR,
    Trainable,
    check_same_base,
    checkpoint_dir,
    load_checkpoint,
    prune_checkpoints,
    save_checkpoint,
)
from treerl.trainer.core.config import Config, ConfigError, ModelConfig, TrainerConfig, to_yaml
from treerl.trainer.core.inputs import check_paths
from treerl.trainer.core.learner import Learner, NonfiniteGuard
from treerl.trainer.core.loop_state import LoopState
from treerl.trainer.core.reporter import Reporter
from treerl.trainer.core.resume import apply_hyperparameters, choose_start, delete_outputs
from treerl.trainer.core.stopping import StopSignals

log = logging.getLogger("treerl.trainer")
T = TypeVar("T")


def device_for(config: ModelConfig, env: DistEnv) -> torch.device:
    """`model.device` (checked: a device this machine has), or with auto this rank's own device (its GPU under
    torchrun, else the CPU)."""
    return env.device if config.device == "auto" else check_device(config.device, "model.device")


def set_threads(trainer: TrainerConfig, device: torch.device, on_servers: bool = False) -> tuple[int, str | None]:
    """Set torch's threads for this rank: `trainer.threads`, or the cores free when the run starts (those the load
    average leaves: threads on busy cores wait on each other, and a step can take 20 times longer) shared among the
    local ranks, less the async workers' threads (none when they sample `on_servers`: they wait on HTTP; never more
    than torch's own default). Warns when trainer.threads oversubscribes the CPU. Returns the count before, and on
    the CPU the line that says what was chosen (None: trainer.threads chose)."""
    before = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    sampling = trainer.mode == "async" and not on_servers
    workers = trainer.rollout_workers * trainer.worker_threads if sampling else 0
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    free = max(1, cores - round(load))
    threads = trainer.threads or max(1, min(before, (free - workers) // ranks))
    torch.set_num_threads(threads)
    if device.type != "cpu":
        return before, None
    used = threads * ranks + workers
    if trainer.threads and used > cores:
        log.warning("%d torch threads x %d local ranks + %d async worker threads = %d threads on %d cores: threads "
                    "will wait on each other; lower trainer.threads / trainer.worker_threads", threads, ranks,
                    workers, used, cores)
    if trainer.threads:
        return before, None  # as the user set them: nothing to say (a wrapper may read the run's stdout)
    shared = (f", less {workers} for async workers" if workers else "") + (f", over {ranks} ranks" if ranks > 1 else "")
    return before, (f"torch threads: {threads} ({free} of {cores} cores free at the start, load average {load:.1f}"
                    f"{shared}; trainer.threads sets them)")


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


def data_parallel_strategy(trainer: TrainerConfig, env: DistEnv) -> str:
    """`trainer.data_parallel`, with auto resolved: DDP under torchrun, no wrapper in one process."""
    if trainer.data_parallel == "auto":
        return "ddp" if env.world_size > 1 else "none"
    return trainer.data_parallel


def run_mesh(trainer: TrainerConfig, env: DistEnv) -> Mesh:
    """The data-parallel x context-parallel grid of `trainer.context_parallel` over torchrun's ranks."""
    if env.world_size % trainer.context_parallel:
        raise ConfigError(f"trainer.context_parallel={trainer.context_parallel} must divide the {env.world_size} "
                          "ranks torchrun started (--nproc-per-node x nodes)")
    return build_mesh(env, trainer.context_parallel, trainer.context_parallel_path, trainer.context_parallel_mixers)


@dataclass
class Run:
    """The state of one training run on this rank: its context (config, ranks, tokenizer, step), what it trains
    (`actor`, the policy's learner, and PPO's `critic`) and the outputs it writes (`report`, checkpoints)."""

    config: Config
    env: DistEnv
    tokenizer: PreTrainedTokenizerBase
    images: ImageProcessor | None  # the policy's image processor (a vision-language model), for prompts with images
    actor: Learner  # the policy: its wrapper, optimizer, schedule, engine and optimizer step
    balancer: Balancer  # how each minibatch is split over the ranks
    report: Reporter
    start_step: int = 0
    run_id: str = ""  # written into each checkpoint's manifest; a resumed run keeps its checkpoint's
    loop_state: LoopState = field(default_factory=LoopState)  # counters and measured costs, saved with each checkpoint
    critic: Learner | None = None  # PPO's value model, when the advantages are GAE
    stop: StopSignals = field(default_factory=StopSignals)
    stopped_by: str | None = None  # "SIGINT" / "SIGTERM" when a signal ended the run early
    failed_steps: list[tuple[int, str]] = field(default_factory=list)  # (step, first failure): the latest steps in a
    # row whose every sample was dropped (trainer.max_failed_steps of them stop the run)
    step: int = 0  # the step being trained
    threads_before: int = 0  # torch's thread count before the run set its own
    replaces: bool = False  # output_dir holds an earlier run's outputs, deleted by `claim_output`
    _saved: int = -1  # steps done at the last checkpoint

    @classmethod
    def start(cls, config: Config, temperature: float = 1.0) -> Run:
        """Join the ranks, check the paths the run reads and writes, then output_dir and the checkpoint to resume,
        build everything, and resume."""
        config.check()
        check_paths(config)  # a missing input is said before output_dir's state (which a first run may not expect)
        env = init_distributed()
        if not env.is_main:  # every rank samples the same batch: rank 0 alone reports dropped samples
            logging.getLogger("treerl").setLevel(logging.ERROR)
        device = device_for(config.model, env)
        threads_before, chosen = set_threads(config.trainer, device, on_servers=bool(config.rollout.server_urls))
        try:
            run = cls._build(config, env, device, temperature)
        except BaseException:
            torch.set_num_threads(threads_before)
            raise
        run.threads_before = threads_before
        if chosen is not None:
            run.report.print(chosen)
        return run

    @classmethod
    def _build(cls, config: Config, env: DistEnv, device: torch.device, temperature: float) -> Run:
        """Claim output_dir, build the policy (and critic) learners, load the checkpoint to resume."""
        start = on_main(env, lambda: choose_start(config))  # before anything is built or written
        seed_everything(config.trainer.seed)
        model, tokenizer = load_policy(config.model, device)
        base = base_fingerprint(model) if is_lora(model) else None  # before sharding: the full frozen weights
        strategy = data_parallel_strategy(config.trainer, env)
        loop_state = LoopState(lora_base=base)
        balancer = Balancer(env, config.trainer, loop_state, mesh=run_mesh(config.trainer, env))
        guard = NonfiniteGuard(config.trainer.nonfinite, loop_state)
        actor = build_policy_learner(config, model, strategy, balancer, guard, temperature)
        images = policy_images(config.model, len(tokenizer))
        run = cls(config, env, tokenizer, images, actor, balancer, Reporter(config, env), run_id=start.run_id,
                  loop_state=loop_state, replaces=start.replaces)
        if config.algo.resolved().advantage == "gae":
            run.critic = build_critic_learner(config, strategy, len(tokenizer), device, balancer, guard)
        if start.path is not None:
            run._resume(start.path, base)
        return run

    def _resume(self, path: Path, base: list[float] | None) -> None:
        """Load the checkpoint at `path` (policy, critic, loop state), then apply this config's hyperparameters."""
        self.start_step, saved = load_checkpoint(path, self.trainables())
        check_same_base(path, saved.lora_base, base)
        self.loop_state.update(saved)
        self._saved = self.start_step
        apply_hyperparameters(self.actor.trainable(), self.config.trainer.lr, self.config.trainer)
        if self.critic is not None:
            critic_lr = self.config.critic.lr or self.config.trainer.lr
            apply_hyperparameters(self.critic.trainable(), critic_lr, self.config.trainer)
        self.balancer.fit()
        self.report.start_step = self.start_step
        self.report.print(f"resumed from {path} at step {self.start_step}")

    @property
    def policy(self) -> PreTrainedModel:
        """The transformers model itself (what engines and the sampler call)."""
        return self.actor.model

    def learners(self) -> list[Learner]:
        """The policy's learner, and the critic's with PPO."""
        return [self.actor] + ([self.critic] if self.critic is not None else [])

    def check_model(self, longest: int, setting: str | None = "rollout.max_context_tokens") -> None:
        """Refuse, before any compute or output, a model (or critic) the engine cannot train exactly on sequences of
        up to `longest` tokens; `setting` (the config key that bounds them) must also fit the model's positions."""
        for learner in self.learners():
            engine = learner.engine
            inner = engine
            while isinstance(inner, (AutocastEngine, RoutingReplayEngine)):  # the engine they wrap
                inner = inner.engine
            with learner.dp.gathered():  # FSDP2: the routing probe runs the model, on full parameters
                check_model(learner.model, inner.head, not isinstance(inner, FlatEngine), longest,
                            carries_state=isinstance(inner, DfsEngine))
            most = getattr(learner.model.config.get_text_config(), "max_position_embeddings", None)
            if setting is not None and isinstance(most, int) and 0 < most < longest:  # <= 0: no limit (XLNet)
                raise ConfigError(f"{setting}={longest} is more than the model's maximum of {most} positions "
                                  f"(max_position_embeddings of {type(learner.model).__name__}): set {setting}={most} "
                                  "or lower")

    def trainables(self) -> dict[str, Trainable]:
        """What a checkpoint holds: the policy ("") and, with PPO, the critic."""
        parts = {"": self.actor.trainable()}
        if self.critic is not None:
            parts[CRITIC_DIR] = self.critic.trainable()
        return parts

    # ------------------------------------------------------------------ the loop
    def steps(self) -> Iterator[int]:
        """Training steps from the resumed one to `trainer.steps`, with a progress bar on rank 0. After a SIGINT or
        SIGTERM it stops after the current step, with a checkpoint (`stopped_by` names the signal). Before the
        first step and after the last (setting up, the start and final evaluations) a signal is not caught here:
        the CLI stops at once, with one line."""
        self.stop.install()
        self.report.open_bar()
        for step in range(self.start_step, self.config.trainer.steps):
            self.step = step
            yield step
            self.report.advance()
            self.stopped_by = self.stop.agreed()
            if self.stopped_by:
                path = self.checkpoint(step + 1)
                self.report.print(f"{self.stopped_by}: stopped after step {step + 1} of {self.config.trainer.steps}; "
                                  f"checkpoint {path} (continue with trainer.resume=auto)")
                break
        self.report.close_bar()
        self.stop.restore()  # after the last step (the final evaluation, the summary) a signal stops at once

    @property
    def steps_done(self) -> int:
        """Steps completed so far (all of them, unless a signal stopped the run)."""
        return self.step + 1 if self.stopped_by else self.config.trainer.steps

    def claim_output(self) -> None:
        """The first step is trained, so the run has set up: from now on it writes into output_dir (rank 0), the
        earlier run it replaces deleted first. Everything that writes there calls this first."""
        if self.report.opened:
            return
        if self.env.is_main and self.replaces:
            delete_outputs(Path(self.config.trainer.output_dir))
        self.report.open()

    def end_step(self, step: int, metrics: dict[str, float], postfix: dict[str, float] | None = None) -> None:
        """After a step: advance the LR schedules, log (rank 0), checkpoint when due (not while no step of this run
        has trained: its weights are the ones it started from, and a run that trains none stops with exit code 3)."""
        self.claim_output()
        with warnings.catch_warnings():  # a skipped step (no samples) advances the schedule without an optimizer step
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
            for learner in self.learners():
                learner.scheduler.step()
        self.report.step(step, metrics, postfix)
        trainer, done = self.config.trainer, step + 1
        due = (trainer.save_every and done % trainer.save_every == 0) or (done == trainer.steps and trainer.save_final)
        if due and len(self.failed_steps) < done - self.start_step:
            self.save(done)

    def save(self, steps_done: int) -> Path:
        """A checkpoint after `steps_done` steps, policy and critic in one atomic directory (every rank calls this;
        rank 0 writes); then the run's own older checkpoints beyond `trainer.keep_checkpoints` are deleted."""
        self.claim_output()
        path = checkpoint_dir(self.config.trainer.output_dir, steps_done)
        save_checkpoint(path, self.trainables(), self.tokenizer, steps_done, self.loop_state, to_yaml(self.config),
                        self.run_id, self.env.is_main)
        self._saved = steps_done
        if self.env.is_main:
            prune_checkpoints(self.config.trainer.output_dir, self.config.trainer.keep_checkpoints, self.run_id)
        self.report.plot()
        return path

    def checkpoint(self, steps_done: int) -> Path:
        """The checkpoint after `steps_done` steps, written now unless it already is (every rank calls this)."""
        if self._saved == steps_done:
            return checkpoint_dir(self.config.trainer.output_dir, steps_done)
        return self.save(steps_done)

    def finish(self) -> None:
        """Close the outputs, put back the signal handlers and torch's thread count.

        Called from `finally`: while an exception unwinds this rank, no barrier (the other ranks may be
        inside a collective this rank will never join; its exit ends them instead of a silent hang).
        """
        self.stop.restore()
        torch.set_num_threads(self.threads_before)
        self.report.close()
        if dist.is_available() and dist.is_initialized() and sys.exc_info()[0] is None:
            dist.barrier()
