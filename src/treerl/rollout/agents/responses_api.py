"""The Responses API (`POST /v1/responses`) as the agent proxy serves it, on the same recording as chat completions.

Step 1 (docs/architecture.md): an agent's Responses API calls, sampled and recorded.

A request's `instructions` and `input` items become chat messages: `instructions` a system
message, a `message` item a message of its role (text parts only), consecutive `function_call`
items the tool calls of one assistant message (after the assistant text item before them, if
any), a `function_call_output` a `tool` message. `previous_response_id` (a response of the same
episode) continues that response's conversation without its instructions, as OpenAI's does. The
reply comes back as output items: a `message` with its `output_text` (unless the reply is only
tool calls), then one `function_call` item per call. So an agent that sends back the items it
received continues the recorded call token for token, like a chat-completions agent.

Function tools only (a built-in tool such as `web_search` is refused with HTTP 400), no `n`, no
constrained `text.format`, no `truncation="auto"` (the proxy never drops context: an agent
shortens its own history), no background mode and no server-side `conversation`. `stream=true`
sends the standard event sequence (`response.created` ... `response.completed`), each output
item in one delta once the reply is sampled.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

from fastapi import HTTPException
from pydantic import BaseModel, ConfigDict

from treerl.rollout.agents.chat_api import (
    IMAGE_ROLES,
    Answer,
    ModelRequest,
    json_string,
    read_tool_choice,
    shown_content,
    sse_event,
    tool_call,
)
from treerl.rollout.conversations.chat import Message, Tool

TEXT_PARTS = ("input_text", "output_text", "text")
LOGPROBS = "message.output_text.logprobs"  # the `include` entry that asks for the sampled tokens' log-probs


class ResponsesRequest(BaseModel):
    """The fields of a Responses API request the proxy reads (others, such as `store` or `metadata`, are ignored)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: str | list[dict[str, Any]] = ""
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    include: list[str] | None = None
    stream: bool | None = None
    text: dict[str, Any] | None = None
    truncation: str | None = None
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None

    def model_request(self, previous: list[Message]) -> ModelRequest:
        """The API-neutral request, `previous` being the conversation of `previous_response_id` (if any)."""
        self._refuse_unsupported()
        messages = ([{"role": "system", "content": self.instructions}] if self.instructions else []) + previous
        messages += input_messages([{"role": "user", "content": self.input}] if isinstance(self.input, str)
                                   else self.input)
        if not messages:
            raise HTTPException(400, "'input' is empty")
        choice, name = read_tool_choice(self.tool_choice, lambda named: named.get("name"))
        return ModelRequest(messages, chat_tools(self.tools), choice, name,
                            parallel_tool_calls=self.parallel_tool_calls is not False,
                            max_tokens=self.max_output_tokens, temperature=self.temperature, top_p=self.top_p)

    def _refuse_unsupported(self) -> None:
        """Options the proxy cannot honour without changing what it samples or stores (HTTP 400)."""
        if (self.text or {}).get("format", {}).get("type", "text") != "text":
            raise HTTPException(400, "'text.format' other than text is not supported (no constrained decoding)")
        if self.truncation not in (None, "disabled"):
            raise HTTPException(400, "truncation='auto' is not supported: the proxy never drops context (shorten "
                                     "the history in the agent)")
        if self.background:
            raise HTTPException(400, "'background' responses are not supported")
        if self.conversation is not None:
            raise HTTPException(400, "'conversation' is not supported; send the items, or previous_response_id")
        if self.top_logprobs:
            raise HTTPException(400, "'top_logprobs' is not supported (only the sampled tokens' log-probs)")


def chat_tools(tools: list[dict[str, Any]] | None) -> list[Tool] | None:
    """Responses function tools (`{"type": "function", "name", "parameters"}`) in the chat format."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function" or not isinstance(tool.get("name"), str):
            raise HTTPException(400, f"tools[{i}]: only function tools are supported, not {tool.get('type')!r}")
        function = {key: tool[key] for key in ("name", "description", "parameters") if tool.get(key) is not None}
        out.append({"type": "function", "function": function})
    return out


def input_messages(items: list[dict[str, Any]]) -> list[Message]:
    """Input items as normalised chat messages (see the module docstring)."""
    messages: list[Message] = []
    for i, item in enumerate(items):
        where, kind = f"input[{i}]", item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("system", "developer", "user", "assistant"):
                raise HTTPException(400, f"{where}: unknown role {role!r}")
            content = shown_content(item, where, TEXT_PARTS, images=role in IMAGE_ROLES)
            messages.append({"role": "system" if role == "developer" else role, "content": content})
        elif kind == "function_call":
            if not isinstance(item.get("name"), str):
                raise HTTPException(400, f"{where}: a function_call without a name")
            if not messages or messages[-1]["role"] != "assistant":
                messages.append({"role": "assistant", "content": ""})
            call = tool_call(item.get("call_id"), item["name"], item.get("arguments"))
            messages[-1].setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else shown_content({"content": output}, where, TEXT_PARTS)
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": text})
        else:
            raise HTTPException(400, f"{where}: input items of type {kind!r} are not supported (message, "
                                     "function_call, function_call_output)")
    return messages


def continued(messages: list[Message], instructions: str | None, reply: Message) -> list[Message]:
    """The conversation a later `previous_response_id` continues: without its instructions, with the reply."""
    return (messages[1:] if instructions else messages) + [reply]


# ---------------------------------------------------------------------------------------------- responses
def response_object(request: ResponsesRequest, response_id: str, model: str, prompt: list[int], answer: Answer,
                    tokens: Any) -> dict[str, Any]:
    """The `response` object of one answer; `tokens` turns token ids into token strings (for the log-probs)."""
    logprobs = None
    if LOGPROBS in (request.include or []):
        logprobs = [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                    for t, lp in zip(tokens(answer.completion.tokens), answer.completion.logprobs)]
    generated = len(answer.completion.tokens)
    incomplete = answer.finish == "length"
    return {
        "id": response_id, "object": "response", "created_at": int(time.time()), "model": model,
        "status": "incomplete" if incomplete else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None, "error": None,
        "output": output_items(answer.reply, logprobs), "instructions": request.instructions,
        "previous_response_id": request.previous_response_id, "tools": request.tools or [],
        "tool_choice": request.tool_choice or "auto", "parallel_tool_calls": request.parallel_tool_calls is not False,
        "temperature": request.temperature, "top_p": request.top_p, "max_output_tokens": request.max_output_tokens,
        "text": {"format": {"type": "text"}}, "metadata": {},
        "usage": {"input_tokens": len(prompt), "input_tokens_details": {"cached_tokens": 0},
                  "output_tokens": generated, "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": len(prompt) + generated},
    }


def output_items(reply: Message, logprobs: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """A reply as output items: its text as a `message` (unless it is only tool calls), then its `function_call`s."""
    items: list[dict[str, Any]] = []
    calls = reply.get("tool_calls") or []
    if reply["content"] or not calls:
        text = {"type": "output_text", "text": reply["content"], "annotations": [], "logprobs": logprobs}
        items.append({"type": "message", "id": f"msg_{uuid.uuid4().hex}", "role": "assistant", "status": "completed",
                      "content": [text]})
    for call in calls:
        items.append({"type": "function_call", "id": f"fc_{call['id'].removeprefix('call_')}", "call_id": call["id"],
                      "name": call["function"]["name"], "arguments": json_string(call["function"]["arguments"]),
                      "status": "completed"})
    return items


def response_events(response: dict[str, Any]) -> Iterator[bytes]:
    """A response as the server-sent events of its stream: created, each output item's events, completed."""
    counter = iter(range(1 << 62))

    def event(kind: str, **fields: Any) -> bytes:
        body = {"type": kind, "sequence_number": next(counter)} | fields
        return sse_event(json.dumps(body), event=kind)

    started = response | {"status": "in_progress", "output": [], "usage": None, "incomplete_details": None}
    yield event("response.created", response=started)
    yield event("response.in_progress", response=started)
    for index, item in enumerate(response["output"]):
        yield from _item_events(event, index, item)
    yield event("response.completed" if response["status"] == "completed" else "response.incomplete",
                response=response)


def _item_events(event: Any, index: int, item: dict[str, Any]) -> Iterator[bytes]:
    """The events of one output item: added, its text or arguments (one delta, then done), done."""
    at = {"output_index": index, "item_id": item["id"]}
    if item["type"] == "message":
        part = item["content"][0]
        logprobs = part["logprobs"] or []
        yield event("response.output_item.added", output_index=index,
                    item=item | {"status": "in_progress", "content": []})
        yield event("response.content_part.added", **at, content_index=0, part=part | {"text": "", "logprobs": []})
        yield event("response.output_text.delta", **at, content_index=0, delta=part["text"], logprobs=logprobs)
        yield event("response.output_text.done", **at, content_index=0, text=part["text"], logprobs=logprobs)
        yield event("response.content_part.done", **at, content_index=0, part=part)
    else:
        yield event("response.output_item.added", output_index=index,
                    item=item | {"status": "in_progress", "arguments": ""})
        yield event("response.function_call_arguments.delta", **at, delta=item["arguments"])
        yield event("response.function_call_arguments.done", **at, name=item["name"], arguments=item["arguments"])
    yield event("response.output_item.done", output_index=index, item=item)
