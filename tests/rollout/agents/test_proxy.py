"""The chat proxy, driven by the real OpenAI Python client: tool calls, exact recording, token-in/token-out, the tree."""

from __future__ import annotations

import asyncio
import itertools
import json

import openai
import pytest
import torch

from treerl.algo import AlgoConfig, LossNormalizer, build_loss, compute_advantages
from treerl.engine import DfsEngine, FlatEngine, PolicyHead
from treerl.rollout import ChatFormat, EmbeddedSampler
from treerl.rollout.agents.agent import AgentWorkflow
from treerl.rollout.agents.proxy import ChatProxy
from treerl.rollout.agents.tool_parsers import (
    TOOL_PARSERS,
    ToolCall,
    detect_tool_parser,
    parse_hermes,
    parse_llama3_json,
    parse_qwen3_coder,
    resolve_tool_parser,
)
from treerl.rollout.conversations.tokenizer import BUILTIN_CHAT_TEMPLATE, PLAIN_CHAT_TEMPLATE, builtin_tokenizer
from treerl.rollout.tasks.base import Prompt
from treerl.rollout.workflows.stats import RolloutStats
from treerl.testing import assert_engines_agree
from treerl.tree import PrefixTree, TokenSequence

LOOKUP = {"type": "function", "function": {"name": "lookup", "description": "a record",
                                           "parameters": {"type": "object", "properties": {"id": {"type": "integer"}}}}}
NAMED = {"type": "function", "function": {"name": "lookup"}}
FLAT_LOOKUP = {"type": "function", **LOOKUP["function"]}  # the Responses API's tool format


@pytest.fixture
def serve(chat):
    """`serve(sampler, **options)`: a started proxy (stopped after the test)."""
    proxies = []

    def start(sampler, **options):
        proxy = ChatProxy(sampler, chat, **options)
        proxy.start()
        proxies.append(proxy)
        return proxy

    yield start
    for proxy in proxies:
        proxy.stop()


def play(proxy: ChatProxy, agent, episode_id: str = "e0"):
    """Run `agent(client)` as one recorded episode; returns (its result, the recorded calls)."""
    result, log = play_log(proxy, agent, episode_id)
    return result, log.calls


def play_log(proxy: ChatProxy, agent, episode_id: str = "e0"):
    """Run `agent(client)` as one recorded episode; returns (its result, the episode's log)."""
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
        log = proxy.recorder.close(episode_id)
    return result, log


def parser(name: str, chat_template: str | None = None):
    """The parser `rollout.tool_parser=name` gets, as the proxy looks it up."""
    return TOOL_PARSERS[resolve_tool_parser(name, chat_template)]


def test_hermes_parser_reads_calls_and_keeps_malformed_ones_as_content():
    text = 'ok <tool_call>{"name": "lookup", "arguments": {"id": 3}}</tool_call><tool_call>{bad}</tool_call> end'
    content, calls = parse_hermes(text)
    assert calls == [ToolCall("lookup", '{"id": 3}')]
    assert content == "ok <tool_call>{bad}</tool_call> end"
    assert parser("qwen3") is parse_hermes and parser("none")(text) == (text, [])
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        parser("mistral-ish")


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
    proxy = serve(EmbeddedSampler(policy, version=3), temperature=0.8, max_new_tokens=6)
    proxy.batcher.seed = 11

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
    proxy = serve(EmbeddedSampler(policy), max_new_tokens=5)

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
    sequences = workflow.run(proxy.sampler, prompts, stats, seed=1)
    assert stats.kept == 8 and len(sequences) == 24 and stats.model_calls == 24
    tree = PrefixTree.build(sequences).stats()
    assert tree.compression > 2  # the tools header and each task's question are stored once
    algo = AlgoConfig(loss="dr_grpo")
    compute_advantages(algo, sequences)
    loss = build_loss(algo, LossNormalizer.from_sequences(sequences))
    assert_engines_agree(policy, sequences, lambda view: loss(view)[0], DfsEngine(), FlatEngine(), tol=1e-6)


@pytest.mark.parametrize("body, message", [
    ({"temperature": 0.5}, "differs from the trainer's"),
    ({"tool_choice": "required"}, "needs 'tools'"),
    ({"tools": [LOOKUP], "tool_choice": "always"}, "'tool_choice' 'always' is not one of auto, none, required"),
    ({"tools": [LOOKUP], "tool_choice": {"type": "function", "function": {"name": "other"}}}, "not in 'tools'"),
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


def test_qwen3_coder_and_llama3_parsers_and_the_template_choosing_them():
    """The XML form types values by the tool's schema (a string stays text) and keeps a malformed call as content;
    the Llama-3 form is the whole reply as JSON calls; `auto` reads the format off the chat template."""
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"id": {"type": "integer"}, "note": {"type": "string"}}}}}]
    xml = "let me see\n<tool_call>\n<function=lookup>\n<parameter=id>\n3\n</parameter>\n<parameter=note>\n12\n" \
          "</parameter>\n</function>\n</tool_call>"
    assert parse_qwen3_coder(xml, tools) == ("let me see", [ToolCall("lookup", '{"id": 3, "note": "12"}')])
    assert parse_qwen3_coder(xml)[1] == [ToolCall("lookup", '{"id": 3, "note": 12}')]  # no schema: JSON if it parses
    broken = "<tool_call><function=lookup><parameter=id>3</function></tool_call>"
    assert parse_qwen3_coder(broken, tools) == (broken, [])
    assert parse_llama3_json('{"name": "lookup", "parameters": {"id": 3}}') == ("", [ToolCall("lookup", '{"id": 3}')])
    two = '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": 1}}'
    assert parse_llama3_json(two)[1] == [ToolCall("a", "{}"), ToolCall("b", '{"x": 1}')]
    for text in ['It is {"name": "a", "parameters": {}}', '{"answer": 3}', '{"name": "a", "parameters": {}} and']:
        assert parse_llama3_json(text) == (text, [])
    llama = "{{- '{\"name\": \"' + tool_call.name + '\", ' }}{{- '\"parameters\": ' }}<|eot_id|>"
    assert [detect_tool_parser(t) for t in (BUILTIN_CHAT_TEMPLATE, XML_TEMPLATE, llama, PLAIN_CHAT_TEMPLATE)] == [
        "hermes", "qwen3_coder", "llama3_json", "none"]
    assert parser("auto", XML_TEMPLATE) is parser("qwen3.5") is parse_qwen3_coder


XML_TEMPLATE = BUILTIN_CHAT_TEMPLATE.split("{% for call in")[0] + (  # the built-in template, tool calls as Qwen3-Coder
    "{% for call in message['tool_calls'] or [] %}{{ '<tool_call>\n<function=' + call['function']['name'] + '>\n' }}"
    "{% for key, value in call['function']['arguments'].items() %}"
    "{{ '<parameter=' + key + '>\n' + (value | string) + '\n</parameter>\n' }}{% endfor %}"
    "{{ '</function>\n</tool_call>' }}{% endfor %}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<assistant>' }}{% endif %}")


def test_a_qwen3_coder_template_gets_its_parser_and_its_calls_continue_token_for_token(scripted):
    """rollout.tool_parser=auto with a template that writes the XML form: the model's XML call comes back as a
    structured call, and the next call extends the recorded tokens."""
    tokenizer = builtin_tokenizer()
    tokenizer.chat_template = XML_TEMPLATE
    written = "<tool_call>\n<function=lookup>\n<parameter=id>\n3\n</parameter>\n</function>\n</tool_call>"
    proxy = ChatProxy(scripted(lambda p, j: written if p.endswith("?<eos><assistant>") else "q"), ChatFormat(tokenizer))
    proxy.start()
    try:
        async def agent(client):
            messages = [{"role": "user", "content": "code of 3?"}]
            first = await client.chat.completions.create(model="p", messages=messages, tools=[LOOKUP])
            call = first.choices[0].message.tool_calls[0]
            assert (call.function.name, call.function.arguments, first.choices[0].finish_reason) == (
                "lookup", '{"id": 3}', "tool_calls")
            messages += [first.choices[0].message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": call.id, "content": "q"}]
            await client.chat.completions.create(model="p", messages=messages, tools=[LOOKUP])

        _, calls = play(proxy, agent)
    finally:
        proxy.stop()
    assert calls[1].parent == 0 and calls[1].prompt[: len(calls[0].prompt) + len(calls[0].completion.tokens)] == (
        calls[0].prompt + calls[0].completion.tokens)


def test_streamed_chat_completions_are_answered_and_recorded_like_plain_ones(serve, scripted):
    """stream=true, read chunk by chunk and through the SDK's stream helper: the same reply, tool call, finish reason
    and usage as without streaming, recorded the same, and a later call extends the streamed one token for token."""
    proxy = serve(scripted(_tool_script))

    async def agent(client):
        messages = [{"role": "user", "content": "code of 3?"}]
        plain = await client.chat.completions.create(model="p", messages=messages, tools=[LOOKUP])
        stream = await client.chat.completions.create(model="p", messages=messages, tools=[LOOKUP], stream=True,
                                                      stream_options={"include_usage": True})
        chunks = [chunk async for chunk in stream]
        deltas = [chunk.choices[0] for chunk in chunks if chunk.choices]
        [call] = [c for d in deltas for c in d.delta.tool_calls or []]
        assert "".join(d.delta.content or "" for d in deltas) == plain.choices[0].message.content == "checking"
        assert (call.function.name, call.function.arguments) == ("lookup", '{"id": 3}')
        assert [d.finish_reason for d in deltas if d.finish_reason] == ["tool_calls"]
        assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
        messages += [{"role": "assistant", "content": "checking", "tool_calls": [
            {"id": call.id, "type": "function", "function": call.function.model_dump()}]},
            {"role": "tool", "tool_call_id": call.id, "content": '{"code": "q"}'}]
        async with client.chat.completions.stream(model="p", messages=messages, tools=[LOOKUP]) as helper:
            final = await helper.get_final_completion()
        return final.choices[0].message.content

    answer, calls = play(proxy, agent)
    assert answer == "it is q" and [c.parent for c in calls] == [None, None, 0]  # 0 and 1: the same tokens
    assert (calls[0].prompt, calls[0].completion.tokens) == (calls[1].prompt, calls[1].completion.tokens)
    streamed = calls[1].prompt + calls[1].completion.tokens
    assert calls[2].prompt[: len(streamed)] == streamed


def test_responses_api_items_and_previous_response_id_continue_the_recorded_calls(serve, scripted, chat):
    """client.responses.create (and its stream helper): instructions and input items render as the same chat
    messages, output items sent back (or previous_response_id) extend the recorded call token for token."""
    proxy = serve(scripted(_tool_script, version=4))
    brief = "be brief"

    async def agent(client):
        first = await client.responses.create(model="p", instructions=brief, input="code of 3?", tools=[FLAT_LOOKUP])
        text, call = first.output
        assert (text.type, first.output_text, call.type, call.name, json.loads(call.arguments)) == (
            "message", "checking", "function_call", "lookup", {"id": 3})
        items = [{"role": "user", "content": "code of 3?"}, *(i.model_dump(exclude_none=True) for i in first.output),
                 {"type": "function_call_output", "call_id": call.call_id, "output": '{"code": "q"}'}]
        second = await client.responses.create(model="p", instructions=brief, input=items, tools=[FLAT_LOOKUP])
        third = await client.responses.create(model="p", instructions=brief, previous_response_id=second.id,
                                              input="sure?", tools=[FLAT_LOOKUP])
        async with client.responses.stream(model="p", instructions=brief, previous_response_id=third.id,
                                           input="again?", tools=[FLAT_LOOKUP]) as stream:
            events = [event.type async for event in stream]
            final = await stream.get_final_response()
        assert events[0] == "response.created" and events[-1] == "response.completed"
        return [second.output_text, third.output_text, final.output_text, final.usage.output_tokens]

    answers, calls = play(proxy, agent)
    assert answers == ["it is q", "it is q", "it is q", len(calls[3].completion.tokens)]
    assert [c.parent for c in calls] == [None, 0, 1, 2] and calls[0].tools == [LOOKUP]
    question = [{"role": "system", "content": brief}, {"role": "user", "content": "code of 3?"}]
    assert calls[0].messages == question and calls[0].prompt == chat.prompt(question, [LOOKUP])
    for before, after in itertools.pairwise(calls):
        assert after.prompt[: len(before.prompt) + len(before.completion.tokens)] == (
            before.prompt + before.completion.tokens)
        assert after.completion.versions == [4] * len(after.completion.tokens)


def test_endpoints_not_served_answer_404_naming_those_served(serve, scripted):
    proxy = serve(scripted(lambda p, j: "hello"))

    async def agent(client):
        with pytest.raises(openai.NotFoundError, match=r"/v1/completions is not served .* POST /v1/responses"):
            await client.completions.create(model="p", prompt="x")
        with pytest.raises(openai.BadRequestError, match="only function tools"):
            await client.responses.create(model="p", input="x", tools=[{"type": "web_search"}])

    _, calls = play(proxy, agent)
    assert calls == []


def test_required_tool_choice_never_returns_a_reply_without_a_call(serve, scripted):
    """tool_choice="required": a reply holding a call is returned; one without fails with HTTP 422, is not recorded,
    and is counted."""
    proxy = serve(scripted(lambda p, j: "no call" if "plain" in p else '<tool_call>{"name": "lookup", '
                                                                        '"arguments": {"id": 1}}</tool_call>'))

    async def agent(client):
        ok = await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "look"}],
                                                  tools=[LOOKUP], tool_choice="required")
        assert ok.choices[0].message.tool_calls[0].function.name == "lookup"
        with pytest.raises(openai.UnprocessableEntityError, match="tool_choice='required' but the model wrote no"):
            await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "plain"}],
                                                 tools=[LOOKUP], tool_choice="required")
        with pytest.raises(openai.UnprocessableEntityError, match="tool_choice='required'"):
            await client.responses.create(model="p", input="plain", tools=[FLAT_LOOKUP], tool_choice="required")

    _, log = play_log(proxy, agent)
    assert len(log.calls) == 1 and log.tool_choice_failures == 2


TWO_CALLS = '<tool_call>{"name": "lookup", "arguments": {"id": 1}}</tool_call>\n' \
            '<tool_call>{"name": "lookup", "arguments": {"id": 2}}</tool_call>'


def test_parallel_tool_calls_false_returns_and_records_only_the_first_call(serve, scripted, tokenizer, chat):
    """The model writes two calls: both come back by default; with parallel_tool_calls=false only the first (by
    either API), and the recorded completion is cut after it, so the next call's context holds exactly the call the
    agent ran, its routing (an MoE sampler's, rollout.return_routed_experts) cut with it."""
    sampler = scripted(lambda p, j: TWO_CALLS if p.endswith("ids?<eos><assistant>") else "done")
    generate = sampler.generate

    def with_routes(prompts, params):  # each token of prompt and reply "routed" to its own index
        groups = generate(prompts, params)
        for prompt, group in zip(prompts, groups):
            for completion in group:
                completion.routed_experts = torch.arange(len(prompt) + len(completion.tokens))[:, None, None]
        return groups

    sampler.generate = with_routes
    proxy = serve(sampler)

    async def agent(client):
        messages = [{"role": "user", "content": "ids?"}]
        both = await client.chat.completions.create(model="p", messages=messages, tools=[LOOKUP])
        one = await client.chat.completions.create(model="p", messages=messages, tools=[LOOKUP],
                                                   parallel_tool_calls=False)
        assert [json.loads(c.function.arguments)["id"] for c in both.choices[0].message.tool_calls] == [1, 2]
        [call] = one.choices[0].message.tool_calls
        assert json.loads(call.function.arguments) == {"id": 1} and one.choices[0].finish_reason == "tool_calls"
        messages += [one.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "x"}]
        await client.chat.completions.create(model="p", messages=messages, tools=[LOOKUP])
        response = await client.responses.create(model="p", input="ids?", tools=[FLAT_LOOKUP],
                                                 parallel_tool_calls=False)
        assert [(item.type, json.loads(item.arguments)) for item in response.output] == [("function_call", {"id": 1})]
        return messages

    messages, calls = play(proxy, agent)
    cut = calls[1].completion
    assert tokenizer.decode(cut.tokens) == TWO_CALLS.split("\n")[0] and cut.finish_reason == "cut"
    assert len(cut.logprobs) == len(cut.versions) == len(cut.tokens)
    assert torch.equal(cut.routed_experts.flatten(), torch.arange(len(calls[1].prompt) + len(cut.tokens)))
    after = calls[2]
    assert after.parent == 1 and '"id": 2' not in tokenizer.decode(after.prompt)
    assert after.prompt == calls[1].prompt + cut.tokens + chat.continuation(messages[2:], False, [LOOKUP])


def test_a_cut_history_starts_a_new_subtree_and_counts_the_sharing_it_lost(serve, scripted, chat):
    """An agent summarises its history: the call after the cut is rendered afresh and follows the call before it;
    the tokens of that call it no longer shares are counted; the next call extends it, a new subtree."""
    proxy = serve(scripted(lambda p, j: "r"))
    system = {"role": "system", "content": "sys"}

    async def agent(client):
        messages = [system, {"role": "user", "content": "a"}]
        for text in ["b", "c"]:
            reply = await client.chat.completions.create(model="p", messages=messages)
            messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": text}]
        cut = [system, {"role": "user", "content": "summary"}, *messages[4:]]  # the last reply and question kept
        reply = await client.chat.completions.create(model="p", messages=cut)
        await client.chat.completions.create(model="p", messages=[*cut, reply.choices[0].message.model_dump(
            exclude_none=True), {"role": "user", "content": "d"}])

    _, log = play_log(proxy, agent)
    calls = log.calls
    full = [c.prompt + c.completion.tokens for c in calls]
    assert [(c.parent, c.follows) for c in calls] == [(None, None), (0, 0), (None, 1), (2, 2)]
    kept = len(chat.render([system], add_generation_prompt=False)) + 1  # "<bos><system>sys<eos>" and "<user>"
    assert full[1][:kept] == full[2][:kept] and full[1][kept] != full[2][kept]
    assert (log.history_mismatches, log.sharing_lost_tokens) == (1, len(full[1]) - kept)
    assert log.shared_tokens == len(full[0]) + len(full[2])
    stats = PrefixTree.build([TokenSequence(torch.tensor(f)) for f in full]).stats()
    assert stats.unique_tokens == len(full[1]) + len(full[3]) - kept  # two subtrees below the shared system prompt


# Excerpts of real chat templates (their tool-call parts, as the files spell them: `\n` is backslash-n in Jinja).
QWEN3_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {{- tool_call.arguments | tojson }}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}"""
QWEN3_CODER_TEMPLATE = r"""{%- if tools is iterable and tools | length > 0 %}
    {{- "\n\n# Tools\n\nYou have access to the following functions:\n\n" }}
    {{- "<tools>" }}
    {%- for tool in tools %}
        {{- "\n<function>\n<name>" ~ tool.name ~ "</name>" }}
    {%- endfor %}
    {{- "\n</tools>" }}
    {{- '\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n</function>\n</tool_call>' }}
{%- endif %}
            {%- for tool_call in message.tool_calls %}
                {%- if loop.first %}
                    {{- '<tool_call>\n<function=' + tool_call.name + '>\n' }}
                {%- else %}
                    {{- '\n<tool_call>\n<function=' + tool_call.name + '>\n' }}
                {%- endif %}
                {%- for args_name, args_value in tool_call.arguments|items %}
                    {{- '<parameter=' + args_name + '>\n' }}
                    {{- args_value }}
                    {{- '\n</parameter>\n' }}
                {%- endfor %}
                {{- '</function>\n</tool_call>' }}
            {%- endfor %}"""
LLAMA31_TEMPLATE = r"""{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
{%- endif %}
    {%- elif 'tool_calls' in message %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
        {%- else  %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}"""
GEMMA2_TEMPLATE = (
    r"""{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'assistant') %}{% set role = 'model' %}"""
    r"""{% else %}{% set role = message['role'] %}{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] """
    r"""| trim + '<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}""")


def test_auto_reads_the_tool_call_format_off_real_chat_templates():
    """Excerpts of Qwen3 (hermes), Qwen3-Coder / Qwen3.5 (XML, which also holds `<tool_call>`), Llama-3.1 (JSON with
    "parameters", `<|python_tag|>`; the Llama part alone, and only its builtin-tool part) and Gemma 2 (no tool
    format: none)."""
    builtin_only = LLAMA31_TEMPLATE.split("{%- else  %}")[0].replace('"parameters": dictionary', "")
    assert "Environment: ipython" in builtin_only and '"parameters": ' not in builtin_only
    found = [detect_tool_parser(t) for t in (QWEN3_TEMPLATE, QWEN3_CODER_TEMPLATE, LLAMA31_TEMPLATE, builtin_only,
                                             GEMMA2_TEMPLATE)]
    assert found == ["hermes", "qwen3_coder", "llama3_json", "llama3_json", "none"]


def test_a_tokenizer_with_named_templates_is_read_through_its_tool_use_template():
    """Several named templates (a dict, as Hermes 2 Pro ships `default` and `tool_use`): the one transformers
    renders a request with tools by, `tool_use`, else `default`; read as `none` before (the dict's keys searched)."""
    assert detect_tool_parser({"default": GEMMA2_TEMPLATE, "tool_use": QWEN3_TEMPLATE}) == "hermes"
    assert detect_tool_parser({"tool_use": GEMMA2_TEMPLATE, "default": QWEN3_TEMPLATE}) == "none"  # tools: tool_use
    assert detect_tool_parser({"default": LLAMA31_TEMPLATE, "rag": GEMMA2_TEMPLATE}) == "llama3_json"
    assert detect_tool_parser({"chat": GEMMA2_TEMPLATE, "agent": QWEN3_CODER_TEMPLATE}) == "qwen3_coder"
    tokenizer = builtin_tokenizer()
    tokenizer.chat_template = {"default": PLAIN_CHAT_TEMPLATE, "tool_use": BUILTIN_CHAT_TEMPLATE}
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}]
    assert tokenizer.get_chat_template(tools=tools) == BUILTIN_CHAT_TEMPLATE  # transformers' own choice, the same
    assert resolve_tool_parser("auto", tokenizer.chat_template) == "hermes"


def test_a_tool_call_no_parser_can_read_is_refused_naming_rollout_tool_parser(serve, scripted, tokenizer):
    """A parser of `none` (auto on a template with no known format, or none itself): a request that needs a tool
    call is refused with HTTP 400 naming rollout.tool_parser and its values, before sampling (it was sampled and
    always failed with a generic 422); tool_choice=auto is answered, the call left as text."""
    written = '<tool_call>{"name": "lookup", "arguments": {"id": 1}}</tool_call>'
    plain = builtin_tokenizer()  # shows the tools, in no format a parser reads
    plain.chat_template = "{% if tools %}Tools: {{ tools | tojson }}\n{% endif %}" + PLAIN_CHAT_TEMPLATE
    auto = ChatProxy(scripted(lambda p, j: written), ChatFormat(plain))
    auto.start()
    none = serve(scripted(lambda p, j: written), tool_parser="none")
    user = [{"role": "user", "content": "look"}]

    async def agent(client):
        for choice in ("required", NAMED):
            with pytest.raises(openai.BadRequestError, match="rollout.tool_parser.*one of hermes, .*llama3_json") as e:
                await client.chat.completions.create(model="p", messages=user, tools=[LOOKUP], tool_choice=choice)
            assert e.value.code == "no_tool_parser"
        with pytest.raises(openai.BadRequestError, match="needs a tool call, but rollout.tool_parser"):
            await client.responses.create(model="p", input="look", tools=[FLAT_LOOKUP], tool_choice="required")
        reply = await client.chat.completions.create(model="p", messages=user, tools=[LOOKUP])
        assert reply.choices[0].message.content == written and not reply.choices[0].message.tool_calls
        return str(e.value)

    try:
        (said, calls), (said_none, calls_none) = play(auto, agent), play(none, agent)
    finally:
        auto.stop()
    assert "rollout.tool_parser=auto found no tool-call format" in said and "rollout.tool_parser=none" in said_none
    assert len(calls) == len(calls_none) == 1  # only the tool_choice=auto request was sampled
    assert auto.sampler.calls == none.sampler.calls == [(1, 1)]
