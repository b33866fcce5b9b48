"""The chunked log-prob/entropy head: right values, right gradients, any chunk size."""

from __future__ import annotations

import pytest
import torch

from treerl.engine.head import LogitTransform, logprobs_and_entropy

PLAIN = LogitTransform()
TRANSFORMS = [PLAIN, LogitTransform(scale=0.25), LogitTransform(softcap=1.5), LogitTransform(scale=3.0, softcap=2.0)]


def _reference(hidden, weight, bias, targets, t, transform=PLAIN):
    logits = transform.apply(torch.nn.functional.linear(hidden, weight, bias)) / t
    logp = torch.log_softmax(logits, -1)
    entropy = -(logp.exp() * logp).sum(-1)
    return logp.gather(1, targets[:, None])[:, 0], entropy


@pytest.mark.parametrize("transform", TRANSFORMS, ids=repr)
def test_values_and_gradients_match_plain_log_softmax(transform):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(7, 5, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(11, 5, dtype=torch.float64, generator=g, requires_grad=True)
    bias = torch.randn(11, dtype=torch.float64, generator=g, requires_grad=True)
    targets = torch.randint(0, 11, (7,), generator=g)
    w_lp, w_ent = torch.randn(7, generator=g, dtype=torch.float64), torch.randn(7, generator=g, dtype=torch.float64)
    for t in (1.0, 0.6):
        lp, ent = _reference(hidden, weight, bias, targets, t, transform)
        expected = torch.autograd.grad((lp * w_lp).sum() + (ent * w_ent).sum(), [hidden, weight, bias])
        for chunk in (1, 3, 100):
            lp2, ent2 = logprobs_and_entropy(hidden, weight, bias, targets, transform, t, chunk)
            torch.testing.assert_close(lp2, lp, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(ent2, ent, rtol=1e-12, atol=1e-12)
            got = torch.autograd.grad((lp2 * w_lp).sum() + (ent2 * w_ent).sum(), [hidden, weight, bias])
            for a, b in zip(got, expected):
                torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("transform", TRANSFORMS, ids=repr)
def test_gradcheck(transform):
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(4, 3, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(6, 3, dtype=torch.float64, generator=g, requires_grad=True)
    targets = torch.randint(0, 6, (4,), generator=g)
    assert torch.autograd.gradcheck(lambda h, w: logprobs_and_entropy(h, w, None, targets, transform, 0.8, 3), (hidden, weight))


def test_low_precision_hidden_computes_in_float32():
    hidden = torch.randn(3, 4).bfloat16()
    weight = torch.randn(9, 4).bfloat16()
    lp, ent = logprobs_and_entropy(hidden, weight, None, torch.tensor([0, 1, 2]), PLAIN, 1.0, 2)
    assert lp.dtype == ent.dtype == torch.float32


def _head_inputs(dtype=torch.float64, vocab: int = 50, rows: int = 9, width: int = 6, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, width, generator=g).to(dtype).requires_grad_()
    weight = torch.nn.Parameter(torch.randn(vocab, width, generator=g).to(dtype))
    targets = torch.randint(0, vocab, (rows,), generator=g)
    return hidden, weight, targets


def _vocab_sized(fn, weight: torch.Tensor) -> list[int]:
    """Sizes of the tensors allocated while `fn` runs that hold exactly [vocab, hidden] elements of a float dtype
    (torch's profiler allocation events; kernels' own workspaces have other sizes)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    sizes = {weight.numel() * n for n in (2, 4, 8)}
    return [e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]" and e.nbytes() in sizes]


def test_backward_adds_into_weight_grad_in_place_without_a_vocab_sized_buffer():
    """Engines call .backward(): the head adds its weight gradient into .grad chunk by chunk, allocating no
    [vocab, hidden] buffer (the first call creates .grad itself, as autograd would)."""
    hidden, weight, targets = _head_inputs(vocab=4000, width=24)
    expected = torch.autograd.grad(logprobs_and_entropy(hidden, weight, None, targets, chunk_rows=4)[0].sum(), weight)[0]
    logprobs_and_entropy(hidden, weight, None, targets, chunk_rows=4, in_place=True)[0].sum().backward()
    grad = weight.grad
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-12)
    loss = logprobs_and_entropy(hidden, weight, None, targets, chunk_rows=4, in_place=True)[0].sum()
    assert _vocab_sized(loss.backward, weight) == []
    assert weight.grad is grad  # accumulated into, not replaced
    torch.testing.assert_close(grad, 2 * expected, rtol=1e-12, atol=1e-12)
    loss = logprobs_and_entropy(hidden, weight, None, targets, chunk_rows=4)[0].sum()  # in_place=False: returned
    assert _vocab_sized(loss.backward, weight) == [weight.numel() * 8]  # (what the check above would see)


def test_autograd_grad_and_hooks_still_get_the_gradient():
    """Where autograd itself must see the weight's gradient (torch.autograd.grad, a hook), it is returned."""
    hidden, weight, targets = _head_inputs()
    expected = torch.autograd.grad(logprobs_and_entropy(hidden, weight, None, targets, chunk_rows=4)[0].sum(), weight)[0]
    got = torch.autograd.grad(logprobs_and_entropy(hidden, weight, None, targets, chunk_rows=4, in_place=True)[0].sum(),
                              weight)[0]
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    assert weight.grad is None
    seen = []
    weight.register_hook(lambda g: seen.append(g.clone()))
    logprobs_and_entropy(hidden, weight, None, targets, chunk_rows=4, in_place=True)[0].sum().backward()
    assert len(seen) == 1 and torch.allclose(seen[0], expected)
    torch.testing.assert_close(weight.grad, expected, rtol=1e-12, atol=1e-12)


def test_under_autocast_the_matmuls_run_in_bfloat16_and_the_gradient_lands_in_float32():
    """bf16-mixed: logits from bfloat16-rounded operands (as the model's own LM head under autocast), softmax and
    gradients in float32, no float32 copy of the weight per chunk."""
    hidden, weight, targets = _head_inputs(dtype=torch.float32, vocab=3000, width=16)
    weight.grad = torch.zeros_like(weight)  # as after an earlier call
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logprobs, _ = logprobs_and_entropy(hidden, weight, None, targets, chunk_rows=2, in_place=True)
        own = torch.nn.functional.linear(hidden, weight)  # what the model's lm_head gives under autocast
    expected = torch.log_softmax(own.float(), -1).gather(1, targets[:, None])[:, 0]
    assert logprobs.dtype == torch.float32
    torch.testing.assert_close(logprobs, expected, rtol=0, atol=1e-5)
    full = torch.log_softmax(hidden @ weight.T, -1).gather(1, targets[:, None])[:, 0]
    assert (logprobs - full).abs().max() > 1e-4  # really computed from bfloat16 operands
    with torch.autocast("cpu", dtype=torch.bfloat16):
        vocab_sized = _vocab_sized(lambda: logprobs.sum().backward(), weight)
    assert weight.grad.dtype == torch.float32 and hidden.grad.dtype == torch.float32
    assert vocab_sized == [weight.numel() * 2]  # one bfloat16 copy per call for the hidden gradient; nothing else


def test_a_bfloat16_weight_is_never_copied_to_float32():
    hidden, weight, targets = _head_inputs(dtype=torch.bfloat16, vocab=3000, width=16)
    weight.grad = torch.zeros_like(weight)
    logprobs, entropy = logprobs_and_entropy(hidden, weight, None, targets, chunk_rows=2, in_place=True)
    assert logprobs.dtype == entropy.dtype == torch.float32
    assert _vocab_sized(lambda: (logprobs.sum() + entropy.sum()).backward(), weight) == []
    assert weight.grad.dtype == torch.bfloat16


def test_a_large_vocabulary_gets_fewer_rows_a_chunk_with_the_same_outputs(monkeypatch):
    """PolicyHead bounds a chunk's logits (CHUNK_LOGITS), not only its rows: Gemma 3's 262,144-token head runs 256 rows
    a chunk. Here a 64-token head under a bound of 192 logits: 3 rows a chunk, the outputs and gradients unchanged."""
    from support import tiny_model

    from treerl.engine import head as head_module
    from treerl.engine.head import PolicyHead

    model = tiny_model("tiny-qwen3", vocab_size=64)
    hidden = torch.randn(10, model.config.hidden_size, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 64, (10,))
    seen = []
    chunked = head_module.logprobs_and_entropy

    def spy(*args, **kwargs):
        seen.append(args[6])
        return chunked(*args, **kwargs)

    def run(bound: int) -> tuple[torch.Tensor, ...]:
        monkeypatch.setattr(head_module, "CHUNK_LOGITS", bound)
        out = PolicyHead()(model, hidden, targets)
        weight = model.get_output_embeddings().weight
        grads = torch.autograd.grad((out["logprobs"] * 1.3 + out["entropy"]).sum(), (hidden, weight))
        return (out["logprobs"], out["entropy"], *grads)

    monkeypatch.setattr(head_module, "logprobs_and_entropy", spy)
    bounded, whole = run(192), run(1 << 26)
    assert seen == [3, 1024]
    for a, b in zip(bounded, whole, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
