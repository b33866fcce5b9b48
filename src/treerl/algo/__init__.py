"""RL and SFT objectives as per-sequence losses that every engine runs exactly (docs/algorithms.md).

Steps 3 and 5 (docs/architecture.md): advantages before the update, the per-sequence loss inside it.

Field conventions (all per-token fields are aligned with the tokens, same length):
    loss_mask      weight of each token in the loss (1 trained, 0 not). Token 0 has no
                   prediction (the engines output 0 there), so loss_mask[0] must be 0: a
                   nonzero value is an error naming the sequence. A mask of all zeros is
                   allowed and contributes exactly 0.
    advantages     A_t (written by `compute_advantages`, or supplied).
    old_logprobs   behaviour policy log pi_behav(y_t | y_<t), from the rollout's sampler; <= 0.
    prox_logprobs  proximal policy log-probs (decoupled PPO): the policy before this update,
                   recomputed with `fill_fields(engine, policy, batch, {"logprobs": "prox_logprobs"})`.
    ref_logprobs   reference policy log-probs for the KL penalty (`fill_fields` on the reference model).
    values         the critic's values when the batch was made: values[t] = V(tokens[:t]), the
                   value of the state in which token t was chosen (`fill_fields` with a ValueHead engine).
    returns        the critic's regression targets (written by GAE).
    rollout_weight a decoupled `algo.rollout_correction` preset's importance weight, written with its
                   rejection (into loss_mask; the mask before it in `sampled_loss_mask`) by
                   `correct_rollout` after the proximal log-probs (docs/mismatch.md).
Per-sequence `info`:
    reward         a number (outcome), or a list with one reward per turn (a turn = a maximal run
                   of loss_mask > 0) for a sequence holding a multi-turn episode.
    group          sequences answering the same prompt share it (GRPO, Dr. GRPO, RLOO).

Batch-wide denominators come from `LossNormalizer.from_sequences(whole_batch)`, computed once
and passed to `build_loss`, so any split into trees, micro-batches or ranks sums to the same loss.
"""

from treerl.algo.advantages import (
    compute_advantages,
    gae,
    group_advantages,
    rloo_advantages,
    token_rewards,
    turn_returns,
)
from treerl.algo.checks import validate_batch
from treerl.algo.config import AlgoConfig
from treerl.algo.correction import correct_rollout
from treerl.algo.critic import build_critic, build_value_loss
from treerl.algo.fields import fill_fields
from treerl.algo.loss import build_loss
from treerl.algo.normalizer import LossNormalizer

__all__ = [
    "AlgoConfig",
    "LossNormalizer",
    "build_critic",
    "build_loss",
    "build_value_loss",
    "compute_advantages",
    "correct_rollout",
    "fill_fields",
    "gae",
    "group_advantages",
    "rloo_advantages",
    "token_rewards",
    "turn_returns",
    "validate_batch",
]
