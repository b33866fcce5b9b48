"""Bad input is named precisely: which sequence, which field, what is wrong."""

from __future__ import annotations

import pytest
import torch

from treerl.errors import DataError
from treerl.tree import BatchError, TokenSequence, validate_sequences
from treerl.tree.io import read_jsonl, write_jsonl


def _ok(n: int = 4, **kw) -> TokenSequence:
    return TokenSequence(torch.arange(n), fields={"advantages": torch.zeros(n)}, **kw)


@pytest.mark.parametrize(
    "bad, message",
    [
        (TokenSequence(torch.tensor([], dtype=torch.long)), "sequence 1: field 'tokens' is empty"),
        (TokenSequence(torch.arange(4), fields={"advantages": torch.zeros(3)}), "sequence 1: field 'advantages' has shape (3,)"),
        (TokenSequence(torch.tensor([1, 99, 2])), "sequence 1: field 'tokens' has id 99 at position 1, outside the vocabulary"),
        (TokenSequence(torch.tensor([1, -1])), "sequence 1: field 'tokens' has id -1 at position 1"),
        (TokenSequence(torch.arange(20)), "sequence 1: field 'tokens' has 20 tokens, more than the model's maximum of 16"),
        (TokenSequence(torch.arange(3), fields={"advantages": torch.tensor([0.0, float("nan"), 1.0])}), "sequence 1: field 'advantages' is nan at token 1"),
        (TokenSequence(torch.arange(3), info={"reward": float("inf")}), "sequence 1: field 'reward' is inf"),
        (TokenSequence(torch.arange(3), name="ep7/turn2", info={"reward": float("nan")}), "sequence 1 ('ep7/turn2'): field 'reward'"),
    ],
)
def test_bad_sequences_are_named(bad, message):
    with pytest.raises(BatchError) as err:
        validate_sequences([_ok(), bad, _ok()], vocab_size=64, max_positions=16)
    assert message in str(err.value)


def test_empty_batch_and_good_batch():
    with pytest.raises(BatchError, match="no sequences"):
        validate_sequences([])
    validate_sequences([_ok(1), _ok(16, name="x")], vocab_size=64, max_positions=16)


def test_routed_experts_round_trip_through_jsonl_and_bad_ones_are_named(tmp_path):
    """The routing field ([tokens, decoder layers, top_k], treerl.engine.routing) is written and read back as it was;
    one with a token that is not a list of lists of integers is refused naming the line and the token."""
    routes = torch.tensor([[[0, 1], [-1, -1]], [[2, 3], [1, 0]], [[-1, -1], [-1, -1]]], dtype=torch.int16)
    path = tmp_path / "batch.jsonl"
    write_jsonl([TokenSequence(torch.tensor([4, 5, 6]), fields={"routed_experts": routes}, name="s")], path)
    [back] = read_jsonl(path)
    assert torch.equal(back.fields["routed_experts"], routes.long())
    validate_sequences([back])
    path.write_text('{"tokens": [4, 5], "routed_experts": [[[0, 1]], [0, 1]]}\n')
    with pytest.raises(DataError, match=r"batch.jsonl:1: field 'routed_experts' holds \[0, 1\] at position 1"):
        read_jsonl(path)
