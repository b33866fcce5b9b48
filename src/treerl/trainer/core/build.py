"""Building what a run trains from its config: the policy and tokenizer, the engine, and a `Learner` per model.

Beside the steps (docs/architecture.md): builds what steps 1, 5 and 6 use.

    model, tokenizer = load_policy(config.model, device)     # also what rollout workers and export load
    actor = build_policy_learner(config, model, strategy, balancer, guard, temperature)
    critic = build_critic_learner(config, strategy, len(tokenizer), device, balancer, guard)   # PPO with GAE only
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from treerl.algo import build_critic
from treerl.attention import UnsupportedModel
from treerl.attention.context_parallel import ContextParallel
from treerl.distributed import DistributedModel
from treerl.engine import AutocastEngine, DfsEngine, Engine, FlatEngine, PackedEngine, PolicyHead, ValueHead
from treerl.engine.images import tower_parameters
from treerl.engine.routing import RoutingReplayEngine, find_routers
from treerl.engine.support import check_no_dropout
from treerl.gguf_checkpoint import PACKAGED_MODELS, local_checkpoint
from treerl.models import add_lora, build_model, check_model_dir, policy_config, shows_images
from treerl.rollout import load_tokenizer
from treerl.rollout.conversations.images import ImageProcessor, image_processor
from treerl.trainer.core.balancer import Balancer
from treerl.trainer.core.config import Config, ConfigError, EngineConfig, ModelConfig, TrainerConfig
from treerl.trainer.core.learner import Learner, NonfiniteGuard
from treerl.trainer.core.optim import build_optimizer, build_scheduler
from treerl.trainer.core.precision import autocast_dtype


def build_train_engine(config: EngineConfig, temperature: float = 1.0, head: PolicyHead | ValueHead | None = None,
                       precision: str = "fp32", context_parallel: ContextParallel | None = None,
                       routing_replay: bool = False) -> Engine:
    """The engine `engine.name` names; its log-probs are those of softmax(logits / temperature) (or `head`'s outputs).
    Under trainer.precision=bf16-mixed every call of it runs under autocast; DfsEngine's calls split over
    `context_parallel`'s ranks; with `routing_replay` an MoE policy's routers replay the sampler's experts."""
    # the policy's losses, its log-prob fields and their metrics read only loss_mask positions; a critic's values feed
    # GAE beyond them (and are cheap): computed everywhere
    head_rows = None if config.head_rows == "all" or isinstance(head, ValueHead) else config.head_rows
    head = head or PolicyHead(temperature=temperature, chunk_rows=config.head_chunk_rows)
    engine: Engine
    if config.name == "dfs":
        engine = DfsEngine(head=head, chunk_tokens=config.chunk_tokens, batch_tokens=config.batch_tokens,
                           recompute=config.recompute, memory=config.memory, max_tokens=config.max_tokens,  # type: ignore[arg-type]
                           memory_budget_tokens=config.memory_budget_tokens, memory_budget_bytes=config.memory_budget_bytes,
                           context_parallel=context_parallel, head_rows=head_rows)
    elif config.name == "packed":
        engine = PackedEngine(head=head, max_tokens=config.max_tokens, head_rows=head_rows)
    else:
        engine = FlatEngine(head=head, max_tokens=config.max_tokens, head_rows=head_rows)
    compute = autocast_dtype(precision)
    engine = AutocastEngine(engine, compute) if compute is not None else engine
    return RoutingReplayEngine(engine) if routing_replay else engine


def load_policy(config: ModelConfig, device: torch.device) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The model and tokenizer of `model.*`: a local checkpoint (checked first), or a random-init shape; with
    gradient checkpointing and LoRA adapters if configured."""
    path = checkpoint_path(config)
    if path is not None:
        check_model_dir(path, "model.path")
    if config.tokenizer_path not in (None, *PACKAGED_MODELS) and not Path(config.tokenizer_path).exists():
        raise ConfigError(f"model.tokenizer_path={config.tokenizer_path!r} does not exist")
    tokenizer = policy_tokenizer(config)
    model = build_model(
        path=path, shape=config.shape, vocab_size=None if path else len(tokenizer),
        dtype=getattr(torch, config.dtype or "float32"), device=device, seed=config.seed,
        attn_implementation=config.attn_implementation, trust_remote_code=config.trust_remote_code,
    )
    model.eval()  # dropout off: the sampled and the trained policy must be one function, and recomputation exact
    vocab = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > vocab:
        raise ConfigError(f"the tokenizer has {len(tokenizer)} tokens but the model's vocabulary only {vocab}")
    if config.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    if config.freeze_vision_tower:
        freeze_vision_tower(model)
    if config.lora.rank:
        model = add_lora(model, config.lora.rank, config.lora.alpha, config.lora.target_modules)
    return model, tokenizer


def freeze_vision_tower(model: PreTrainedModel) -> None:
    """`model.freeze_vision_tower`: the engines then send the tower no gradient (nor run it again for one)."""
    tower = tower_parameters(model)
    if not tower:
        raise ConfigError(f"model.freeze_vision_tower=true, and the policy ({type(model).__name__}) has no vision tower "
                          "that treerl feeds: drop the setting for a text model")
    for parameter in tower:
        parameter.requires_grad_(False)


def checkpoint_path(config: ModelConfig) -> str | None:
    """The checkpoint directory `model.path` stands for (a GGUF file or a packaged model: its cached conversion),
    or None for a random-init shape."""
    return local_checkpoint(config.path, config.gguf_file) if config.path is not None else None


def policy_tokenizer(config: ModelConfig) -> PreTrainedTokenizerBase:
    """The policy's tokenizer: `model.tokenizer_path`, else the checkpoint's, else the built-in one (with the image
    tokens for a vision-language shape)."""
    path = local_checkpoint(config.tokenizer_path, key="model.tokenizer_path") if config.tokenizer_path else None
    return load_tokenizer(path or checkpoint_path(config), trust_remote_code=config.trust_remote_code,
                          vision=shows_images(config.shape))


def policy_images(config: ModelConfig, vocab_size: int) -> ImageProcessor | None:
    """The policy's image processor (None: a text model), from its config alone: the trainer and every rollout worker
    render prompts that show images with it."""
    path = checkpoint_path(config)
    return image_processor(policy_config(path, config.shape, vocab_size, config.trust_remote_code), path)


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


def build_policy_learner(config: Config, model: PreTrainedModel, strategy: str, balancer: Balancer,
                         guard: NonfiniteGuard, temperature: float) -> Learner:
    """The policy's learner; its measured engine times refit the balancer's cost model."""
    engine = build_train_engine(config.engine, temperature, precision=config.trainer.precision,
                                context_parallel=balancer.mesh.context if balancer.mesh is not None else None,
                                routing_replay=config.trainer.routing_replay)
    for key, on in (("trainer.routing_replay", config.trainer.routing_replay),
                    ("rollout.return_routed_experts", config.rollout.return_routed_experts)):
        if on:  # an MoE model whose routers choose by one top-k: refused in one line otherwise, naming the setting
            try:
                find_routers(model)
            except UnsupportedModel as e:
                raise UnsupportedModel(f"{key}=true: {e}") from None
    return build_learner("policy", model, strategy, config.trainer, engine, balancer, guard, records_costs=True)


def build_critic_learner(config: Config, strategy: str, vocab_size: int, device: torch.device, balancer: Balancer,
                         guard: NonfiniteGuard) -> Learner:
    """PPO's value model: its body from `critic.path` (else the policy's checkpoint or shape), a fresh value layer,
    its own learning rate (`critic.lr`, else the policy's)."""
    path = local_checkpoint(config.critic.path, key="critic.path") if config.critic.path else checkpoint_path(config.model)
    if config.critic.path is not None:
        check_model_dir(path, "critic.path")
    model = build_critic(path=path, shape=config.model.shape, vocab_size=None if path else vocab_size,
                         dtype=getattr(torch, config.model.dtype), device=device, seed=config.critic.seed,
                         attn_implementation=config.model.attn_implementation,
                         trust_remote_code=config.model.trust_remote_code)
    model.eval()  # no dropout: the values the advantages use and the ones trained are one function
    schedule = dataclasses.replace(config.trainer, lr=config.critic.lr or config.trainer.lr)
    engine = build_train_engine(config.engine, head=ValueHead(), precision=config.trainer.precision,
                                context_parallel=balancer.mesh.context if balancer.mesh is not None else None)
    return build_learner("critic", model, strategy, schedule, engine, balancer, guard)


def build_learner(name: str, model: PreTrainedModel, strategy: str, trainer: TrainerConfig, engine: Engine,
                  balancer: Balancer, guard: NonfiniteGuard, records_costs: bool = False) -> Learner:
    """A model's data-parallel wrapper (FSDP2 gathers bfloat16 parameters under bf16-mixed), then AdamW over what
    this rank steps and trains (LoRA: the adapters only), and its LR schedule."""
    dp = DistributedModel(model, strategy, mixed_precision=autocast_dtype(trainer.precision))  # type: ignore[arg-type]
    optimizer = build_optimizer([p for p in dp.parameters() if p.requires_grad], trainer)
    return Learner(name, dp, optimizer, build_scheduler(optimizer, trainer), engine, balancer, guard,
                   trainer.max_grad_norm, records_costs)
