"""The chat proxy, driven by the real OpenAI Python client: tool calls, exact recording, token-in/token-out, the tree."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
import torch

from treerl.algo import AlgoConfig, LossNormalizer, build_loss, compute_advantages
from treerl.engine import DfsEngine, FlatEngine, PolicyHead
from treerl.rollout import EmbeddedEngine
from treerl.rollout.agent import AgentWorkflow
from treerl.rollout.proxy import ChatProxy
from treerl.rollout.stats import RolloutStats
from treerl.rollout.tasks.base import Prompt
from treerl.rollout.tool_parsers import ToolCall, get_tool_parser, parse_hermes
from treerl.testing import assert_engines_agree
from treerl.tree import PrefixTree, TokenSequence

LOOKUP = {"type": "function", "function": {"name": "lookup", "description": "a record",
                                           "parameters": {"type": "object", "properties": {"id": {"type": "integer"}}}}}
NAMED = {"type": "function", "function": {"name": "lookup"}}


@pytest.fixture
def serve(chat):
    """`serve(engine, **options)`: a started proxy (stopped after the test)."""
    proxies = []

    def start(engine, **options):
        proxy = ChatProxy(engine, chat, **options)
        proxy.start()
        proxies.append(proxy)
        return proxy

    yield start
    for proxy in proxies:
        proxy.stop()


def play(proxy: ChatProxy, agent, episode_id: str = "e0"):
    """Run `agent(client)` as one recorded episode; returns (its result, the recorded calls)."""
    proxy.recorder.open(episode_id)

    async def main():
        client = openai.AsyncOpenAI(base_url=proxy.episode_url(episode_id), api_key="x", max_retries=0)
        try:
            return await agent(client)
        finally:
            await client.close()

    try:
        result = asyncio.run(main())
    finally:
        calls = proxy.recorder.close(episode_id).calls
    return result, calls


def test_hermes_parser_reads_calls_and_keeps_malformed_ones_as_content():
    text = 'ok <tool_call>{"name": "lookup", "arguments": {"id": 3}}</tool_call><tool_call>{bad}</tool_call> end'
    content, calls = parse_hermes(text)
    assert calls == [ToolCall("lookup", '{"id": 3}')]
    assert content == "ok <tool_call>{bad}</tool_call> end"
    assert get_tool_parser("qwen3") is parse_hermes and get_tool_parser("none")(text) == (text, [])
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        get_tool_parser("mistral-ish")


def _tool_script(prompt: str, sample: int) -> str:
    """Call lookup when asked a question; after the tool's answer, reply with the code (two different samples)."""
    if prompt.endswith("code of 3?<eos><assistant>"):
        return 'checking<tool_call>{"name": "lookup", "arguments": {"id": 3}}</tool_call>'
    return ["it is q", "q!"][sample % 2]


def test_tool_episode_through_the_openai_client_forms_the_expected_tree(serve, scripted, chat):
    """Structured tool calls out, tool results in; the answer call extends the lookup call token for token, two
    sampled answers are siblings, and the prefix tree stores their shared context once (T and U exact)."""
    proxy = serve(scripted(_tool_script, version=5))

    async def agent(client):
        messages = [{"role": "user", "content": "code of 3?"}]
        first = await client.chat.completions.create(model="policy", messages=messages, tools=[LOOKUP])
        choice = first.choices[0]
        call = choice.message.tool_calls[0]
        assert (choice.finish_reason, choice.message.content) == ("tool_calls", "checking")
        assert (call.function.name, json.loads(call.function.arguments)) == ("lookup", {"id": 3})
        messages += [choice.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": '{"code": "q"}'}]
        second = await client.chat.completions.create(model="policy", messages=messages, tools=[LOOKUP], n=2)
        return [c.message.content for c in second.choices]

    answers, calls = play(proxy, agent)
    assert answers == ["it is q", "q!"]
    assert [c.parent for c in calls] == [None, 0, 0]
    first = calls[0].prompt + calls[0].completion.tokens
    for call in calls[1:]:
        assert call.prompt[: len(first)] == first  # the recorded tokens, not a re-rendering
        assert call.completion.versions == [5] * len(call.completion.tokens)
    assert calls[1].prompt == calls[2].prompt
    sequences = [TokenSequence(torch.tensor(c.prompt + c.completion.tokens)) for c in calls]
    stats = PrefixTree.build(sequences).stats()
    lengths = [len(c.prompt) + len(c.completion.tokens) for c in calls]
    assert stats.flat_tokens == sum(lengths)
    assert stats.unique_tokens == len(calls[1].prompt) + len(calls[1].completion.tokens) + len(calls[2].completion.tokens)
    assert stats.compression == pytest.approx(sum(lengths) / stats.unique_tokens)


def test_named_tool_choice_keeps_the_sampled_tokens_where_the_template_rerenders(serve, scripted, chat, tokenizer):
    """With a named tool choice the reply is the arguments (as vLLM answers); the template writes that turn back as
    `<tool_call>{...}</tool_call>`, but the next prompt holds the tokens the model sampled."""
    proxy = serve(scripted(lambda prompt, j: '{"id": 3}' if prompt.endswith("?<eos><assistant>") else "q"))

    async def agent(client):
        messages = [{"role": "user", "content": "code of 3?"}]
        first = await client.chat.completions.create(model="p", messages=messages, tools=[LOOKUP], tool_choice=NAMED)
        choice = first.choices[0]
        assert choice.finish_reason == "stop" and choice.message.content is None
        assert choice.message.tool_calls[0].function.arguments == '{"id": 3}'
        messages += [choice.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": choice.message.tool_calls[0].id, "content": "q"}]
        await client.chat.completions.create(model="p", messages=messages, tools=[LOOKUP], tool_choice="none")
        return messages

    messages, calls = play(proxy, agent)
    sampled = calls[0].prompt + calls[0].completion.tokens
    assert tokenizer.decode(calls[0].completion.tokens) == '{"id": 3}<eos>'
    assert calls[1].prompt[: len(sampled)] == sampled and calls[1].parent == 0
    rerendered = chat.prompt([{**m, "tool_calls": [{"function": {"name": "lookup", "arguments": {"id": 3}}}]}
                              if m["role"] == "assistant" else m for m in messages], [LOOKUP])
    assert '<tool_call>{"name": "lookup"' in tokenizer.decode(rerendered)
    assert rerendered != calls[1].prompt


def test_recorded_tokens_and_logprobs_are_what_the_model_sampled(serve, policy, tokenizer, chat):
    """The response's token ids (vLLM's return_token_ids) are the recorded ones, the text decodes from them, and
    the recorded behaviour log-probs equal the model's own log-probs of those tokens at the sampling temperature."""
    proxy = serve(EmbeddedEngine(policy, version=3), temperature=0.8, max_new_tokens=6)
    proxy.sampler.seed = 11

    async def agent(client):
        messages = [{"role": "user", "content": "hi"}]
        answers = []
        for _ in range(3):
            reply = await client.chat.completions.create(model="p", messages=messages, max_tokens=6, logprobs=True,
                                                         extra_body={"return_token_ids": True})
            answers.append(reply)
            messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]
        return answers

    answers, calls = play(proxy, agent)
    assert len(calls) == 3 and [c.parent for c in calls] == [None, 0, 1]
    for reply, call in zip(answers, calls):
        choice = reply.choices[0]
        assert reply.model_extra["prompt_token_ids"] == call.prompt
        assert choice.model_extra["token_ids"] == call.completion.tokens
        assert [t.logprob for t in choice.logprobs.content] == call.completion.logprobs
        assert (choice.message.content or "") == chat.reply_text(call.completion.tokens)
        assert call.completion.versions == [3] * len(call.completion.tokens)
    sequences = [TokenSequence(torch.tensor(c.prompt + c.completion.tokens)) for c in calls]
    recomputed = FlatEngine(head=PolicyHead(temperature=0.8)).forward(policy, sequences)
    for call, out in zip(calls, recomputed):
        torch.testing.assert_close(out["logprobs"][len(call.prompt):],
                                   torch.tensor(call.completion.logprobs, dtype=torch.float64), rtol=1e-9, atol=1e-9)


def test_loss_over_an_episode_tree_equals_the_flat_loss(serve, policy, tokenizer):
    """Episodes of two tasks (4 plays each, lookups and retried answers) trained as a prefix tree: Dr. GRPO loss and
    every gradient equal the flat engine's in float64."""
    proxy = serve(EmbeddedEngine(policy), max_new_tokens=5)

    async def agent(client, task):
        messages = [{"role": "user", "content": task["question"]}]
        first = await client.chat.completions.create(model="p", messages=messages, tools=[LOOKUP], tool_choice=NAMED)
        messages += [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": first.choices[0].message.tool_calls[0].id, "content": "q"}]
        second = await client.chat.completions.create(model="p", messages=messages, n=2)
        return float(sum(len(c.message.content or "") for c in second.choices))

    workflow = AgentWorkflow(agent, proxy, group_size=4)
    prompts = [Prompt(f"t{i}", [{"role": "user", "content": q}], {"question": q}) for i, q in enumerate(["a?", "b?"])]
    stats = RolloutStats()
    sequences = workflow.run(proxy.engine, prompts, stats, seed=1)
    assert stats.kept == 8 and len(sequences) == 24 and stats.model_calls == 24
    tree = PrefixTree.build(sequences).stats()
    assert tree.compression > 2  # the tools header and each task's question are stored once
    algo = AlgoConfig(loss="dr_grpo")
    compute_advantages(algo, sequences)
    loss = build_loss(algo, LossNormalizer.from_sequences(sequences))
    assert_engines_agree(policy, sequences, lambda view: loss(view)[0], DfsEngine(), FlatEngine(), tol=1e-6)


@pytest.mark.parametrize("body, message", [
    ({"temperature": 0.5}, "differs from the trainer's"),
    ({"stream": True}, "streaming is not supported"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"stop": ["no such"]}, "single-token stop"),
    ({"messages": [{"role": "user", "content": "x" * 60}]}, "max_context_tokens"),
])
def test_bad_requests_are_refused_with_the_reason(serve, scripted, body, message):
    proxy = serve(scripted(lambda p, j: "a"), max_context_tokens=64, max_new_tokens=8)
    request = {"model": "p", "messages": [{"role": "user", "content": "x"}], **body}

    async def agent(client):
        with pytest.raises(openai.BadRequestError, match=message):
            await client.chat.completions.create(**request)

    _, calls = play(proxy, agent)
    assert calls == []


def test_unknown_episode_is_not_found_and_unrecorded_v1_still_answers(serve, scripted):
    proxy = serve(scripted(lambda p, j: "hello"))

    async def agent():
        async with openai.AsyncOpenAI(base_url=proxy.episode_url("nope"), api_key="x", max_retries=0) as client:
            with pytest.raises(openai.NotFoundError, match="no open episode"):
                await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "x"}])
        async with openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0) as client:
            reply = await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "x"}])
            assert reply.choices[0].message.content == "hello"
            assert [m.id for m in (await client.models.list()).data] == ["policy"]

    asyncio.run(agent())
