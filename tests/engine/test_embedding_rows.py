"""DfsEngine adds the input embedding's gradient by rows (treerl.engine.embedding_rows): the same gradient as autograd's
dense one, tied or not, with a padding row, over walks of many backward calls; anything but a plain embedding is left
to autograd."""

from __future__ import annotations

import pytest
import torch
from support import fresh_model

from treerl.engine import DfsEngine, FlatEngine
from treerl.engine.embedding_rows import EmbeddingRows, rows_apply
from treerl.testing import assert_engines_agree
from treerl.tree import TokenSequence

PAD = 3


def _loss(view):
    return -(view.logprobs * view.fields["advantages"]).sum()


def _batch() -> list[TokenSequence]:
    """A GRPO-like group and a second prompt; the padding token appears in prompts and replies."""
    g = torch.Generator().manual_seed(0)
    prompts = [[5, PAD, 9, 12, 7, 30, 2], [40, 41, PAD, PAD, 8]]
    out = []
    for p, prompt in enumerate(prompts):
        for s in range(3):
            reply = torch.randint(0, 64, (4 + s,), generator=g).tolist() + [PAD]
            tokens = torch.tensor(prompt + reply)
            out.append(TokenSequence(tokens, fields={"advantages": torch.randn(len(tokens), generator=g,
                                                                                dtype=torch.float64)},
                                     name=f"p{p}s{s}"))
    return out


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("memory", ["micro-batch", "one-path"])
def test_gradient_by_rows_is_autograds(tied: bool, memory: str):
    model = fresh_model()
    embedding = model.get_input_embeddings()
    embedding.padding_idx = PAD
    if tied:
        model.lm_head.weight = embedding.weight
    assert rows_apply(embedding)
    errors = assert_engines_agree(model, _batch(), _loss, DfsEngine(memory=memory), FlatEngine(), tol=1e-10)
    assert "grad.model.embed_tokens.weight" in errors


def test_kept_graphs_wait_for_their_backward():
    """A lookup whose unit's backward has not run yet is not flushed (its gradient would be missing); a lookup the
    model edits in place (CTRL scales it, GIT adds positions) still sends its gradient to the table's rows."""
    model = fresh_model()
    rows = EmbeddingRows(model)
    with rows.active():
        ids = torch.tensor([[1, 2, 2]])
        first = model.get_input_embeddings()(ids)
        second = model.get_input_embeddings()(ids).mul_(3.0)
        first.sum().backward()
        rows.flush()
        grad = model.get_input_embeddings().weight.grad
        assert len(rows.pending) == 1 and torch.equal(grad[2], torch.full_like(grad[2], 2.0))  # token 2 twice
        assert grad[0].abs().sum() == 0
        second.sum().backward()
        rows.flush()
        assert rows.pending == [] and torch.equal(grad[2], torch.full_like(grad[2], 2.0 + 6.0))
    model.zero_grad(set_to_none=True)


class _Scaled(torch.nn.Embedding):
    def forward(self, ids):
        return super().forward(ids) * 2.0


@pytest.mark.parametrize("embedding, applies", [
    (torch.nn.Embedding(8, 4), True),
    (_Scaled(8, 4), False),  # a subclass may transform what it looks up
    (torch.nn.Embedding(8, 4, max_norm=1.0), False),
    (torch.nn.Embedding(8, 4, scale_grad_by_freq=True), False),
    (torch.nn.Embedding(8, 4, sparse=True), False),
    (torch.nn.Embedding(8, 4).requires_grad_(False), False),
])
def test_only_a_plain_embedding(embedding: torch.nn.Module, applies: bool):
    assert rows_apply(embedding) is applies
