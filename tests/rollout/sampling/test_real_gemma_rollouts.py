"""Rollouts on Gemma 3 270M base (float32, the whole model): the embedded sampler's behaviour log-probs are the tree
engine's recomputation on plain-text prompts whose samples cross the 512-token sliding window (a 500-token prompt) or
lie past it (a 530-token one), where sampling without the window would read otherwise."""

from __future__ import annotations

import pytest
import torch
from real_gemma import WINDOW, gemma_dir, plain_trees, window
from transformers import AutoModelForCausalLM

from treerl.engine import DfsEngine, PolicyHead
from treerl.rollout import EmbeddedSampler, SamplingParams, load_tokenizer
from treerl.tree import TokenSequence

pytestmark = pytest.mark.slow

# float32 behaviour log-probs against DfsEngine's recomputation (SmolLM2's: 2.2e-5 apart; vLLM's CPU server against
# this recomputation on Gemma: 2.2e-5); reading without the window moves them by more than 0.01
LOGPROB_ATOL = 2e-4


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
