"""Rollouts on Gemma 3 270M base (float32, the whole model): the embedded sampler's behaviour log-probs are the tree
engine's recomputation on plain-text prompts whose samples cross the 512-token sliding window (a 500-token prompt) or
lie past it (a 530-token one), where sampling without the window would read otherwise."""

from __future__ import annotations

import contextlib

import pytest
import torch
from real_gemma import WINDOW, gemma_dir, plain_trees
from transformers import AutoModelForCausalLM

from treerl.engine import DfsEngine, PolicyHead
from treerl.rollout import EmbeddedSampler, SamplingParams, load_tokenizer
from treerl.tree import TokenSequence

pytestmark = pytest.mark.slow

# float32 behaviour log-probs against DfsEngine's recomputation (measured: at most 3e-5 over 6 samples of 24 tokens;
# vLLM's CPU server against the same recomputation: 2.2e-5); reading without the window moves them by more than 0.01
LOGPROB_ATOL = 2e-4


@contextlib.contextmanager
def window(model, tokens: int):
    """The model's sliding-window layers attending over `tokens` for the block."""
    attentions = [m for m in model.modules() if getattr(m, "sliding_window", None)]
    before = model.config.sliding_window
    for module in attentions:
        module.sliding_window = tokens
    model.config.sliding_window = tokens
    try:
        yield
    finally:
        for module in attentions:
            module.sliding_window = before
        model.config.sliding_window = before


def test_embedded_sampler_logprobs_are_dfs_engines_recomputation_across_the_window():
    path = gemma_dir()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    trees = plain_trees(load_tokenizer(path))
    prompts = [trees["grpo"][0].tokens[:500].tolist(), trees["agent"][0].tokens[:530].tolist()]
    params = SamplingParams(n=3, max_new_tokens=24, temperature=0.7, seed=0)
    groups = EmbeddedSampler(model, version=1).generate(prompts, params)
    sequences, behaviour = [], []
    for prompt, group in zip(prompts, groups, strict=True):
        for completion in group:
            assert 0 < len(completion.tokens) <= 24 and completion.versions == [1] * len(completion.tokens)
            sequences.append(TokenSequence(torch.tensor(prompt + completion.tokens)))
            behaviour.append((len(prompt), torch.tensor(completion.logprobs)))
    assert any(start < WINDOW < len(s.tokens) for (start, _), s in zip(behaviour, sequences))  # samples cross it
    engine = DfsEngine(head=PolicyHead(temperature=0.7))
    recomputed = engine.forward(model, sequences)
    for (start, logprobs), ours in zip(behaviour, recomputed, strict=True):
        torch.testing.assert_close(logprobs, ours["logprobs"][start:], rtol=0, atol=LOGPROB_ATOL)
    first = [0, len(groups[0])]  # one sample of each prompt
    with window(model, 4096):
        unwindowed = engine.forward(model, [sequences[i] for i in first])
    moved = max(float((recomputed[i]["logprobs"][behaviour[i][0]:] - wide["logprobs"][behaviour[i][0]:]).abs().max())
                for i, wide in zip(first, unwindowed))
    assert moved > 1e-2, moved  # the samples past position 512 read through the window
