"""Checks shared by the adapters' tests: the trained replies are what the sampler returned, with its log-probs."""

from __future__ import annotations

import pytest


def reply_of(seq) -> list[int]:
    """The sampled part of a model call's sequence (its loss mask)."""
    return seq.tokens[seq.fields["loss_mask"].bool()].tolist()


class Recording:
    """A sampler that remembers every completion it returned (tokens -> behaviour log-probs)."""

    def __init__(self, sampler):
        self.sampler, self.sampled = sampler, {}

    def __getattr__(self, name):
        return getattr(self.sampler, name)

    def generate(self, prompts, params, **kwargs):
        groups = self.sampler.generate(prompts, params, **kwargs)
        for group in groups:
            for completion in group:
                self.sampled[tuple(completion.tokens)] = completion.logprobs
        return groups


def check_recorded(batch, recording: Recording) -> None:
    """Every trained reply is a completion the sampler returned, with its log-probs."""
    assert batch.sequences
    for seq in batch.sequences:
        reply = tuple(reply_of(seq))
        assert reply in recording.sampled, seq.name
        logprobs = seq.fields["old_logprobs"][seq.fields["loss_mask"].bool()].tolist()
        assert logprobs == pytest.approx(recording.sampled[reply], abs=0), seq.name
