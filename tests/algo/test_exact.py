"""Every loss and aggregation: the tree engine's loss and gradients equal the flat reference, and
a batch split into parts (micro-batches, several trees) with one global normaliser sums to the same.

No loss function or normaliser is shared between the reference and an engine under test: the flat
reference counts its normaliser by hand from the masks, each engine run builds its own loss from
`LossNormalizer.from_sequences` of its parts, added (so a miscount there, or in `+`, is caught)."""

from __future__ import annotations

import random

import pytest
import torch
from algo_testing import assert_same_step, counted_by_hand, counted_per_part, make_batch, train_step
from hypothesis import given, settings
from hypothesis import strategies as st

from treerl.algo import AlgoConfig, LossNormalizer, build_loss
from treerl.algo.config import AGGREGATIONS, KL_ESTIMATORS, LOSSES
from treerl.engine import DfsEngine, FlatEngine
from treerl.tree import TokenSequence

TREE_ENGINES = {
    "dfs": DfsEngine(),
    "dfs-no-sibling-batching-recompute-chunked": DfsEngine(recompute="always", chunk_tokens=3, batch_tokens=0),
}


def full_config(loss: str, aggregation: str, kl_estimator: str = "k3") -> AlgoConfig:
    """Every option of `loss` switched on, so each term is exercised."""
    return AlgoConfig(
        loss=loss,
        aggregation=aggregation,
        seq_sum_scale=7.0,
        dual_clip=None if loss in ("sft", "gspo") else 3.0,
        clip_eps_high=None if loss == "gspo" else 0.28,
        behav_imp_weight_cap=2.0 if loss == "decoupled_ppo" else None,
        kl_coef=0.1,
        kl_estimator=kl_estimator,
        kl_in_reward=False,
        entropy_coef=0.01,
    )


def reference(policy, config: AlgoConfig, batch: list[TokenSequence]):
    """FlatEngine on the whole batch, with a normaliser counted by hand."""
    return train_step(FlatEngine(), policy, [batch], build_loss(config, counted_by_hand(batch)))


def step(engine, policy, config: AlgoConfig, parts: list[list[TokenSequence]]):
    """`engine` on `parts` with a loss of its own, normalised by the parts' counts added."""
    return train_step(engine, policy, parts, build_loss(config, counted_per_part(parts)))


def split(batch: list[TokenSequence], seed: int) -> list[list[TokenSequence]]:
    """The batch shuffled and cut in two non-empty parts (one part if it has one sequence)."""
    order = list(batch)
    random.Random(seed).shuffle(order)
    cut = random.Random(seed + 1).randint(1, max(len(order) - 1, 1))
    return [order[:cut], order[cut:]] if len(order) > 1 else [order]


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("loss", LOSSES)
def test_every_loss_and_aggregation_matches_flat(policy, loss: str, aggregation: str) -> None:
    batch = make_batch(policy, seed=LOSSES.index(loss) * 10 + AGGREGATIONS.index(aggregation), sequences=6, length=12)
    config = full_config(loss, aggregation)
    want = reference(policy, config, batch)
    assert want[1]["entropy"] > 0 and any(g.norm() > 0 for g in want[2].values())
    for engine in TREE_ENGINES.values():
        assert_same_step(step(engine, policy, config, [batch]), want)
    assert_same_step(step(DfsEngine(), policy, config, split(batch, 0)), want)


@pytest.mark.parametrize("loss", LOSSES)
@settings(max_examples=10, deadline=None, derandomize=True)
@given(
    seed=st.integers(0, 2**16),
    sequences=st.integers(1, 6),
    length=st.integers(2, 14),
    sharing=st.sampled_from([1.0, 2.0, 4.0]),
    noise=st.sampled_from([0.0, 0.05, 0.5]),
    aggregation=st.sampled_from(AGGREGATIONS),
    kl_estimator=st.sampled_from(KL_ESTIMATORS),
    zero_masks=st.booleans(),
)
def test_random_trees_match_flat_whole_and_split(
    policy, loss, seed, sequences, length, sharing, noise, aggregation, kl_estimator, zero_masks
) -> None:
    batch = make_batch(policy, seed, sequences, length, sharing, noise, zero_masks)
    config = full_config(loss, aggregation, kl_estimator)
    want = reference(policy, config, batch)
    assert_same_step(step(DfsEngine(), policy, config, [batch]), want)
    assert_same_step(step(DfsEngine(), policy, config, split(batch, seed)), want)
    assert_same_step(step(FlatEngine(), policy, config, split(batch, seed)), want)


@pytest.mark.parametrize("loss", LOSSES)
def test_duplicates_and_prefixes_with_different_fields(policy, loss: str) -> None:
    """Identical sequences and a sequence that is a prefix of another, each with its own fields."""
    base = make_batch(policy, seed=7, sequences=2, length=10, sharing=1.0)
    long = base[0]
    twin = TokenSequence(
        long.tokens.clone(),
        {k: v.flip(0) * 0.5 if k == "advantages" else v.clone() for k, v in long.fields.items()},
        dict(long.info, reward=5.0),
        name="twin",
    )
    twin.fields["old_logprobs"] = (twin.fields["old_logprobs"] - 0.2).clamp(max=0.0)
    prefix = TokenSequence(
        long.tokens[:6].clone(),
        {k: v[:6].clone() + (0.3 if k == "advantages" else 0.0) for k, v in long.fields.items()},
        dict(long.info),
        name="prefix",
    )
    batch = [long, twin, prefix, base[1]]
    for aggregation in AGGREGATIONS:
        config = full_config(loss, aggregation)
        want = reference(policy, config, batch)
        assert_same_step(step(DfsEngine(), policy, config, [batch]), want)
        assert_same_step(step(DfsEngine(chunk_tokens=2, recompute="always"), policy, config, [batch]), want)


def test_all_zero_masks_give_zero_loss_and_gradient(policy) -> None:
    batch = make_batch(policy, seed=3, sequences=4)
    for seq in batch:
        seq.fields["loss_mask"].zero_()
    for loss in LOSSES:
        loss_fn = build_loss(full_config(loss, "token_mean"), LossNormalizer.from_sequences(batch))
        loss_value, _, grads = train_step(DfsEngine(), policy, [batch], loss_fn)
        assert loss_value == 0.0
        assert all(torch.count_nonzero(g) == 0 for g in grads.values())


def test_per_part_normalisers_would_be_wrong(policy) -> None:
    """The control: normalising each part by its own counts changes the gradient; the global one does not."""
    batch = make_batch(policy, seed=4, sequences=6, length=12)
    parts = [batch[:1], batch[1:]]
    for aggregation in AGGREGATIONS:
        config = full_config("grpo", aggregation)
        want = reference(policy, config, batch)
        policy.zero_grad(set_to_none=True)
        for part in parts:
            DfsEngine().forward_backward(policy, part, build_loss(config, LossNormalizer.from_sequences(part)))
        wrong = policy.lm_head.weight.grad
        assert (wrong - want[2]["lm_head.weight"]).norm() > 1e-3 * want[2]["lm_head.weight"].norm(), aggregation
