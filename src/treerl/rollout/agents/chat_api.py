"""The Chat Completions API as the agent proxy serves it: requests in, `chat.completion` (or its stream) out.

Step 1 (docs/architecture.md): an agent's chat completions, sampled and recorded.

Also what both of the proxy's APIs share (`treerl.rollout.agents.responses_api` is the other): a request
for model replies in chat-message form (`ModelRequest`), one answered choice (`Answer`), and the
message normalisation that lets the proxy compare a request's history with the replies it returned.

Streaming (`stream=true`) sends the same answer as server-sent `chat.completion.chunk` events: the
sampler samples whole replies, so each choice's text comes in one delta once it is sampled, then its
tool calls, then its finish reason (and a usage chunk with `stream_options.include_usage`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from fastapi import HTTPException
from pydantic import BaseModel, ConfigDict, Field

from treerl.rollout.conversations.chat import Message, Tool
from treerl.rollout.sampling.sampler import Completion

TOOL_CHOICES = ("auto", "none", "required")


@dataclass
class ModelRequest:
    """A request for model replies, whichever API it came by: a normalised conversation, tools, sampling options."""

    messages: list[Message]
    tools: list[Tool] | None = None
    tool_choice: str = "auto"  # auto | none | required | function (the one named by tool_name)
    tool_name: str | None = None
    parallel_tool_calls: bool = True  # False: at most one tool call per reply
    n: int = 1
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        """A tool choice the offered tools cannot meet is refused (HTTP 400)."""
        offered = [(tool.get("function") or tool).get("name") for tool in self.tools or []]
        if self.tool_choice in ("required", "function") and not offered:
            raise HTTPException(400, f"tool_choice {self.tool_choice!r} needs 'tools'")
        if self.tool_choice == "function" and self.tool_name not in offered:
            raise HTTPException(400, f"tool_choice names function {self.tool_name!r}, which is not in 'tools' "
                                     f"({', '.join(map(str, offered))})")


@dataclass
class Answer:
    """One answered choice: the assistant message returned, its finish reason, and the completion recorded for it."""

    reply: Message
    finish: str  # stop | length | tool_calls
    completion: Completion


# ---------------------------------------------------------------------------------------------- messages
def normalise_message(message: dict[str, Any], where: str) -> Message:
    """An OpenAI message as the chat template expects it: text content, tool-call arguments as objects."""
    role = message.get("role")
    if role not in ("system", "developer", "user", "assistant", "tool"):
        raise HTTPException(400, f"{where}: unknown role {role!r}")
    out: Message = {"role": "system" if role == "developer" else role,
                    "content": shown_content(message, where, images=role in IMAGE_ROLES)}
    if message.get("tool_calls"):
        calls = []
        for call in message["tool_calls"]:
            function = call.get("function") or {}
            if not isinstance(function.get("name"), str):
                raise HTTPException(400, f"{where}: a tool call without a function name")
            calls.append(tool_call(call.get("id"), function["name"], function.get("arguments")))
        out["tool_calls"] = calls
    for key in ("tool_call_id", "name"):
        if message.get(key) is not None:
            out[key] = message[key]
    return out


def text_content(message: dict[str, Any], where: str, part_types: tuple[str, ...] = ("text",)) -> str:
    """A message's text: a string, or the concatenated text of its parts (other kinds of part are refused)."""
    content = message.get("content")
    if isinstance(content, list):
        if any(not isinstance(p, dict) or p.get("type") not in part_types for p in content):
            raise HTTPException(400, f"{where}: only text content parts ({', '.join(part_types)}) are supported")
        content = "".join(p.get("text", "") for p in content)
    if content is not None and not isinstance(content, str):
        raise HTTPException(400, f"{where}: content must be a string or a list of text parts")
    return content or ""


IMAGE_ROLES = ("user", "tool")  # the messages that may show images (what the model is shown, never what it wrote)
IMAGE_PART_TYPES = ("image_url", "input_image")  # Chat Completions' part, the Responses API's


def shown_content(message: dict[str, Any], where: str, part_types: tuple[str, ...] = ("text",),
                  images: bool = True) -> str | list[dict[str, Any]]:
    """A message's content: its text (`text_content`), or where it shows images, its parts in order, each text part
    `{"type": "text"}` and each image `{"type": "image_url", "image_url": {"url"}}` (a data URL: nothing is
    downloaded), as `treerl.rollout.conversations.images` reads them."""
    content = message.get("content")
    if not isinstance(content, list) or not any(isinstance(p, dict) and p.get("type") in IMAGE_PART_TYPES
                                                for p in content):
        return text_content(message, where, part_types)
    if not images:
        raise HTTPException(400, f"{where}: images are shown in {' and '.join(IMAGE_ROLES)} messages only")
    parts: list[dict[str, Any]] = []
    for k, part in enumerate(content):
        if isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES:
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            if not isinstance(url, str) or not url.startswith("data:"):
                raise HTTPException(400, f"{where}: content part {k}: an image must be a data URL (data:image/png;"
                                         "base64,...): treerl downloads nothing and takes no file ids")
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            parts.append({"type": "text", "text": text_content({"content": [part]}, where, part_types)})
    return parts


def tool_call(call_id: str | None, name: str, arguments: Any) -> dict[str, Any]:
    """A tool call of a normalised assistant message."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments_object(arguments)}}


def arguments_object(arguments: Any) -> Any:
    """Tool-call arguments as an object for the template (a JSON string is parsed; anything else kept)."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return {} if arguments is None else arguments


def json_string(arguments: Any) -> str:
    """Tool-call arguments in OpenAI's wire format (a JSON string)."""
    return arguments if isinstance(arguments, str) else json.dumps(arguments)


def same_turn(a: Message, b: Message) -> bool:
    """Two messages say the same thing (tool-call ids aside)."""
    def key(m: Message) -> tuple:
        calls = [(c["function"]["name"], json.dumps(c["function"]["arguments"], sort_keys=True))
                 for c in m.get("tool_calls", [])]
        return m["role"], m["content"], calls, m.get("tool_call_id"), m.get("name")

    return key(a) == key(b)


# ---------------------------------------------------------------------------------------------- requests
class ChatRequest(BaseModel):
    """The fields of an OpenAI chat-completions request the proxy reads (others are ignored)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    n: int = Field(1, ge=1, le=64)
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    return_token_ids: bool = False  # vLLM's extension: prompt_token_ids and each choice's token_ids

    def model_request(self) -> ModelRequest:
        """The API-neutral request; options that would change the sampled policy are refused (HTTP 400)."""
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise HTTPException(400, f"'{name}' is not supported: it would change the sampled policy")
        if self.logit_bias:
            raise HTTPException(400, "'logit_bias' is not supported: it would change the sampled policy")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise HTTPException(400, "'response_format' is not supported (no constrained decoding)")
        if self.top_logprobs:
            raise HTTPException(400, "'top_logprobs' is not supported (only the sampled tokens' log-probs)")
        choice, name = read_tool_choice(self.tool_choice, lambda named: (named.get("function") or {}).get("name"))
        return ModelRequest(
            [normalise_message(m, f"messages[{i}]") for i, m in enumerate(self.messages)], self.tools, choice, name,
            parallel_tool_calls=self.parallel_tool_calls is not False, n=self.n,
            max_tokens=self.max_completion_tokens or self.max_tokens, temperature=self.temperature, top_p=self.top_p,
            stop=self.stop, seed=self.seed,
        )


def read_tool_choice(value: str | dict[str, Any] | None, name_of: Any) -> tuple[str, str | None]:
    """A request's `tool_choice` as (auto | none | required | function, the function's name); `name_of` reads the
    name from the API's named-function object."""
    if value is None:
        return "auto", None
    if isinstance(value, dict):
        if value.get("type") != "function":
            raise HTTPException(400, f"tool_choice of type {value.get('type')!r} is not supported (a function only)")
        return "function", name_of(value)
    if value not in TOOL_CHOICES:
        raise HTTPException(400, f"'tool_choice' {value!r} is not one of {', '.join(TOOL_CHOICES)} or a named function")
    return value, None


# ---------------------------------------------------------------------------------------------- responses
def wire_message(message: Message) -> dict[str, Any]:
    """A normalised assistant message in OpenAI's response shape (arguments as JSON strings)."""
    out: dict[str, Any] = {"role": "assistant", "content": message["content"] or None}
    if message.get("tool_calls"):
        out["tool_calls"] = [
            {"id": c["id"], "type": "function",
             "function": {"name": c["function"]["name"], "arguments": json_string(c["function"]["arguments"])}}
            for c in message["tool_calls"]]
    return out


def chat_response(request: ChatRequest, response_id: str, model: str, prompt: list[int], answers: list[Answer],
                  tokens: Any) -> dict[str, Any]:
    """The `chat.completion` object; `tokens` turns token ids into token strings (for `logprobs`)."""
    choices = []
    for i, answer in enumerate(answers):
        choice = {"index": i, "message": wire_message(answer.reply), "finish_reason": answer.finish,
                  "logprobs": _logprobs(request, answer, tokens)}
        if request.return_token_ids:
            choice["token_ids"] = answer.completion.tokens
        choices.append(choice)
    response = {"id": response_id, "object": "chat.completion", "created": int(time.time()), "model": model,
                "choices": choices, "usage": _usage(prompt, answers)}
    if request.return_token_ids:
        response["prompt_token_ids"] = prompt
    return response


def chat_chunks(response: dict[str, Any], request: ChatRequest) -> Iterator[bytes]:
    """A `chat.completion` response as the server-sent `chat.completion.chunk` events of its stream."""
    head = {key: response[key] for key in ("id", "created", "model")} | {"object": "chat.completion.chunk"}

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> bytes:
        return sse_event(json.dumps(head | {"choices": choices} | extra))

    for choice in response["choices"]:
        i, message = choice["index"], choice["message"]
        first: dict[str, Any] = {"index": i, "delta": {"role": "assistant", "content": message["content"] or ""},
                                 "logprobs": choice["logprobs"], "finish_reason": None}
        if "token_ids" in choice:
            first["token_ids"] = choice["token_ids"]
        yield chunk([first], **({"prompt_token_ids": response["prompt_token_ids"]} if i == 0 and
                                "prompt_token_ids" in response else {}))
        if message.get("tool_calls"):
            calls = [{"index": j} | call for j, call in enumerate(message["tool_calls"])]
            yield chunk([{"index": i, "delta": {"tool_calls": calls}, "logprobs": None, "finish_reason": None}])
        yield chunk([{"index": i, "delta": {}, "logprobs": None, "finish_reason": choice["finish_reason"]}])
    if (request.stream_options or {}).get("include_usage"):
        yield chunk([], usage=response["usage"])
    yield sse_event("[DONE]")


def sse_event(data: str, event: str | None = None) -> bytes:
    """One server-sent event (`data` is one line of JSON): written here, so no fastapi release is needed for it."""
    return (f"event: {event}\n" if event else "").encode() + f"data: {data}\n\n".encode()


def _logprobs(request: ChatRequest, answer: Answer, tokens: Any) -> dict[str, Any] | None:
    """The sampled tokens' log-probs in OpenAI's `logprobs.content` shape, if the request asked for them."""
    if not request.logprobs:
        return None
    pieces = tokens(answer.completion.tokens)
    return {"content": [{"token": t, "logprob": lp, "bytes": None, "top_logprobs": []}
                        for t, lp in zip(pieces, answer.completion.logprobs)]}


def _usage(prompt: list[int], answers: list[Answer]) -> dict[str, int]:
    generated = sum(len(a.completion.tokens) for a in answers)
    return {"prompt_tokens": len(prompt), "completion_tokens": generated, "total_tokens": len(prompt) + generated}
