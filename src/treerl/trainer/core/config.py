"""The training config: one dataclass tree (model, rollout, algo, engine, trainer, sft), loaded from YAML.

Beside the steps (docs/architecture.md): every choice they read, in one tree.

    config = load_config("my_run.yaml", ["trainer.steps=100", "algo.entropy_coef=0.01"])

Layers, later ones winning: the dataclass defaults (which ARE the built-in CPU demo), the YAML
file, then `key=value` overrides (OmegaConf dotlist syntax: `rollout.branch_at=[1,2]`,
`model.path=null`). Every key is typed; an unknown key, a value of the wrong type or an
out-of-range value is a `ConfigError` naming the key. Each option is documented by the comment
next to it here (and in docs/config.md).
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field, fields, is_dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from treerl.algo import AlgoConfig
from treerl.algo.config import DECOUPLABLE, decoupled
from treerl.attention.context_parallel import MIXER_ORDERS, PATH_LAYOUTS
from treerl.engine.memory import check_memory_settings
from treerl.errors import UserError
from treerl.gguf_checkpoint import PACKAGED_MODELS
from treerl.models import DTYPES, SHAPES
from treerl.rollout import RolloutConfig
from treerl.trainer.core.precision import canonical, parameter_dtype
from treerl.tree.io import MAX_LINE_BYTES

ENGINES = ("dfs", "flat", "packed")
HEAD_ROWS = ("loss_mask", "all")
RECOMPUTE = ("auto", "always", "never")
DATA_PARALLEL = ("auto", "none", "ddp", "fsdp2")
LR_SCHEDULES = ("constant", "cosine")
CHAT_FORMATS = ("template", "plain")
MODES = ("sync", "async")
ON_UPDATE = ("finish", "interrupt")
NONFINITE = ("stop", "skip")
MAX_THREADS = 1024  # torch threads per process at most (100000 made torch crash)


class ConfigError(UserError):
    """A config that cannot run: unknown key, wrong type, bad value, missing file. Names the key."""


@dataclass
class LoraConfig:
    """LoRA adapters (pip install 'treerl[lora]'): only they train; the reference policy is the base without them."""

    rank: int = 0  # adapter rank r; 0: no LoRA, every parameter trains
    alpha: float = 32.0  # the adapters' output is scaled by alpha / rank
    target_modules: str = "all-linear"  # all-linear (every linear layer but the LM head), or module names: q_proj,v_proj


@dataclass
class ModelConfig:
    """The policy: a local transformers checkpoint, or a named shape with random weights."""

    path: str | None = None  # local checkpoint directory (config + weights, e.g. a save_pretrained dir), a GGUF file (or a directory of them), or a packaged model (smollm2-135m-instruct, gemma3-270m); never downloaded
    gguf_file: str | None = None  # model.path is a directory holding several GGUF files: the one to load (converted once, cached; docs/training.md#real-checkpoints-and-gguf-files)
    shape: str = "tiny-qwen3"  # when path is null: a shape of treerl.models.SHAPES, randomly initialised
    tokenizer_path: str | None = None  # null: the tokenizer saved with model.path; with no path, the built-in one
    dtype: str | None = None  # parameters and optimizer state; null: as trainer.precision says (float32, or bfloat16 for bf16); float64 with fp32 for exactness tests
    device: str = "auto"  # auto: this rank's GPU when CUDA is available, else cpu
    seed: int = 0  # random initialisation of a shape (the same seed gives the same weights)
    attn_implementation: str = "sdpa"  # transformers attention for the flat engine and sampling (sdpa | eager | ...)
    trust_remote_code: bool = False  # run Python code shipped with model.path (auto_map); only for code you trust
    gradient_checkpointing: bool = False  # recompute each decoder layer in backward instead of keeping its activations (less memory, ~1 more forward)
    freeze_vision_tower: bool = False  # a vision-language policy: train its language model only (the tower and its projector get no gradient)
    lora: LoraConfig = field(default_factory=LoraConfig)  # LoRA adapters (model.lora.rank > 0)


@dataclass
class CriticConfig:
    """PPO's value model, built only when the advantages are GAE (`algo.loss=ppo` or `algo.advantage=gae`)."""

    path: str | None = None  # local causal-LM checkpoint for its body; null: the policy's (model.path, or model.shape random)
    lr: float | None = None  # its AdamW learning rate (same schedule as the policy); null: trainer.lr
    seed: int = 1  # random initialisation of its value layer (and of its body when built from a shape)


@dataclass
class EngineConfig:
    """The training engine: how forward/backward walks a batch (all give the same gradients)."""

    name: str = "dfs"  # dfs (dynamic tree attention) | packed (tree mask, one call per pack) | flat (reference)
    chunk_tokens: int = 2048  # dfs: longest run of one node computed at once
    batch_tokens: int = 8192  # dfs: most tokens in one model call (tree nodes packed without padding); 0: one node per call
    recompute: str = "auto"  # dfs: auto (a cost model keeps or recomputes each graph within the budget) | always | never
    memory: str = "micro-batch"  # dfs: micro-batch (never more graph than flat's micro-batch of max_tokens tokens, or 1.5x the one-path walk when one path needs more) | one-path (1.5x the one-path walk)
    memory_budget_bytes: int | None = None  # dfs: instead, bytes held at once (autograd graph and the path's K/V, measured from the model)
    memory_budget_tokens: int | None = None  # dfs: instead, tokens of autograd graph held at once (set at most one of the two)
    max_tokens: int = 8192  # flat: tokens per packed row (no padding); packed: unique tokens per pack; dfs: the micro-batch its memory contract is measured against
    head_chunk_rows: int = 1024  # rows of the LM head computed at once (no [tokens, vocab] logits tensor); fewer where a chunk would exceed 2^26 logits (256 rows of a 262,144-token vocabulary)
    head_rows: str = "loss_mask"  # where the policy's LM head computes log-probs and entropy: loss_mask (only the positions the losses, log-prob fields and their metrics read; the others hold 0: a long prompt costs no head work) | all (every position)


@dataclass
class TrainerConfig:
    """The loop: optimisation, schedule, asynchronous rollout, checkpoints, logging, data parallelism."""

    mode: str = "sync"  # sync: collect a batch, then update on it | async: rollout workers generate while the trainer updates
    steps: int = 500  # training steps (one rollout batch, or one SFT batch, each)
    seed: int = 0  # seeds torch / numpy / random and the minibatch shuffling
    precision: str = "fp32"  # fp32 | bf16-mixed (bfloat16 compute, float32 master weights, optimizer state and gradient reduction) | bf16 (pure bfloat16); docs/training.md#precision-lora-and-gradient-checkpointing

    # Optimisation (AdamW).
    lr: float = 1e-3  # peak learning rate
    weight_decay: float = 0.0  # AdamW decoupled weight decay
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # AdamW betas
    adam_eps: float = 1e-8  # AdamW epsilon
    max_grad_norm: float | None = 1.0  # clip the global gradient norm to this; null: no clipping
    nonfinite: str = "stop"  # a NaN/inf loss or gradient norm: stop (exit code 3) | skip (no optimizer step, counted)
    max_failed_steps: int = 3  # stop (exit code 3, naming the first failure) after this many consecutive steps whose every sample was dropped; 0: never
    warmup_steps: int = 10  # linear warmup from 0 over this many training steps
    lr_schedule: str = "constant"  # after warmup: constant | cosine (down to min_lr_ratio * lr at the last step)
    min_lr_ratio: float = 0.0  # cosine: final learning rate / lr

    # PPO-style updates on each batch.
    ppo_epochs: int = 1  # passes over each batch
    minibatches: int = 1  # optimizer steps per pass; a minibatch holds whole groups (a prompt's samples stay together)
    micro_batch_tokens: int | None = None  # unique tokens per engine call on a rank; null: one call per rank
    recompute_logprobs: bool = False  # recompute old_logprobs with the training engine instead of the rollout's
    routing_replay: bool = False  # an MoE policy's routers use the experts the sampler routed each token to (rollout.return_routed_experts) instead of their own top-k, in every engine: rollout routing replay, R3 (docs/mismatch.md#routing-replay-moe)
    mismatch_metrics: bool | None = None  # log mismatch/* each step: the sampler's log-probs against the trainer's at the same weights (docs/mismatch.md); null: with rollout.server_url or an algo.rollout_correction preset

    # Asynchronous RL (mode=async; docs/training.md#asynchronous-rl-trainermodeasync).
    max_staleness: int = 1  # async: a group is trained at most this many policy versions after its oldest token (0: synchronous)
    rollout_workers: int = 1  # async: rollout worker processes, each sampling with its own copy of the policy on CPU
    worker_threads: int = 1  # async: torch threads per worker (on CPU the trainer keeps the cores the workers leave)
    worker_prompts: int | None = None  # async: prompts (groups) a worker samples in one sampler call; null: prompts_per_step / rollout_workers
    on_update: str = "finish"  # async: in-flight generations finish on the old weights | interrupt: resume on the new ones
    interrupt_tokens: int = 8  # async, on_update=interrupt: tokens decoded between two looks for new weights
    decoupled_loss: bool = True  # async, or truncated sampling (rollout.top_p < 1, top_k, min_p): train ppo, grpo, dr_grpo, rloo, reinforce_pp as decoupled PPO (same advantages)
    worker_timeout: float = 300.0  # async: a worker holding work with no model forward for this many seconds is restarted
    max_worker_restarts: int = 10  # async: stop the run after this many worker restarts (crashes or hangs)

    # CPU threads.
    threads: int | None = None  # torch threads of the trainer (per rank); null: the cores / local ranks, less async workers'

    # Data parallel (under torchrun; a plain `python`/`treerl` run is one rank).
    data_parallel: str = "auto"  # auto (ddp when there are several ranks) | none | ddp | fsdp2
    fit_cost_model: bool = True  # refit treerl.distributed's cost model from measured engine times to balance ranks
    context_parallel: int = 1  # ranks that split each DFS call's rows (docs/training.md#context-parallelism-one-long-trajectory-over-several-gpus); the data-parallel ranks are WORLD_SIZE / this
    context_parallel_path: str = "sharded"  # the path's K/V: sharded (1/R a rank; queries travel) | replicated (less traffic)
    context_parallel_mixers: str = "side-by-side"  # a hybrid's mixer layers: side-by-side (every rank at once, scans corrected) | in-turn (rank after rank)
    context_parallel_min_tokens: int = 0  # split sequences this long (or too costly for one rank); the rest train alone, a rank each

    # Evaluation: the policy's mean reward on a fixed set of prompts (sampled like the rollout).
    eval_prompts: int = 64  # prompts (episodes) per evaluation; 0: no evaluation
    eval_every: int = 0  # also evaluate every this many steps; 0: only at the start and the end
    log_samples: int = 4  # trajectories of each step (and each evaluation) written to output_dir/samples.jsonl with their prompt, reply or turns, reward and metrics (spread over the prompts; dropped samples too, with their reason); 0: none

    # Output.
    output_dir: str = "runs/train"  # metrics.jsonl, tensorboard/, checkpoints/, summary.json
    save_every: int = 0  # checkpoint every this many steps; 0: only at the end
    keep_checkpoints: int = 2  # most recent checkpoints kept; 0: keep all
    save_final: bool = True  # checkpoint after the last step
    resume: str | None = None  # a checkpoint directory, or "auto": the newest complete one in output_dir/checkpoints (if any)
    overwrite: bool = False  # start afresh in an output_dir that holds a run (its checkpoints and metrics are deleted)
    log_every: int = 1  # write metrics every this many steps
    tensorboard: bool = True  # also write TensorBoard event files to output_dir/tensorboard
    wandb: bool = False  # also log to Weights & Biases (pip install 'treerl[wandb]'; WANDB_MODE=offline: local only)
    wandb_project: str = "treerl"  # the W&B project of the run
    wandb_name: str | None = None  # the W&B run name; null: W&B picks one
    progress: bool = True  # show a progress bar (step, reward, loss, token compression T/U of the batch)


@dataclass
class SFTConfig:
    """`treerl sft`: SFT on branching conversations (docs/training.md#sft-on-branching-conversations)."""

    data_path: str | None = None  # JSONL of branching conversations (docs/training.md); null: the shipped example
    conversations_per_step: int = 8  # conversations (each a tree of paths) per training step
    chat_format: str = "template"  # template: the tokenizer's chat template (plain if it has none) | plain
    shuffle: bool = True  # visit conversations in a seeded random order, reshuffled every epoch
    eval_conversations: int = 32  # conversations whose loss is printed at the start and the end; 0: none
    max_line_bytes: int = MAX_LINE_BYTES  # longest line of a JSONL data_path; a longer one is an error naming it


@dataclass
class EvalConfig:
    """`treerl eval`: a model's held-out evaluation, trainer.eval_prompts prompts (docs/training.md#treerl-eval)."""

    samples: int = 8  # samples per prompt (independent: a multi-turn episode is not branched)
    k: list[int] = field(default_factory=lambda: [1, 8])  # pass@k for each k (1 <= k <= samples): the chance that one of k samples passes, estimated without bias from the samples
    pass_reward: float = 1.0  # a sample passes when its reward is at least this
    prompts_per_call: int = 8  # prompts sampled at once (the progress bar advances by them)


def _demo_algo() -> AlgoConfig:
    """Dr. GRPO with an entropy bonus: without the bonus the tiny demo policy collapses onto one answer, and
    GRPO's std scaling blows the tiny format-credit differences of early samples up into full-size advantages."""
    return AlgoConfig(loss="dr_grpo", entropy_coef=0.02)


@dataclass
class Config:
    """Everything one run needs. The defaults are the built-in demo: arithmetic, a tiny model, CPU."""

    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=_demo_algo)
    engine: EngineConfig = field(default_factory=EngineConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def check(self) -> None:
        """Every value check of every section, before anything is built."""
        check_finite(self)
        try:
            self.algo.check()
            self.algo.resolved()
            self.rollout.check()
        except ValueError as e:
            raise ConfigError(str(e)) from None
        check_choices(self)
        check_ranges(self)
        check_precision(self)


def check_choices(config: Config) -> None:
    """Options that take one of a few names."""
    choices = {
        "engine.name": ENGINES, "engine.recompute": RECOMPUTE, "engine.head_rows": HEAD_ROWS,
        "trainer.data_parallel": DATA_PARALLEL, "trainer.lr_schedule": LR_SCHEDULES,
        "sft.chat_format": CHAT_FORMATS, "trainer.mode": MODES, "trainer.on_update": ON_UPDATE,
        "trainer.nonfinite": NONFINITE,
    }
    if config.model.dtype is not None:
        choices["model.dtype"] = DTYPES
    if config.model.path is None:
        choices["model.shape"] = tuple(SHAPES)
    for key, allowed in choices.items():
        value = get(config, key)
        if value not in allowed:
            raise ConfigError(f"{key}={value!r} is not one of: {', '.join(allowed)}")
    if config.trainer.resume == "auto" and config.trainer.overwrite:
        raise ConfigError("trainer.resume=auto continues the run in output_dir, trainer.overwrite=true deletes it and "
                          "starts afresh: set one of the two")
    if config.model.lora.rank and config.rollout.server_url:
        raise ConfigError("model.lora.rank > 0 with rollout.server_url: pushing the policy to an inference server "
                          "each step is not implemented for LoRA; sample with the embedded sampler (no server_url), "
                          "and serve the result with `treerl export`")
    check_truncated_sampling(config)
    check_rollout_correction(config)
    check_routing_replay(config)
    if config.trainer.context_parallel < 1:
        raise ConfigError(f"trainer.context_parallel={config.trainer.context_parallel} must be >= 1")
    if config.trainer.context_parallel_min_tokens < 0:
        raise ConfigError(f"trainer.context_parallel_min_tokens={config.trainer.context_parallel_min_tokens} must be "
                          ">= 0 (0: every sequence split)")
    if config.trainer.context_parallel_path not in PATH_LAYOUTS:
        raise ConfigError(f"trainer.context_parallel_path={config.trainer.context_parallel_path!r} must be one of "
                          f"{', '.join(PATH_LAYOUTS)}")
    if config.trainer.context_parallel_mixers not in MIXER_ORDERS:
        raise ConfigError(f"trainer.context_parallel_mixers={config.trainer.context_parallel_mixers!r} must be one of "
                          f"{', '.join(MIXER_ORDERS)}")
    if config.trainer.context_parallel > 1 and config.engine.name != "dfs":
        raise ConfigError(f"trainer.context_parallel={config.trainer.context_parallel} splits DfsEngine's calls: "
                          f"engine.name={config.engine.name} has none to split (use engine.name=dfs)")
    if config.trainer.context_parallel > 1 and config.trainer.mode == "async":
        raise ConfigError("trainer.context_parallel > 1 needs torchrun, which trainer.mode=async does not run under")
    if config.algo.resolved().advantage == "gae" and config.trainer.mode == "async":
        raise ConfigError(
            f"algo.advantage=gae (the default of algo.loss={config.algo.loss}) trains a critic, which "
            "trainer.mode=async does not run; use trainer.mode=sync, or algo.advantage=group, group_mean, rloo or returns"
        )
    if config.model.gguf_file is not None and config.model.path is None:
        raise ConfigError(f"model.gguf_file={config.model.gguf_file!r} picks a file in model.path's directory, and "
                          "model.path is not set: set model.path to the directory holding it (or to the file itself)")
    if config.critic.path not in (None, *PACKAGED_MODELS) and not Path(config.critic.path).exists():
        raise ConfigError(f"critic.path={config.critic.path!r} does not exist (treerl only loads local checkpoints)")
    for key in ("reward_timeout", "env_timeout") if config.rollout.env is not None else ("reward_timeout",):
        timeout = getattr(config.rollout, key)
        if config.trainer.mode == "async" and timeout is not None and not timeout < config.trainer.worker_timeout:
            raise ConfigError(f"rollout.{key}={timeout} must be < trainer.worker_timeout={config.trainer.worker_timeout}"
                              " (a worker waiting on a reward or an environment would be taken for hung)")


def check_truncated_sampling(config: Config) -> None:
    """Samples drawn with top_p / top_k / min_p come from a cut-down distribution, not the policy the trainer
    differentiates: their behaviour log-probs are off-policy on purpose, and only decoupled PPO's weight
    pi_prox / pi_behav corrects for that (treerl.rollout.sampling.sampler). Refuse a run that would train on them otherwise."""
    rollout = config.rollout
    if not rollout.truncates:
        return
    cut = ", ".join(f"rollout.{k}={getattr(rollout, k)}" for k, off in (("top_p", 1.0), ("top_k", 0), ("min_p", 0.0))
                    if getattr(rollout, k) != off)
    why = (f"{cut} samples from a truncated distribution, whose log-probs differ from the policy's even on-policy; "
           "the loss must correct for that with decoupled PPO's weight pi_prox / pi_behav")
    if config.algo.loss not in (*DECOUPLABLE, "decoupled_ppo"):
        raise ConfigError(f"{why}, which algo.loss={config.algo.loss} has no form of: use ppo, grpo, dr_grpo, rloo, "
                          "reinforce_pp or decoupled_ppo, or sample untruncated (top_p=1, top_k=0, min_p=0)")
    if config.algo.loss != "decoupled_ppo" and not config.trainer.decoupled_loss:
        raise ConfigError(f"{why}: set trainer.decoupled_loss=true, or sample untruncated (top_p=1, top_k=0, min_p=0)")
    if config.trainer.recompute_logprobs:
        raise ConfigError(f"{why}; trainer.recompute_logprobs=true would overwrite the behaviour log-probs with the "
                          "untruncated policy's and lose that correction: set it false")


def check_rollout_correction(config: Config) -> None:
    """A preset corrects the sampler's log-probs towards the trainer's: trainer.recompute_logprobs=true replaces the
    former with the latter, and the preset would silently weigh every token by 1."""
    preset = config.algo.rollout_correction
    if preset != "none" and config.trainer.recompute_logprobs:
        raise ConfigError(f"algo.rollout_correction={preset} corrects the sampler's log-probs, which "
                          "trainer.recompute_logprobs=true replaces with the trainer's (every ratio would be 1): set "
                          "one of the two")


def check_routing_replay(config: Config) -> None:
    """trainer.routing_replay replays the experts the sampler recorded (rollout.return_routed_experts), which only the
    embedded sampler records so far, in layers that are not recomputed nor split over ranks."""
    if config.rollout.return_routed_experts and config.rollout.server_url:
        raise ConfigError("rollout.return_routed_experts=true with rollout.server_url: treerl does not read a server's "
                          "routed experts yet (vLLM 0.32 returns them on its GPU model runner only); sample in process "
                          "(no rollout.server_url)")
    if not config.trainer.routing_replay:
        return
    why = {"rollout.return_routed_experts=false": not config.rollout.return_routed_experts,
           "model.gradient_checkpointing=true": config.model.gradient_checkpointing,
           f"trainer.context_parallel={config.trainer.context_parallel}": config.trainer.context_parallel > 1}
    for setting, wrong in why.items():
        if wrong:
            raise ConfigError(f"trainer.routing_replay=true replays the experts the sampler recorded for each token "
                              f"(rollout.return_routed_experts=true), with every layer run once on one rank: {setting} "
                              "does not go with it")


def measures_mismatch(config: Config) -> bool:
    """Whether each step logs mismatch/* (trainer.mismatch_metrics; unset: with servers or a correction preset)."""
    if config.trainer.mismatch_metrics is not None:
        return config.trainer.mismatch_metrics
    return bool(config.rollout.server_urls) or config.algo.rollout_correction != "none"


def trained_algo(config: Config) -> AlgoConfig:
    """The objective the run trains: the configured loss, or its decoupled-PPO form (same advantages, aggregation and
    clipping) when the samples are off-policy by design: asynchronous training, or truncated sampling (with
    trainer.decoupled_loss)."""
    if config.trainer.decoupled_loss and (config.trainer.mode == "async" or config.rollout.truncates):
        return decoupled(config.algo)
    return config.algo


def check_precision(config: Config) -> None:
    """trainer.precision (an alias becomes its own name) and model.dtype must agree; fills model.dtype when unset,
    so everything after this reads the parameter dtype from model.dtype."""
    try:
        config.trainer.precision = canonical(config.trainer.precision)
        config.model.dtype = parameter_dtype(config.trainer.precision, config.model.dtype)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    lora = config.model.lora
    if lora.rank and not lora.target_modules.strip():
        raise ConfigError("model.lora.target_modules is empty: name the modules to adapt (q_proj,v_proj) or all-linear")


def check_finite(section: Any, prefix: str = "") -> None:
    """No NaN or inf anywhere: a learning rate or coefficient of inf would train NaN weights."""
    for f in fields(section):
        value = getattr(section, f.name)
        if is_dataclass(value):
            check_finite(value, f"{prefix}{f.name}.")
        elif isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{prefix}{f.name}={value} must be a finite number")
        elif isinstance(value, list) and any(isinstance(v, float) and not math.isfinite(v) for v in value):
            raise ConfigError(f"{prefix}{f.name}={value} must hold finite numbers")


def check_ranges(config: Config) -> None:
    """Numbers that must be positive, non-negative or in a range."""
    t = config.trainer
    positive = {
        "trainer.steps": t.steps, "trainer.lr": t.lr, "trainer.ppo_epochs": t.ppo_epochs,
        "trainer.minibatches": t.minibatches, "trainer.log_every": t.log_every, "trainer.adam_eps": t.adam_eps,
        "engine.chunk_tokens": config.engine.chunk_tokens, "engine.max_tokens": config.engine.max_tokens,
        "engine.head_chunk_rows": config.engine.head_chunk_rows,
        "sft.conversations_per_step": config.sft.conversations_per_step,
        "trainer.rollout_workers": t.rollout_workers, "trainer.worker_threads": t.worker_threads,
        "trainer.interrupt_tokens": t.interrupt_tokens, "trainer.worker_timeout": t.worker_timeout,
        "sft.max_line_bytes": config.sft.max_line_bytes,  # the rollout section's numbers: RolloutConfig.check
    }
    optional = {"trainer.micro_batch_tokens": t.micro_batch_tokens, "trainer.max_grad_norm": t.max_grad_norm,
                "critic.lr": config.critic.lr, "trainer.threads": t.threads, "trainer.worker_prompts": t.worker_prompts}
    positive.update({k: v for k, v in optional.items() if v is not None})
    for key, value in positive.items():
        if not value > 0:
            raise ConfigError(f"{key}={value} must be > 0")
    non_negative = {
        "model.lora.rank": config.model.lora.rank, "model.lora.alpha": config.model.lora.alpha,
        "trainer.weight_decay": t.weight_decay, "trainer.warmup_steps": t.warmup_steps,
        "trainer.eval_prompts": t.eval_prompts, "trainer.eval_every": t.eval_every, "trainer.save_every": t.save_every,
        "trainer.keep_checkpoints": t.keep_checkpoints, "engine.batch_tokens": config.engine.batch_tokens,
        "sft.eval_conversations": config.sft.eval_conversations, "trainer.max_staleness": t.max_staleness,
        "trainer.max_worker_restarts": t.max_worker_restarts, "trainer.max_failed_steps": t.max_failed_steps,
        "trainer.log_samples": t.log_samples,
    }
    for key, value in non_negative.items():
        if not value >= 0:
            raise ConfigError(f"{key}={value} must be >= 0")
    for key, threads in (("trainer.threads", t.threads), ("trainer.worker_threads", t.worker_threads)):
        if threads is not None and threads > MAX_THREADS:  # torch would try to start them all (and crash)
            raise ConfigError(f"{key}={threads} must be <= {MAX_THREADS}")
    check_eval(config.eval)
    if not 0 <= t.min_lr_ratio <= 1:
        raise ConfigError(f"trainer.min_lr_ratio={t.min_lr_ratio} must be in [0, 1]")
    if len(t.betas) != 2 or not all(0 <= b < 1 for b in t.betas):
        raise ConfigError(f"trainer.betas={t.betas} must be two numbers in [0, 1)")
    e = config.engine
    try:
        check_memory_settings(e.memory, e.max_tokens, e.memory_budget_tokens, e.memory_budget_bytes, prefix="engine.")
    except ValueError as error:
        raise ConfigError(str(error)) from None


def check_eval(section: EvalConfig) -> None:
    """`treerl eval`'s counts: at least one sample and prompt a call, each k of pass@k from 1 to eval.samples."""
    for key in ("samples", "prompts_per_call"):
        if getattr(section, key) < 1:
            raise ConfigError(f"eval.{key}={getattr(section, key)} must be >= 1")
    if not section.k or any(not 1 <= k <= section.samples for k in section.k):
        raise ConfigError(f"eval.k={section.k}: pass@k needs each k in 1..eval.samples={section.samples} (k samples "
                          "of the prompt's samples)")


def get(config: Any, key: str) -> Any:
    """The value at a dotted key, e.g. get(config, "trainer.lr")."""
    for part in key.split("."):
        config = getattr(config, part)
    return config


# ---------------------------------------------------------------------------------------------- loading
def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (),
                base: list[str] | tuple[str, ...] = ()) -> Config:
    """Defaults <- `base` dotlist (a command's own defaults) <- YAML at `path` <- `overrides`; checked."""
    schema = OmegaConf.structured(Config)
    layers = [("defaults of this command", OmegaConf.from_dotlist(list(base)))] if base else []
    if path is not None:
        layers.append((str(path), _read_yaml(resolve_config_path(path))))
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key=value, e.g. trainer.steps=100")
        if item.replace(" ", "") == "rollout.env=":  # YAML reads it as null: the built-in task would train unsaid
            raise ConfigError("override 'rollout.env=' names no environment: give one (e.g. rollout.env="
                              "reasoning_gym:leg_counting), or leave the key out for rollout.task's task")
        layers.append((f"override {item!r}", OmegaConf.from_dotlist([item])))
    for source, layer in layers:
        try:
            schema = OmegaConf.merge(schema, layer)
        except OmegaConfBaseException as e:
            raise ConfigError(f"{source}: {_explain(e)}") from None
    try:
        config: Config = OmegaConf.to_object(schema)  # type: ignore[assignment]
    except OmegaConfBaseException as e:
        raise ConfigError(_explain(e)) from None
    except ValueError as e:  # a section's own check (AlgoConfig checks itself when built)
        raise ConfigError(str(e)) from None
    check_task_beside_env(layers, config)
    config.check()
    return config


def check_task_beside_env(layers: list[tuple[str, Any]], config: Config) -> None:
    """rollout.task written out (its default too) beside rollout.env: both say what to train on (rollout.env's check
    sees only the value, and the default's is the same whether written or not)."""
    written = [(source, OmegaConf.select(layer, "rollout.task")) for source, layer in layers
               if OmegaConf.select(layer, "rollout.task") is not None]
    if config.rollout.env is not None and written and written[-1][1] != "env":
        source, task = written[-1]
        raise ConfigError(f"rollout.env={config.rollout.env!r} and rollout.task={task} ({source}) both say what to "
                          "train on: set one of the two")


def packaged_configs() -> dict[str, Path]:
    """The YAML configs shipped with treerl (treerl/configs), by name without `.yaml`."""
    folder = resources.files("treerl") / "configs"
    return {Path(str(p)).stem: Path(str(p)) for p in folder.iterdir() if str(p).endswith(".yaml")}


def resolve_config_path(path: str | Path) -> Path:
    """A YAML file on disk, or the name of a packaged config (`guess_number`, `configs/guess_number.yaml`)."""
    candidate = Path(path)
    if candidate.is_file():
        return candidate
    shipped = packaged_configs()
    name = candidate.name.removesuffix(".yaml").removesuffix(".yml")
    if name in shipped:
        return shipped[name]
    raise ConfigError(f"config file {str(path)!r} does not exist (packaged configs: {', '.join(sorted(shipped))})")


def to_yaml(config: Config) -> str:
    """The resolved config as YAML (what `--print-config` shows and each checkpoint stores)."""
    return OmegaConf.to_yaml(OmegaConf.structured(config))


def all_keys(section: Any = Config, prefix: str = "") -> list[str]:
    """Every dotted key of the config tree (docs and tests check that each is documented)."""
    keys = []
    for f in fields(section):
        default = f.default_factory() if callable(f.default_factory) else f.default  # type: ignore[misc]
        if is_dataclass(default):
            keys.extend(all_keys(type(default), f"{prefix}{f.name}."))
        else:
            keys.append(prefix + f.name)
    return keys


def _read_yaml(path: Path) -> Any:
    try:
        layer = OmegaConf.load(path)
    except Exception as e:  # YAML syntax errors come from several libraries
        raise ConfigError(f"{path}: not a valid YAML file ({yaml_problem(e)})") from None
    if layer is None or (OmegaConf.is_dict(layer) and not layer):
        raise ConfigError(f"{path}: the config file is empty (to run the defaults, give no config file)")
    if not OmegaConf.is_dict(layer):
        raise ConfigError(f"{path}: expected a mapping of sections (model, rollout, algo, engine, critic, trainer, sft)")
    return layer


def yaml_problem(error: Exception) -> str:
    """A YAML error on one line: what is wrong and where (PyYAML spreads it over several)."""
    problem = getattr(error, "problem", None) or (str(error).strip().splitlines() or [type(error).__name__])[0]
    mark = getattr(error, "problem_mark", None)
    return f"{problem}, line {mark.line + 1}" if mark is not None else str(problem)


def _explain(error: OmegaConfBaseException) -> str:
    """OmegaConf's error as one line naming the full key, with a suggestion for a misspelt one."""
    key = getattr(error, "full_key", None) or getattr(error, "key", None)
    message = str(error).splitlines()[0]
    if type(error).__name__ in ("ConfigKeyError", "ConfigAttributeError") and key:
        parent, _, leaf = str(key).rpartition(".")
        known = [k for k in all_keys() if k.startswith(parent + ".")] if parent else [f.name for f in fields(Config)]
        close = difflib.get_close_matches(str(key), known, n=1) or difflib.get_close_matches(leaf, known, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        where = f"section {parent!r}" if parent else "the config (sections: model, rollout, algo, engine, critic, trainer, sft)"
        return f"unknown key {str(key)!r}: {where} has no {leaf!r}{hint} (see docs/config.md)"
    return f"{key}: {message}" if key else message
