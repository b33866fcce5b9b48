"""Rollout test fixtures: the built-in tokenizer, a tiny float64 policy over its vocabulary, a scripted sampler."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from support import tiny_model

from treerl.rollout import ChatFormat, Completion, SamplingParams, builtin_tokenizer


@pytest.fixture(scope="session")
def tokenizer():
    return builtin_tokenizer()


@pytest.fixture(scope="session")
def chat(tokenizer):
    return ChatFormat(tokenizer)


@pytest.fixture
def policy(tokenizer):
    """tiny-qwen3 in float64 over the built-in vocabulary (shared, read-only)."""
    return tiny_model("tiny-qwen3", vocab_size=len(tokenizer))


class ScriptedSampler:
    """A sampler whose replies are text chosen by `reply(prompt_text, sample_index)`."""

    def __init__(self, tokenizer, reply: Callable[[str, int], str], version: int = 7):
        self.tokenizer, self.reply, self.version = tokenizer, reply, version
        self.calls: list[tuple[int, int]] = []  # (prompts, n) per generate call

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        self.calls.append((len(prompts), params.n))
        out = []
        for prompt in prompts:
            text = self.tokenizer.decode(prompt)
            group = []
            for j in range(params.n):
                ids = self.tokenizer(self.reply(text, j), add_special_tokens=False)["input_ids"]
                ids, finish = ids + [self.tokenizer.eos_token_id], "stop"
                if len(ids) > params.max_new_tokens:  # cut off like a real sampler: no stop token
                    ids, finish = ids[: params.max_new_tokens], "length"
                logprobs = [-0.5 - 0.01 * k for k in range(len(ids))]
                group.append(Completion(ids, logprobs, finish, [self.version] * len(ids)))
            out.append(group)
        return out


@pytest.fixture
def scripted(tokenizer):
    return lambda reply, version=7: ScriptedSampler(tokenizer, reply, version)
