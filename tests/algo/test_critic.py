"""The critic: per-token values and value-loss gradients from the tree engine equal the flat reference,
and the value head reproduces transformers' own token-classification forward."""

from __future__ import annotations

import pytest
import torch
from algo_testing import (
    STOCK_RTOL,
    add_critic_fields,
    assert_same_step,
    counted_by_hand,
    counted_per_part,
    make_batch,
    train_step,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from treerl.algo import AlgoConfig, LossNormalizer, build_critic, build_value_loss, compute_advantages, fill_fields
from treerl.algo.config import AGGREGATIONS
from treerl.engine import DfsEngine, FlatEngine
from treerl.engine.base import SequenceView, split_loss
from treerl.engine.head import ValueHead
from treerl.errors import ModelPathError
from treerl.models import build_model
from treerl.tree import TokenSequence


@pytest.mark.parametrize("shifted", [True, False])
def test_values_match_flat_and_transformers(policy, critic, shifted: bool) -> None:
    batch = make_batch(policy, seed=5, sequences=6, length=12)
    head = ValueHead(shifted=shifted)
    flat = FlatEngine(head=head).forward(critic, batch)
    for engine in [DfsEngine(head=head), DfsEngine(head=head, recompute="always", chunk_tokens=3, batch_tokens=0)]:
        for got, want in zip(engine.forward(critic, batch), flat):
            assert (got["values"] - want["values"]).norm() <= STOCK_RTOL * want["values"].norm()
    with torch.no_grad():
        for seq, out in zip(batch, flat):
            logits = critic(input_ids=seq.tokens[None]).logits[0, :, 0]
            want = torch.cat([logits.new_zeros(1), logits[:-1]]) if shifted else logits
            assert torch.allclose(out["values"], want, rtol=STOCK_RTOL, atol=1e-9)


@settings(max_examples=10, deadline=None, derandomize=True)
@given(
    seed=st.integers(0, 2**16),
    sequences=st.integers(1, 6),
    length=st.integers(2, 14),
    sharing=st.sampled_from([1.0, 3.0]),
    aggregation=st.sampled_from(AGGREGATIONS),
    value_clip=st.sampled_from([None, 0.1]),
    shifted=st.booleans(),
)
def test_value_loss_gradients_match_flat(
    policy, critic, seed, sequences, length, sharing, aggregation, value_clip, shifted
) -> None:
    batch = make_batch(policy, seed, sequences, length, sharing)
    add_critic_fields(critic, batch, seed)
    config = AlgoConfig(loss="ppo", aggregation=aggregation, value_clip=value_clip)
    head = ValueHead(shifted=shifted)

    def step(engine, parts):  # each engine run gets its own loss, normalised by its parts' counts added
        return train_step(engine, critic, parts, build_value_loss(config, counted_per_part(parts)))

    want = train_step(FlatEngine(head=head), critic, [batch], build_value_loss(config, counted_by_hand(batch)))
    assert_same_step(step(DfsEngine(head=head), [batch]), want, STOCK_RTOL)
    parts = [batch[::2], batch[1::2]] if len(batch) > 1 else [batch]
    assert_same_step(step(DfsEngine(head=head, recompute="always", chunk_tokens=4), parts), want, STOCK_RTOL)


def test_value_loss_by_hand() -> None:
    # V = 1.0, old 0.5, R = 0.9, clip 0.2: unclipped 0.01, clipped (0.7 - 0.9)^2 = 0.04 wins -> 0.02, no gradient.
    # V = 0.6, old 0.5, R = 1.0: inside the clip, 0.5 * 0.16 = 0.08, gradient V - R = -0.4. Mean over 2 tokens.
    values = torch.tensor([0.0, 1.0, 0.6], dtype=torch.float64, requires_grad=True)
    seq = TokenSequence(
        torch.arange(3),
        {
            "loss_mask": torch.tensor([0.0, 1.0, 1.0]),
            "values": torch.tensor([0.0, 0.5, 0.5]),
            "returns": torch.tensor([0.0, 0.9, 1.0]),
        },
    )
    loss_fn = build_value_loss(AlgoConfig(loss="ppo", value_clip=0.2), LossNormalizer.from_sequences([seq]))
    loss, metrics = split_loss(loss_fn(SequenceView(0, seq, {"values": values})))
    loss.backward()
    assert float(loss.detach()) == pytest.approx((0.02 + 0.08) / 2)
    assert values.grad.tolist() == pytest.approx([0.0, 0.0, -0.4 / 2])
    assert float(metrics["value_clip_fraction"]) == pytest.approx(0.5)


def test_gae_from_tree_values_end_to_end(policy, critic) -> None:
    """values from the tree engine -> GAE -> value loss; the same as with the flat engine."""
    batch = make_batch(policy, seed=9, sequences=5, length=10)
    results = []
    for engine in [FlatEngine(head=ValueHead()), DfsEngine(head=ValueHead())]:
        copies = [TokenSequence(s.tokens, dict(s.fields), dict(s.info), s.name) for s in batch]
        fill_fields(engine, critic, copies, {"values": "values"})
        compute_advantages(AlgoConfig(loss="ppo", gamma=0.95, lam=0.9), copies)
        results.append(torch.cat([torch.cat([s.fields["advantages"], s.fields["returns"]]) for s in copies]))
    assert (results[0] - results[1]).norm() <= STOCK_RTOL * results[0].norm()


def test_value_head_rejects_models_it_cannot_run(policy) -> None:
    with pytest.raises(NotImplementedError, match="a value head needs `model.score`"):
        FlatEngine(head=ValueHead()).forward(policy, [TokenSequence(torch.arange(3))])
    dropped = build_critic(shape="tiny-qwen3")
    dropped.dropout.p = 0.1
    with pytest.raises(NotImplementedError, match="value dropout p=0.1"):  # every engine, the flat one too
        FlatEngine(head=ValueHead()).forward(dropped, [TokenSequence(torch.arange(3))])
    with pytest.raises(NotImplementedError, match="dropout p=0.1"):
        DfsEngine(head=ValueHead()).forward(dropped, [TokenSequence(torch.arange(3))])


def test_critic_loads_a_causal_lm_body_from_a_local_path(tmp_path) -> None:
    lm = build_model(shape="tiny-qwen2", dtype=torch.float64, seed=3)
    lm.save_pretrained(tmp_path)
    critic = build_critic(str(tmp_path), dtype=torch.float64)
    body, loaded = lm.base_model.state_dict(), critic.base_model.state_dict()
    assert body.keys() == loaded.keys() and all(torch.equal(body[k], loaded[k]) for k in body)
    assert critic.score.out_features == 1 and critic.dropout.p == 0.0
    with pytest.raises(ModelPathError, match="does not exist"):
        build_critic(str(tmp_path / "missing"))
