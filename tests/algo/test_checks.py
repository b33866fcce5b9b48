"""Bad input: a clear error naming the sequence and the field, before any compute."""

from __future__ import annotations

import math

import pytest
import torch

from treerl.algo import AlgoConfig, LossNormalizer, build_loss, compute_advantages, validate_batch
from treerl.engine import DfsEngine
from treerl.tree import BatchError, TokenSequence


def good_sequence(name: str = "s") -> TokenSequence:
    n = 5
    return TokenSequence(
        torch.arange(n),
        {
            "loss_mask": torch.tensor([0.0, 1.0, 1.0, 1.0, 1.0]),
            "advantages": torch.ones(n),
            "old_logprobs": torch.full((n,), -1.0),
            "ref_logprobs": torch.full((n,), -1.2),
        },
        {"reward": 1.0, "group": 0},
        name=name,
    )


def batch_with(field: str, value, position: int = 2) -> list[TokenSequence]:
    bad = good_sequence("bad")
    if field in bad.fields:
        bad.fields[field][position] = value
    return [good_sequence("ok"), bad]


CONFIG = AlgoConfig(loss="grpo", kl_coef=0.1)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_nan_or_inf_advantages(value: float) -> None:
    with pytest.raises(BatchError, match=r"sequence 1 \('bad'\): field 'advantages' is (nan|inf|-inf) at token 2"):
        validate_batch(CONFIG, batch_with("advantages", value))


@pytest.mark.parametrize("reward", [math.nan, math.inf, [1.0, math.nan]])
def test_nan_or_inf_rewards(reward) -> None:
    batch = [good_sequence("ok"), good_sequence("bad")]
    batch[1].info["reward"] = reward
    with pytest.raises(BatchError, match=r"sequence 1 \('bad'\): field 'reward'"):
        compute_advantages(CONFIG, batch)


def test_missing_reward_or_group() -> None:
    batch = [good_sequence("ok"), good_sequence("bad")]
    del batch[1].info["group"]
    with pytest.raises(BatchError, match=r"sequence 1 \('bad'\): field 'group' is missing"):
        compute_advantages(CONFIG, batch)
    del batch[1].info["reward"]
    with pytest.raises(BatchError, match=r"sequence 1 \('bad'\): field 'reward' is missing"):
        compute_advantages(CONFIG, batch)


def test_per_turn_rewards_must_match_the_turns() -> None:
    batch = [good_sequence("bad")]
    batch[0].info["reward"] = [1.0, 2.0]  # the mask has one turn
    with pytest.raises(BatchError, match=r"sequence 0 \('bad'\): field 'reward': 2 per-turn rewards for 1 turns"):
        compute_advantages(AlgoConfig(loss="reinforce_pp"), batch)
    with pytest.raises(BatchError, match=r"sequence 0 \('bad'\): field 'reward' is a list of per-turn rewards"):
        compute_advantages(AlgoConfig(loss="grpo"), batch)


@pytest.mark.parametrize("field", ["old_logprobs", "ref_logprobs"])
def test_positive_logprobs(field: str) -> None:
    with pytest.raises(
        BatchError, match=rf"sequence 1 \('bad'\): field '{field}' is 0.5 at token 2; log-probabilities must be <= 0"
    ):
        validate_batch(CONFIG, batch_with(field, 0.5))


def test_mismatched_lengths() -> None:
    batch = [good_sequence("ok"), good_sequence("bad")]
    batch[1].fields["old_logprobs"] = torch.full((4,), -1.0)
    with pytest.raises(
        BatchError, match=r"sequence 1 \('bad'\): field 'old_logprobs' has shape \(4,\), but the sequence has 5 tokens"
    ):
        validate_batch(CONFIG, batch)
    with pytest.raises(BatchError, match=r"sequence 1 \('bad'\): field 'old_logprobs' has shape"):
        LossNormalizer.from_sequences(batch)


@pytest.mark.parametrize("field", ["advantages", "old_logprobs", "ref_logprobs", "loss_mask"])
def test_missing_fields(field: str) -> None:
    batch = [good_sequence("ok"), good_sequence("bad")]
    del batch[1].fields[field]
    with pytest.raises(BatchError, match=rf"sequence 1 \('bad'\): field '{field}' is missing"):
        validate_batch(CONFIG, batch)


def test_decoupled_ppo_needs_proximal_logprobs() -> None:
    with pytest.raises(
        BatchError, match=r"sequence 0 \('ok'\): field 'prox_logprobs' is missing \(needed by algo.loss=decoupled_ppo\)"
    ):
        validate_batch(AlgoConfig(loss="decoupled_ppo"), [good_sequence("ok")])


def test_trained_token_zero_and_negative_masks() -> None:
    with pytest.raises(
        BatchError, match=r"sequence 1 \('bad'\): field 'loss_mask' is 1.0 at token 0, but token 0 has no prediction"
    ):
        validate_batch(CONFIG, batch_with("loss_mask", 1.0, position=0))
    with pytest.raises(BatchError, match=r"sequence 1 \('bad'\): field 'loss_mask' is -1.0 at token 2"):
        validate_batch(CONFIG, batch_with("loss_mask", -1.0))


def test_the_loss_itself_rejects_bad_fields(policy) -> None:
    """Even without validate_batch, the loss stops on the first sequence it sees (names kept)."""
    batch = batch_with("old_logprobs", 0.5)
    loss_fn = build_loss(CONFIG, LossNormalizer.from_sequences(batch))
    with pytest.raises(BatchError, match=r"\('bad'\): field 'old_logprobs' is 0.5 at token 2"):
        DfsEngine().forward_backward(policy, batch, loss_fn)


def test_good_batch_passes() -> None:
    batch = [good_sequence("a"), good_sequence("b")]
    validate_batch(CONFIG, batch)
    compute_advantages(CONFIG, batch)
    assert batch[0].fields["advantages"].tolist() == [0.0] * 5  # equal rewards in one group
