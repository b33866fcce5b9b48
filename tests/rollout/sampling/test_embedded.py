"""The embedded sampler: behaviour log-probs equal the trainer's recomputation, prompts prefilled once, stops."""

from __future__ import annotations

import pytest
import torch

from treerl.engine import FlatEngine, PolicyHead
from treerl.rollout import EmbeddedSampler, SamplingParams
from treerl.rollout.sampling.embedded import sample
from treerl.rollout.sampling.sampler import truncate_logits
from treerl.tree import TokenSequence

PROMPTS = ["3+4=", "12+7=", "a longer prompt, to pad the others"]


def _prompts(tokenizer):
    return [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                          return_dict=False) for p in PROMPTS]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_equal_flat_engine_recomputation(policy, tokenizer, temperature):
    """log softmax(logits / T) of each sampled token == FlatEngine(PolicyHead(T)) on prompt + completion."""
    prompts = _prompts(tokenizer)
    params = SamplingParams(n=3, max_new_tokens=10, temperature=temperature,
                            stop_token_ids=(tokenizer.eos_token_id,), seed=0)
    groups = EmbeddedSampler(policy).generate(prompts, params)
    sequences, behaviour = [], []
    for prompt, group in zip(prompts, groups):
        assert len(group) == 3
        for completion in group:
            sequences.append(TokenSequence(prompt + completion.tokens))
            behaviour.append((len(prompt), torch.tensor(completion.logprobs, dtype=torch.float64)))
    recomputed = FlatEngine(head=PolicyHead(temperature=temperature)).forward(policy, sequences)
    for (start, logprobs), out in zip(behaviour, recomputed):
        torch.testing.assert_close(logprobs, out["logprobs"][start:], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("cut", [dict(top_p=0.8), dict(top_k=5), dict(min_p=0.5), dict(top_p=0.9, top_k=20, min_p=0.1)])
def test_truncated_logprobs_are_those_of_the_distribution_sampled_from(policy, tokenizer, cut):
    """With top_p / top_k / min_p each token's behaviour log-prob is its log-prob under the cut, renormalised
    distribution (the model's own forward, cut by `truncate_logits`), and every token lies inside the cut."""
    prompts = _prompts(tokenizer)
    params = SamplingParams(n=3, max_new_tokens=8, temperature=1.3, seed=4, **cut)
    groups = EmbeddedSampler(policy).generate(prompts, params)
    truncated = 0
    for prompt, group in zip(prompts, groups):
        for completion in group:
            ids = torch.tensor([prompt + completion.tokens])
            with torch.no_grad():
                logits = policy(ids).logits[0, len(prompt) - 1 : -1].double() / 1.3
            cut_logits = truncate_logits(logits, **cut)
            expected = torch.log_softmax(cut_logits, -1).gather(-1, ids[0, len(prompt):, None])[:, 0]
            assert torch.isfinite(expected).all(), "a sampled token lies outside the cut"
            torch.testing.assert_close(torch.tensor(completion.logprobs, dtype=torch.float64), expected,
                                       rtol=1e-9, atol=1e-9)
            truncated += int((torch.isinf(cut_logits).any(-1)).sum())
    assert truncated > 0, "the cut never removed a token: the test would not see a renormalisation"


def test_truncate_logits_known_answers():
    """min_p, top_k and top_p cut as vLLM does, worked out by hand on five tokens."""
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0, -3.0], dtype=torch.float64)
    probs = logits.softmax(-1)  # 0.609, 0.224, 0.136, 0.030, 0.004
    kept = lambda **cut: torch.isfinite(truncate_logits(logits, **cut)).nonzero().flatten().tolist()  # noqa: E731
    assert kept() == [0, 1, 2, 3, 4]
    assert kept(top_p=0.9) == [0, 1, 2]  # the least likely tokens holding <= 0.1 of the mass go: 0.004 + 0.030
    assert probs[:2].sum() < 0.9 <= probs[:3].sum()
    assert kept(top_p=0.5) == [0]  # the most likely token always stays
    assert kept(top_k=2) == [0, 1]
    assert kept(min_p=0.2) == [0, 1, 2]  # p >= 0.2 x 0.609
    assert kept(top_k=4, top_p=0.8) == [0, 1]  # top_p over the renormalised top 4: 0.609 / 0.9996 < 0.8
    ties = torch.tensor([1.0, 1.0, 1.0, 0.0])
    assert torch.isfinite(truncate_logits(ties, top_k=2)).sum() == 3  # ties at the k-th value are kept (vLLM)


def test_the_padded_path_prefills_each_prompt_once(policy, tokenizer):
    """Without prefix sharing, the first forward runs the distinct prompts (not n copies); later ones decode one
    token per row."""
    shapes = []
    hook = policy.register_forward_pre_hook(lambda m, a, kw: shapes.append(tuple(kw["input_ids"].shape)),
                                            with_kwargs=True)
    try:
        prompts = _prompts(tokenizer)
        EmbeddedSampler(policy, prefix_sharing=False).generate(prompts, SamplingParams(n=4, max_new_tokens=5, seed=1))
    finally:
        hook.remove()
    assert shapes[0] == (3, max(len(p) for p in prompts))
    assert shapes[1:] == [(12, 1)] * 4


def test_stop_tokens_end_a_completion_and_finished_rows_leave_the_batch(policy, tokenizer):
    """Completions end right after their first stop token, and the decode batch shrinks as rows stop (the padded
    path's calls; the shared path's: tests/rollout/sampling/test_prefix_sharing.py)."""
    stop = tuple(range(0, len(tokenizer), 8))
    rows = []
    hook = policy.register_forward_pre_hook(lambda m, a, kw: rows.append(kw["input_ids"].shape[0]), with_kwargs=True)
    try:
        groups = EmbeddedSampler(policy, prefix_sharing=False).generate(
            _prompts(tokenizer), SamplingParams(n=5, max_new_tokens=6, stop_token_ids=stop, seed=2)
        )
    finally:
        hook.remove()
    completions = [c for group in groups for c in group]
    for c in completions:
        assert not any(t in stop for t in c.tokens[:-1])
        if c.finish_reason == "stop":
            assert c.tokens[-1] in stop
        else:
            assert len(c.tokens) == 6 and c.tokens[-1] not in stop
    assert {c.finish_reason for c in completions} == {"stop", "length"}
    decoded = rows[1:]  # row count of each decode step after the prefill
    still_running = [sum(len(c.tokens) > step for c in completions) for step in range(1, 1 + len(decoded))]
    assert decoded == still_running and decoded[-1] < 15


def test_same_seed_same_completions_and_versions(policy, tokenizer):
    sampler = EmbeddedSampler(policy, version=3)
    params = SamplingParams(n=2, max_new_tokens=6, seed=5)
    a, b = sampler.generate(_prompts(tokenizer), params), sampler.generate(_prompts(tokenizer), params)
    assert [[c.tokens for c in g] for g in a] == [[c.tokens for c in g] for g in b]
    assert all(c.versions == [3] * len(c.tokens) for g in a for c in g)


def test_training_mode_is_restored(policy, tokenizer):
    policy.train()
    try:
        EmbeddedSampler(policy).generate(_prompts(tokenizer)[:1], SamplingParams(max_new_tokens=2, seed=0))
        assert policy.training
    finally:
        policy.eval()


def test_chunks_of_rows_give_the_same_logprob_semantics(policy, tokenizer):
    """max_rows splits the prompts into chunks; every completion still matches the recomputation."""
    prompts = _prompts(tokenizer)
    groups = EmbeddedSampler(policy, max_rows=2).generate(prompts, SamplingParams(n=2, max_new_tokens=4, seed=3))
    sequences = [TokenSequence(p + c.tokens) for p, g in zip(prompts, groups) for c in g]
    recomputed = FlatEngine().forward(policy, sequences)
    starts = [len(p) for p in prompts for _ in range(2)]
    for s, c, out in zip(starts, [c for g in groups for c in g], recomputed):
        torch.testing.assert_close(torch.tensor(c.logprobs, dtype=torch.float64), out["logprobs"][s:])


def test_bad_input_is_refused_before_compute(policy):
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        EmbeddedSampler(policy).generate([[1, 2], []], SamplingParams())
    with pytest.raises(ValueError, match="outside the vocabulary"):
        EmbeddedSampler(policy).generate([[1, 10**6]], SamplingParams())
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=0.0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=-1)
    with pytest.raises(ValueError, match="min_p"):
        SamplingParams(min_p=1.0)


def test_sampler_frequencies_and_nucleus():
    """Sampling frequencies follow softmax(logits / T) restricted to the nucleus, and so do the log-probs."""
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, -3.0]], dtype=torch.float64).expand(40000, -1)
    generator = torch.Generator().manual_seed(0)
    token, logprob = sample(logits, SamplingParams(temperature=0.8, top_p=0.9), generator)
    full = torch.softmax(logits[0] / 0.8, -1)
    nucleus = 3  # cumulative mass before token 2 is < 0.9, before token 3 it is >= 0.9
    assert full[:2].sum() < 0.9 <= full[:3].sum()
    counts = torch.bincount(token, minlength=5).double() / len(token)
    torch.testing.assert_close(counts[:nucleus], full[:nucleus] / full[:nucleus].sum(), atol=0.01, rtol=0)
    assert counts[nucleus:].sum() == 0
    torch.testing.assert_close(logprob, (full[:nucleus] / full[:nucleus].sum()).log()[token])
