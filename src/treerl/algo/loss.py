"""`build_loss`: the per-sequence `loss_fn(view)` of an `AlgoConfig`, run exactly by every engine.

Step 5 (docs/architecture.md): the loss_fn an engine calls on each sequence's outputs.

    token loss  l_t = policy_t + kl_coef * KL_t - entropy_coef * H_t       (sft: l_t = -log pi(y_t))
    policy_t    = w_t * max(-A_t r_t, -A_t clip(r_t, 1 - eps, 1 + eps_high))  (dual clip: min(., -c A_t) if A_t < 0)

r_t is pi/pi_old per token (ppo, grpo, dr_grpo, rloo, reinforce_pp), pi/pi_prox (decoupled_ppo,
with the constant w_t = pi_prox/pi_behav, 0 above the cap; w_t = 1 otherwise), or GSPO's
sequence ratio. A decoupled `rollout_correction` preset takes any policy loss's ratio against
pi_prox, and w_t is its field `rollout_weight` (`correct_rollout` wrote it, and its rejection into
the loss mask, before the update). The sequence's share of the batch loss is
`normalizer.aggregate(l, loss_mask)`, so summing over sequences in any split gives the same batch
loss. The returned metrics use the same aggregation, so their sums over sequences are batch means.
"""

from __future__ import annotations

import torch

from treerl.algo.checks import ROLLOUT_WEIGHT, check_sequence
from treerl.algo.config import AlgoConfig, uses_proximal
from treerl.algo.normalizer import LossNormalizer
from treerl.algo.policy import (
    behaviour_weight,
    clipped_surrogate,
    kl_penalty,
    sequence_ratio,
    token_ratio,
)
from treerl.engine.base import LossFn, LossResult, SequenceView


def field(view: SequenceView, name: str, like: torch.Tensor) -> torch.Tensor:
    """A per-token field on the device and in the dtype of the model output `like`."""
    return view.fields[name].to(device=like.device, dtype=like.dtype)


def build_loss(config: AlgoConfig, normalizer: LossNormalizer) -> LossFn:
    """The loss of `config`; `normalizer` must count the whole batch (all micro-batches, trees and ranks)."""
    config = config.resolved()

    def loss_fn(view: SequenceView) -> LossResult:
        check_sequence(config, view.sequence, view.index)
        logp = view.logprobs
        mask = field(view, "loss_mask", logp)

        def aggregate(values: torch.Tensor) -> torch.Tensor:
            return normalizer.aggregate(values, mask, config.aggregation, config.seq_sum_scale)

        metrics: dict[str, torch.Tensor] = {}
        if config.loss == "sft":
            token_loss = -logp
            metrics["nll"] = aggregate(token_loss.detach())
        else:
            token_loss, clipped = policy_token_loss(config, view, mask)
            metrics["policy_loss"] = aggregate(token_loss.detach())
            metrics["clip_fraction"] = aggregate(clipped.to(logp.dtype))
        if config.kl_coef > 0 and not config.kl_in_reward:
            kl = kl_penalty(logp, field(view, "ref_logprobs", logp), mask, config.kl_estimator)
            token_loss = token_loss + config.kl_coef * kl
            metrics["kl"] = aggregate(kl.detach())
        if "entropy" in view.outputs:
            if config.entropy_coef > 0:
                token_loss = token_loss - config.entropy_coef * view.entropy
            metrics["entropy"] = aggregate(view.entropy.detach())
        return aggregate(token_loss), metrics

    return loss_fn


def policy_token_loss(config: AlgoConfig, view: SequenceView, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The clipped surrogate per token for a resolved policy-gradient `config`, and where it clipped."""
    logp = view.logprobs
    old = field(view, "old_logprobs", logp)
    advantages = field(view, "advantages", logp)
    anchor = field(view, "prox_logprobs", logp) if uses_proximal(config) else old
    ratio = (sequence_ratio if config.loss == "gspo" else token_ratio)(logp, anchor, mask)
    loss, clipped = clipped_surrogate(ratio, advantages, config.clip_eps, config.clip_eps_high, config.dual_clip)
    if uses_proximal(config):
        loss = loss * behaviour_correction(config, view, anchor, old, mask)
    return loss, clipped


def behaviour_correction(config: AlgoConfig, view: SequenceView, prox: torch.Tensor, behav: torch.Tensor,
                         mask: torch.Tensor) -> torch.Tensor:
    """The constant weight that corrects pi_prox towards the sampler's pi_behav: the rollout_correction preset's
    (its field, fixed for the batch), or (with none) decoupled PPO's pi_prox / pi_behav, dropped above
    behav_imp_weight_cap."""
    if config.rollout_correction == "none":
        return behaviour_weight(prox, behav, mask, config.behav_imp_weight_cap)
    return field(view, ROLLOUT_WEIGHT, prox)
