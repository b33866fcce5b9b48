"""AdamW and the learning-rate schedule: linear warmup, then constant or cosine, per training step.

Step 6 (docs/architecture.md): the optimizer and its learning rate.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from treerl.trainer.core.config import TrainerConfig


def build_optimizer(parameters: Iterable[torch.nn.Parameter], config: TrainerConfig) -> torch.optim.AdamW:
    """AdamW over the parameters this rank steps (build it after the data-parallel wrapper)."""
    return torch.optim.AdamW(
        parameters, lr=config.lr, betas=tuple(config.betas), eps=config.adam_eps, weight_decay=config.weight_decay
    )


def lr_factor(step: int, config: TrainerConfig) -> float:
    """The learning rate of training step `step` as a fraction of `config.lr`.

    Warmup: (step + 1) / warmup_steps, so the first step already moves. Cosine: from 1 right after
    warmup down to `min_lr_ratio` at the last step.
    """
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    if config.lr_schedule == "constant":
        return 1.0
    decay_steps = max(1, config.steps - 1 - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / decay_steps)
    return config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, config: TrainerConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """Stepped once per training step (all minibatch updates of a step share its learning rate)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, config))
