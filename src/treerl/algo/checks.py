"""Input checks of the algorithm fields, each error naming the sequence and the field.

Steps 3 and 5 (docs/architecture.md): the loss's fields checked before any compute.

The engines already reject empty sequences, fields whose length differs from the tokens', and
NaN/inf in fields or numeric info (`treerl.tree.validate_sequences`); these add what a loss
needs: the fields it reads must exist, token 0 must not be trained (nothing predicts it), a
loss mask is a non-negative weight, and log-probabilities are <= 0.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import torch

from treerl.algo.config import AlgoConfig, corrects_rollout, uses_proximal
from treerl.tree import BatchError, TokenSequence, validate_sequences

LOGPROB_FIELDS = ("old_logprobs", "prox_logprobs", "ref_logprobs")
ROLLOUT_WEIGHT = "rollout_weight"  # a decoupled preset's importance weight per token (treerl.algo.correct_rollout)
SAMPLED_MASK = "sampled_loss_mask"  # the loss mask before a preset's rejection zeroed tokens in `loss_mask`
MAX_ABS_REWARD = 1e9  # larger rewards overflow the group statistics and the float32 loss (1e308 raised OverflowError)


def required_fields(config: AlgoConfig, critic: bool = False) -> list[str]:
    """The per-token fields the policy loss of `config` (or, with `critic`, its value loss) reads."""
    config = config.resolved()
    needed = ["loss_mask"]
    if critic:
        return needed + ["returns"] + (["values"] if config.value_clip is not None else [])
    if config.loss != "sft":
        needed += ["advantages", "old_logprobs"]
    if uses_proximal(config):
        needed.append("prox_logprobs")
    if corrects_rollout(config):
        needed.append(ROLLOUT_WEIGHT)
    if config.kl_coef > 0 and not config.kl_in_reward:
        needed.append("ref_logprobs")
    return needed


def require_field(seq: TokenSequence, index: int, name: str, purpose: str) -> torch.Tensor:
    """The field, or an error saying who lacks it and what needs it."""
    if name not in seq.fields:
        raise BatchError(f"{seq.label(index)}: field {name!r} is missing ({purpose})")
    return seq.fields[name]


def check_loss_mask(seq: TokenSequence, index: int) -> None:
    """A loss mask exists, is a non-negative weight, and leaves token 0 (which has no prediction) untrained."""
    mask = require_field(seq, index, "loss_mask", "1 on trained tokens, 0 elsewhere")
    if bool((mask < 0).any()):
        pos = int((mask < 0).nonzero()[0])
        raise BatchError(
            f"{seq.label(index)}: field 'loss_mask' is {mask[pos].item()} at token {pos}; weights must be >= 0"
        )
    if mask.numel() and bool(mask[0] != 0):
        raise BatchError(
            f"{seq.label(index)}: field 'loss_mask' is {mask[0].item()} at token 0, but token 0 has no prediction "
            "(nothing comes before it): set loss_mask[0] = 0"
        )


def check_logprobs(seq: TokenSequence, index: int, name: str) -> None:
    """Log-probabilities are <= 0; a positive one is a probability > 1, i.e. a wrong field."""
    values = seq.fields[name]
    if bool((values > 0).any()):
        pos = int((values > 0).nonzero()[0])
        value = values[pos].item()
        raise BatchError(
            f"{seq.label(index)}: field {name!r} is {value:.6g} at token {pos}; log-probabilities must be <= 0"
        )


def check_sequence(config: AlgoConfig, seq: TokenSequence, index: int, critic: bool = False) -> None:
    """Everything the loss of `config` needs from one sequence (lengths and NaN/inf: validate_sequences)."""
    purpose = "needed by the value loss" if critic else f"needed by {loss_setting(config)}"
    for name in required_fields(config, critic):
        written = "; treerl.algo.correct_rollout(config, batch) writes it" if name == ROLLOUT_WEIGHT else ""
        require_field(seq, index, name, purpose + written)
    check_mask_and_logprobs(seq, index)


def loss_setting(config: AlgoConfig) -> str:
    """The settings a field is needed by, as a user wrote them."""
    preset = "" if config.rollout_correction == "none" else f" algo.rollout_correction={config.rollout_correction}"
    return f"algo.loss={config.loss}{preset}"


def check_mask_and_logprobs(seq: TokenSequence, index: int) -> None:
    """The loss mask, and every log-prob field the sequence carries."""
    check_loss_mask(seq, index)
    for name in LOGPROB_FIELDS:
        if name in seq.fields:
            check_logprobs(seq, index, name)


def validate_batch(config: AlgoConfig, sequences: Sequence[TokenSequence], critic: bool = False) -> None:
    """Check a whole batch for the (policy or value) loss of `config` before any compute."""
    validate_sequences(sequences)
    for i, seq in enumerate(sequences):
        check_sequence(config, seq, i, critic)


def check_reward(seq: TokenSequence, index: int) -> float | list[float]:
    """`info["reward"]`: a finite number within +-MAX_ABS_REWARD, or a non-empty list of them (per-turn rewards)."""
    if "reward" not in seq.info:
        raise BatchError(f"{seq.label(index)}: field 'reward' is missing from info (needed to compute advantages)")
    reward = seq.info["reward"]
    if isinstance(reward, torch.Tensor):
        reward = reward.tolist()
    values = list(reward) if isinstance(reward, (list, tuple)) else [reward]
    if not values:
        raise BatchError(f"{seq.label(index)}: field 'reward' is an empty list")
    for value in values:
        if (isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value)
                or abs(value) > MAX_ABS_REWARD):
            raise BatchError(f"{seq.label(index)}: field 'reward' is {reward!r}; rewards must be finite numbers "
                             f"within +-{MAX_ABS_REWARD:g}")
    return [float(v) for v in values] if isinstance(reward, (list, tuple)) else float(reward)
