"""Single-turn workflow: groups of samples become training sequences; failing rewards are dropped, not fatal."""

from __future__ import annotations

import logging
import math

import torch

from treerl.rollout import SamplingParams, SingleTurnWorkflow
from treerl.rollout.tasks import Arithmetic
from treerl.rollout.workflows.stats import RolloutStats
from treerl.tree import validate_sequences


def _workflow(chat, reward_fn=None, n=3):
    task = Arithmetic(max_operand=9, seed=0)
    if reward_fn is not None:
        task.reward_fn = reward_fn
    return SingleTurnWorkflow(task, chat, SamplingParams(n=n, max_new_tokens=4, stop_token_ids=(2,)))


def test_sequences_fields_and_info(chat, scripted, tokenizer):
    sampler = scripted(lambda prompt, j: ["7", "x", "12"][j], version=7)
    prompts = Arithmetic(seed=0).prompts(0, 2)
    stats = RolloutStats()
    sequences = _workflow(chat).run(sampler, prompts, stats)
    validate_sequences(sequences, vocab_size=len(tokenizer))
    assert sampler.calls == [(2, 3)]  # one sampler call: each prompt once, n samples
    assert len(sequences) == 6 and stats.sequences == 6 and stats.kept == 6 and stats.samples == 6
    for i, seq in enumerate(sequences):
        prompt = prompts[i // 3]
        context = chat.prompt(prompt.messages)
        reply = tokenizer(["7", "x", "12"][i % 3], add_special_tokens=False)["input_ids"] + [2]
        assert seq.tokens.tolist() == context + reply
        assert seq.fields["loss_mask"].tolist() == [0] * len(context) + [1] * len(reply)
        assert seq.fields["old_logprobs"].dtype == torch.float64
        assert seq.fields["old_logprobs"][: len(context)].eq(0).all()
        assert seq.fields["old_logprobs"][len(context):].tolist() == [-0.5 - 0.01 * k for k in range(len(reply))]
        assert seq.fields["versions"].tolist() == [-1] * len(context) + [7] * len(reply)
        expected = Arithmetic.reward_fn(prompt=prompt.text, completion=["7", "x", "12"][i % 3], answer=prompt.answer)
        assert seq.info == {"reward": expected, "group": prompt.id, "trajectory": f"{prompt.id}/{i % 3}",
                            "turn": 0, "finish_reason": "stop"}
    assert stats.rewards == [s.info["reward"] for s in sequences]


def test_failing_reward_drops_the_sample_and_reports_it(chat, scripted, caplog):
    def flaky(prompt, completion, answer):
        if completion == "x":
            raise ZeroDivisionError("bad sample")
        if completion == "12":
            return math.nan
        return 1.0

    sampler = scripted(lambda prompt, j: ["7", "x", "12"][j])
    stats = RolloutStats()
    with caplog.at_level(logging.WARNING, logger="treerl.rollout"):
        sequences = _workflow(chat, flaky).run(sampler, Arithmetic(seed=0).prompts(0, 2), stats)
    assert len(sequences) == 2 and all(s.info["reward"] == 1.0 for s in sequences)
    assert stats.samples == 6 and stats.kept == 2
    assert stats.dropped == {"reward_raised": 2, "reward_not_finite": 2}
    assert stats.metrics()["rollout/dropped"] == 4.0
    report = str(stats.dropped_samples[0])
    assert "reward function raised ZeroDivisionError: bad sample" in report
    assert "prompt=" in report and "completion='x'" in report
    assert "returned nan" in caplog.text and "completion='12'" in caplog.text


def test_every_sample_dropped_gives_an_empty_batch_and_counts(chat, scripted):
    stats = RolloutStats()
    sequences = _workflow(chat, lambda **kw: None).run(scripted(lambda p, j: "1"), Arithmetic().prompts(0, 2), stats)
    assert sequences == [] and stats.dropped == {"reward_not_a_number": 6}
    assert math.isnan(stats.metrics()["rollout/reward_mean"])


def test_a_prompt_longer_than_the_context_limit_is_not_sampled_and_counted(chat, scripted, tokenizer):
    """rollout.max_context_tokens holds for single-turn tasks too: a prompt whose tokens + max_new_tokens exceed it
    is not sampled, each of its samples dropped as context_limit (the model check at start assumed the limit)."""
    prompts = Arithmetic(seed=0).prompts(0, 2)
    prompts[1].messages[-1]["content"] = "1+1=" * 20
    shortest = len(chat.prompt(prompts[0].messages))
    workflow = _workflow(chat)
    workflow.max_context_tokens = shortest + workflow.sampling.max_new_tokens  # the first prompt just fits
    sampler = scripted(lambda prompt, j: "7")
    stats = RolloutStats()
    sequences = workflow.run(sampler, prompts, stats)
    assert sampler.calls == [(1, 3)] and {s.info["group"] for s in sequences} == {prompts[0].id}
    assert stats.dropped == {"context_limit": 3} and stats.kept == 3 and stats.samples == 6 and stats.prompts == 2
    assert all(len(s) <= workflow.max_context_tokens for s in sequences)
    assert "exceeds rollout.max_context_tokens" in stats.dropped_samples[0].reason
    assert workflow.run(sampler, prompts[1:], RolloutStats()) == []  # nothing fits: no sampler call at all
    assert sampler.calls == [(1, 3)]
