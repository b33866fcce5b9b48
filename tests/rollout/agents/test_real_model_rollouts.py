"""Rollouts on the real model (SmolLM2-135M-Instruct, float32): the embedded sampler's behaviour log-probs are the
tree engine's recomputation, and its ChatML template through the agent proxy records exactly what was sampled and
refuses tools it never shows the model."""

from __future__ import annotations

import os

import openai
import pytest
import torch
from support import real_model_dir
from test_proxy import LOOKUP, play
from transformers import AutoModelForCausalLM, AutoTokenizer

from treerl.engine import DfsEngine, PolicyHead
from treerl.rollout import ChatFormat, EmbeddedSampler, SamplingParams, tool_format_warning
from treerl.rollout.agents.proxy import ChatProxy
from treerl.rollout.config import RolloutConfig
from treerl.tree import TokenSequence

pytestmark = pytest.mark.slow  # the real model: 5 s to load (70 s to convert on a cold cache)

# float32 behaviour log-probs against DfsEngine's recomputation: at most 2.2e-5 apart over 3 seeds x 6 samples of
# 6 tokens (the sampler's left-padded batch and KV cache against the tree's calls round differently); a wrong
# temperature, position or prefix is off by more than 0.1
LOGPROB_ATOL = 1e-4


@pytest.fixture(scope="module")
def real():
    path = real_model_dir()
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def chat(real):
    return ChatFormat(real[1])


def test_embedded_sampler_logprobs_are_dfs_engines_recomputation(real, chat):
    model, tokenizer = real
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             return_dict=False) for q in ["What is 7 + 5?", "Name a colour."]]
    params = SamplingParams(n=3, max_new_tokens=6, temperature=0.7, stop_token_ids=tuple(chat.stop_token_ids), seed=0)
    groups = EmbeddedSampler(model, version=2).generate(prompts, params)
    assert [len(group) for group in groups] == [3, 3]
    sequences, behaviour = [], []
    for prompt, group in zip(prompts, groups):
        for completion in group:
            assert 0 < len(completion.tokens) <= 6 and completion.versions == [2] * len(completion.tokens)
            sequences.append(TokenSequence(torch.tensor(prompt + completion.tokens)))
            behaviour.append((len(prompt), torch.tensor(completion.logprobs)))
    recomputed = DfsEngine(head=PolicyHead(temperature=0.7)).forward(model, sequences)
    for (start, logprobs), out in zip(behaviour, recomputed):
        torch.testing.assert_close(logprobs, out["logprobs"][start:], rtol=0, atol=LOGPROB_ATOL)


def test_prompts_under_a_shared_system_prompt_sample_what_the_padded_path_samples(real, chat):
    """A GRPO call whose prompts share a long system prompt, generated over one copy of its K/V, then again from the
    prefix cache: the tokens the padded path samples (each prompt prefilled whole), log-probs equal up to float32's
    rounding over a long context (both paths are ~2e-5 from a float64 recomputation at 1.8k tokens)."""
    model, tokenizer = real
    system = " ".join(f"Rule {i}: answer in one short sentence." for i in range(15))
    prompts = [tokenizer.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": q}],
                                             add_generation_prompt=True, return_dict=False)
               for q in ["What is 7 + 5?", "Name a colour."]]
    params = SamplingParams(n=3, max_new_tokens=6, temperature=0.7, stop_token_ids=tuple(chat.stop_token_ids), seed=1)
    expected = EmbeddedSampler(model, prefix_sharing=False).generate(prompts, params)
    sampler = EmbeddedSampler(model)
    for _ in range(2):
        for group_a, group_b in zip(expected, sampler.generate(prompts, params)):
            for a, b in zip(group_a, group_b):
                assert a.tokens == b.tokens
                torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), rtol=0, atol=LOGPROB_ATOL)
    shared = len(os.path.commonprefix(prompts))
    assert shared > 100 and sampler.counts.prefill_tokens == len(prompts[0]) + len(prompts[1]) - shared + 2
    assert sampler.counts.cached_tokens >= shared


def test_a_two_turn_conversation_records_what_was_sampled_in_the_real_template(real, chat):
    """Each call's prompt is the template's rendering of the messages (the first reply's sampled tokens kept in the
    second), and the response's token ids are the recorded ones."""
    model, tokenizer = real
    proxy = ChatProxy(EmbeddedSampler(model), chat, temperature=0.7, max_new_tokens=24)
    proxy.batcher.seed = 0
    proxy.start()

    async def agent(client):
        messages = [{"role": "user", "content": "Say hello in one short sentence."}]
        asked = []
        for follow_up in ["Now say goodbye.", None]:
            reply = await client.chat.completions.create(model="p", messages=messages, logprobs=True,
                                                         extra_body={"return_token_ids": True})
            asked.append((messages, reply))
            messages = [*messages, reply.choices[0].message.model_dump(exclude_none=True)]
            if follow_up:
                messages.append({"role": "user", "content": follow_up})
        return asked

    try:
        asked, calls = play(proxy, agent)
    finally:
        proxy.stop()
    assert len(calls) == 2 and [c.parent for c in calls] == [None, 0]
    for (messages, reply), call in zip(asked, calls):
        choice = reply.choices[0]
        assert choice.finish_reason == "stop" and call.completion.tokens[-1] == tokenizer.eos_token_id
        assert call.prompt == tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
        assert reply.model_extra["prompt_token_ids"] == call.prompt
        assert choice.model_extra["token_ids"] == call.completion.tokens
        assert [t.logprob for t in choice.logprobs.content] == call.completion.logprobs
        assert choice.message.content == chat.reply_text(call.completion.tokens)
    assert calls[1].prompt[: len(calls[0].prompt) + len(calls[0].completion.tokens)] == \
        calls[0].prompt + calls[0].completion.tokens


@pytest.mark.parametrize("tool_parser, choice", [("auto", "auto"), ("auto", "required"), ("hermes", "required")])
def test_tools_are_refused_where_the_template_never_shows_them(real, chat, tool_parser, choice):
    """SmolLM2's ChatML template writes no tools: a request offering them is refused before sampling; one with
    tool_choice='none' is answered."""
    model, _ = real
    assert not chat.shows_tools
    proxy = ChatProxy(EmbeddedSampler(model), chat, tool_parser=tool_parser, temperature=0.7, max_new_tokens=2)
    proxy.start()

    async def agent(client):
        messages = [{"role": "user", "content": "Look up record 3."}]
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(model="p", messages=messages, tools=[LOOKUP], tool_choice=choice)
        await client.chat.completions.create(model="p", messages=messages, tools=[LOOKUP], tool_choice="none")
        return refused.value

    try:
        refused, calls = play(proxy, agent)
    finally:
        proxy.stop()
    assert refused.code == "template_without_tools" and "never see them" in str(refused)
    assert len(calls) == 1  # only tool_choice='none' was sampled


def test_an_agent_task_on_the_real_template_is_warned_about(real):
    said = tool_format_warning(RolloutConfig(task="agent_tools"), real[1])
    assert said is not None and "writes no tools into the prompt: every request offering tools is refused" in said
    assert tool_format_warning(RolloutConfig(task="arithmetic_chat"), real[1]) is None
