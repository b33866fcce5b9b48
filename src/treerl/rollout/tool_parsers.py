"""Tool-call parsers: a model's reply text -> (content, structured tool calls), one parser per model family.

Step 1 (docs/architecture.md): the tool calls the proxy reads out of a reply.

A chat template tells the model how to write a tool call; the parser reads the same format back,
as vLLM's and SGLang's `--tool-call-parser` do. Registered by name in `TOOL_PARSERS`:

- `hermes` (aliases `qwen`, `qwen2.5`, `qwen3`): Hermes / Qwen2.5 / Qwen3 style, every call a JSON
  object between tags: `<tool_call>{"name": "lookup", "arguments": {"id": 3}}</tool_call>`. Text
  outside the tags is the reply's content. The built-in tokenizer's template writes this format.
- `none`: no tool calls; the whole reply is content.

A call whose JSON does not parse is not dropped: it stays in the content, as the model wrote it,
so the agent sees what went wrong (as vLLM does).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the function's name and its arguments as a JSON string (OpenAI's wire format)."""

    name: str
    arguments: str


ToolParser = Callable[[str], tuple[str, list[ToolCall]]]

_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_hermes(text: str) -> tuple[str, list[ToolCall]]:
    """Every well-formed `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; the rest is content."""
    calls: list[ToolCall] = []
    kept: list[str] = []
    position = 0
    for match in _HERMES_CALL.finditer(text):
        call = _json_call(match.group(1))
        if call is None:
            continue  # malformed: left in the content
        kept.append(text[position : match.start()])
        position = match.end()
        calls.append(call)
    kept.append(text[position:])
    return "".join(kept).strip(), calls


def parse_none(text: str) -> tuple[str, list[ToolCall]]:
    """No tool calls: the reply is all content."""
    return text, []


def _json_call(body: str) -> ToolCall | None:
    """`{"name": str, "arguments": object}` as a ToolCall, or None if it is not one."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return ToolCall(value["name"], arguments if isinstance(arguments, str) else json.dumps(arguments))


TOOL_PARSERS: dict[str, ToolParser] = {
    "hermes": parse_hermes, "qwen": parse_hermes, "qwen2.5": parse_hermes, "qwen3": parse_hermes, "none": parse_none,
}


def get_tool_parser(name: str) -> ToolParser:
    """The parser registered as `name`."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]
