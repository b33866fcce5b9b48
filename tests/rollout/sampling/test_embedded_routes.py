"""rollout.return_routed_experts with the embedded sampler: each completion carries the experts its prefill and
decoding steps routed every token to (left padding, a GRPO group's repeated prompt and rows that stop early included),
which are the model's own routing of the whole sequence, and which replayed give the model's own forward."""

from __future__ import annotations

import contextlib

import pytest
import torch

from treerl.engine import DfsEngine
from treerl.engine.routing import recording_routes, routing_replay
from treerl.models import build_model
from treerl.rollout.sampling.embedded import EmbeddedSampler
from treerl.rollout.sampling.sampler import SamplingParams
from treerl.rollout.workflows.sequences import model_call_sequence
from treerl.testing import model_outputs, relative_error

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12]]  # different lengths: the shorter is left-padded in the prefill


@pytest.mark.parametrize("calls, unread", [(1, False), (2, False), (1, True)])
def test_sampled_routes_are_the_models_own_and_replay_its_forward(calls, unread):
    """One call, a second one on the same sampler whose prompts' routes come from its prefix cache, and an unread call
    (synchronous single-turn) that goes the padded way by the sampler's own choice (its first: the padded path's probe
    runs then, and must not be recorded as the call's routes)."""
    model = build_model(shape="tiny-qwen3-moe", vocab_size=64, seed=0)
    sampler = EmbeddedSampler(model, return_routed_experts=True)
    for _ in range(calls):
        with sampler.unread() if unread else contextlib.nullcontext():
            groups = sampler.generate(PROMPTS, SamplingParams(n=3, max_new_tokens=6, seed=0, stop_token_ids=(3, 4, 5)))
    assert (sampler.counts.cached_tokens > 0) == (calls == 2)
    assert sampler.counts.padded_chunks == unread
    sequences = [model_call_sequence(p, c, {}, f"{i}/{j}") for i, (p, g) in enumerate(zip(PROMPTS, groups))
                 for j, c in enumerate(g)]
    assert len({len(s) for s in sequences}) > 1  # some rows stopped early
    for sequence in sequences:
        with torch.no_grad(), recording_routes(model) as record:
            model(input_ids=sequence.tokens[None], use_cache=False)
            own = record.take(len(sequence))
        routes = sequence.fields["routed_experts"]
        assert torch.equal(routes[:-1], own[:-1]) and bool((routes[-1] == -1).all())  # no call runs the last token
    with routing_replay(model):
        replayed = DfsEngine().forward(model, sequences)
    for out, sequence in zip(replayed, sequences):
        assert relative_error(out["logprobs"], model_outputs(model, sequence)["logprobs"]) < 1e-5


def test_without_the_setting_completions_carry_no_routes():
    model = build_model(shape="tiny-qwen3-moe", vocab_size=64, seed=0)
    [[completion]] = EmbeddedSampler(model).generate(PROMPTS[:1], SamplingParams(max_new_tokens=3, seed=0))
    assert completion.routed_experts is None
    assert "routed_experts" not in model_call_sequence(PROMPTS[0], completion, {}, "s").fields
