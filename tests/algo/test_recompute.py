"""Reference and proximal log-probs recomputed over the tree equal the flat reference's."""

from __future__ import annotations

import pytest
import torch
from algo_testing import RTOL, VOCAB, make_batch

from treerl.algo import AlgoConfig, LossNormalizer, build_loss, fill_fields, validate_batch
from treerl.engine import DfsEngine, FlatEngine
from treerl.models import build_model


def test_fill_fields_over_the_tree_equals_flat(policy) -> None:
    reference = build_model(shape="tiny-qwen3", vocab_size=VOCAB, dtype=torch.float64, seed=11)
    batch = make_batch(policy, seed=2, sequences=6, length=12)
    flat = [out["logprobs"] for out in FlatEngine().forward(reference, batch)]
    fill_fields(DfsEngine(), reference, batch, {"logprobs": "ref_logprobs"})
    fill_fields(DfsEngine(chunk_tokens=3), policy, batch, {"logprobs": "prox_logprobs", "entropy": "old_entropy"})
    own = FlatEngine().forward(policy, batch)
    for seq, want, mine in zip(batch, flat, own):
        assert (seq.fields["ref_logprobs"] - want).norm() <= RTOL * want.norm()
        assert (seq.fields["prox_logprobs"] - mine["logprobs"]).norm() <= RTOL * mine["logprobs"].norm()
        assert not seq.fields["ref_logprobs"].requires_grad and seq.fields["ref_logprobs"][0] == 0.0
    # Recomputed fields are valid loss inputs: decoupled PPO with a KL to the reference runs on them.
    config = AlgoConfig(loss="decoupled_ppo", kl_coef=0.1)
    validate_batch(config, batch)
    DfsEngine().forward_backward(policy, batch, build_loss(config, LossNormalizer.from_sequences(batch)))


def test_fill_fields_names_a_missing_output(policy) -> None:
    batch = make_batch(policy, seed=2, sequences=2)
    with pytest.raises(KeyError, match="no output 'values'"):
        fill_fields(FlatEngine(), policy, batch, {"values": "values"})
