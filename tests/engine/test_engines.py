"""Engine behaviour beyond exactness: the reference itself, bad input, memory bounded by the path."""

from __future__ import annotations

import pytest
import torch
from support import tiny_model

from treerl.bench.peak import peak_memory
from treerl.bench.workloads import grpo_groups
from treerl.engine import DfsEngine, FlatEngine, PackedEngine
from treerl.tree import BatchError, TokenSequence

ENGINES = [FlatEngine(), DfsEngine(), DfsEngine(recompute="always", chunk_tokens=4), PackedEngine()]


def _loss(view):
    return -(view.logprobs * view.fields["advantages"]).sum() - 0.1 * view.entropy.sum()


def test_flat_reference_matches_plain_transformers(model):
    """The reference is what `model(input_ids).logits` and log_softmax give, sequence by sequence."""
    g = torch.Generator().manual_seed(0)
    seqs = [
        TokenSequence(torch.randint(0, 64, (n,), generator=g), fields={"advantages": torch.randn(n, generator=g, dtype=torch.float64)})
        for n in (5, 9, 1, 3)
    ]
    outputs = FlatEngine(max_tokens=12).forward(model, seqs)
    model.zero_grad(set_to_none=True)
    FlatEngine(max_tokens=12).forward_backward(model, seqs, _loss)
    engine_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    total = 0
    for seq, out in zip(seqs, outputs):
        logits = model(input_ids=seq.tokens[None, :-1]).logits[0] if len(seq) > 1 else torch.zeros(0, 64, dtype=torch.float64)
        logp = torch.log_softmax(logits.double(), -1)
        lp = torch.cat([torch.zeros(1, dtype=torch.float64), logp.gather(1, seq.tokens[1:, None])[:, 0]])
        ent = torch.cat([torch.zeros(1, dtype=torch.float64), -(logp.exp() * logp).sum(-1)])
        torch.testing.assert_close(out["logprobs"], lp.detach(), rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(out["entropy"], ent.detach(), rtol=1e-10, atol=1e-10)
        total = total + (-(lp * seq.fields["advantages"]).sum() - 0.1 * ent.sum())
    total.backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(engine_grads[name], p.grad, rtol=1e-8, atol=1e-10)
    model.zero_grad(set_to_none=True)


BAD = [
    (TokenSequence(torch.tensor([], dtype=torch.long)), "sequence 1: field 'tokens' is empty"),
    (TokenSequence(torch.arange(5), fields={"advantages": torch.zeros(4)}), "sequence 1: field 'advantages' has shape (4,)"),
    (TokenSequence(torch.tensor([3, 64])), "sequence 1: field 'tokens' has id 64 at position 1, outside the vocabulary [0, 64)"),
    (TokenSequence(torch.zeros(40000, dtype=torch.long)), "more than the model's maximum of 32768 positions"),
    (TokenSequence(torch.arange(3), fields={"advantages": torch.tensor([0.0, float("inf"), 0.0])}), "field 'advantages' is inf at token 1"),
    (TokenSequence(torch.arange(3), info={"reward": float("nan")}), "sequence 1: field 'reward' is nan"),
]


@pytest.mark.parametrize("engine", ENGINES, ids=["flat", "dfs", "dfs-recompute", "packed"])
@pytest.mark.parametrize("bad, message", BAD, ids=[m for _, m in BAD])
def test_bad_input_is_named_before_any_compute(engine, bad, message):
    model = tiny_model("tiny-qwen3")
    calls = []
    hook = model.get_input_embeddings().register_forward_hook(lambda *a: calls.append(1))
    good = TokenSequence(torch.arange(4), fields={"advantages": torch.zeros(4)})
    try:
        for run in (lambda b: engine.forward(model, b), lambda b: engine.forward_backward(model, b, _loss)):
            with pytest.raises(BatchError) as err:
                run([good, bad])
            assert message in str(err.value)
    finally:
        hook.remove()
    assert not calls, "the model ran before the input was checked"
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.slow  # ~8 s on 2 cores
def test_dfs_memory_is_bounded_by_the_path_not_the_batch():
    """64 samples sharing one prompt: the DFS engine's peak stays near one sample's; flat's grows.

    Sibling batching trades memory for speed up to `batch_tokens` per call; with room for one
    sample per call, what is held is one path.
    """
    model = tiny_model("tiny-qwen3", 512)
    one = grpo_groups(prompts=1, group_size=1, prompt_len=192, response_len=48, vocab=512)
    many = grpo_groups(prompts=1, group_size=64, prompt_len=192, response_len=48, vocab=512)

    def loss(view):
        return -(view.logprobs * view.fields["advantages"] * view.fields["loss_mask"]).sum()

    def peak(engine, seqs):
        out = peak_memory(lambda: engine.forward_backward(model, seqs, loss))
        model.zero_grad(set_to_none=True)
        return out

    for engine in (DfsEngine(recompute="never", batch_tokens=64), DfsEngine(recompute="always", chunk_tokens=64, batch_tokens=64)):
        ratio = peak(engine, many) / peak(engine, one)
        assert ratio < 3, f"{engine}: 64 sequences took {ratio:.1f}x the memory of one"
    flat = FlatEngine(layout="packed")  # rows of up to 8192 tokens: the whole batch in one call here
    flat_ratio = peak(flat, many) / peak(flat, one)
    assert flat_ratio > 10, f"flat should grow with the batch; got {flat_ratio:.1f}x"


def test_one_path_memory_stays_near_the_one_path_walk():
    """Turn chains (each call extends the last, as agents' are): memory="one-path" packs calls but holds at most
    1.5x the one-path walk's peak; an explicit token budget may hold more (and does, when it packs the chain)."""
    model = tiny_model("tiny-qwen3", 512)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 512, (8 * 60,), generator=gen)
    # the whole chain, and at each turn a reply that forks from it: nodes of 60 tokens, one sequence of 480
    forks = [torch.cat([tokens[: 60 * k], torch.randint(0, 512, (10,), generator=gen)]) for k in range(1, 8)]
    chain = [TokenSequence(t, fields={"advantages": torch.randn(len(t), generator=gen)}) for t in [tokens, *forks]]

    def peak(engine):
        out = peak_memory(lambda: engine.forward_backward(model, chain, _loss))
        model.zero_grad(set_to_none=True)
        return out

    one_path = peak(DfsEngine(batch_tokens=0, recompute="always"))
    assert peak(DfsEngine(memory="one-path")) <= 1.5 * one_path
    assert peak(DfsEngine(memory_budget_tokens=8 * 70)) > 2 * one_path  # the whole tree in one call


def test_one_memory_budget_at_a_time():
    model = tiny_model("tiny-qwen3")
    seqs = [TokenSequence(torch.arange(4), fields={"advantages": torch.zeros(4)})]
    with pytest.raises(ValueError, match="set one memory budget, not memory_budget_tokens and memory_budget_bytes"):
        DfsEngine(memory_budget_tokens=10, memory_budget_bytes=10).forward_backward(model, seqs, _loss)
    with pytest.raises(ValueError, match="memory_budget_tokens must be > 0"):
        DfsEngine(memory_budget_tokens=0).forward_backward(model, seqs, _loss)
