"""Tool-call parsers: a model's reply text -> (content, structured tool calls), one parser per model family.

Step 1 (docs/architecture.md): the tool calls the proxy reads out of a reply.

A chat template tells the model how to write a tool call; the parser reads the same format back,
as vLLM's and SGLang's `--tool-call-parser` do. Registered by name in `TOOL_PARSERS`:

- `hermes` (aliases `qwen`, `qwen2.5`, `qwen3`): Hermes / Qwen2.5 / Qwen3 style, every call a JSON
  object between tags: `<tool_call>{"name": "lookup", "arguments": {"id": 3}}</tool_call>`. Text
  outside the tags is the reply's content. The built-in tokenizer's template writes this format.
- `qwen3_coder` (aliases `qwen3.5`, `qwen3_xml`): Qwen3-Coder / Qwen3.5 XML, one parameter per tag:
  `<tool_call><function=lookup><parameter=id>3</parameter></function></tool_call>`. A value is
  typed by the tool's JSON schema (a `string` parameter stays text; others are read as JSON when
  they parse), as vLLM's `qwen3_coder` parser does.
- `llama3_json` (alias `llama3`): Llama 3.1-3.3 JSON tool calling, the reply is the call itself,
  `{"name": "lookup", "parameters": {"id": 3}}` (optionally after `<|python_tag|>`, several joined
  by `;`). A reply that is not wholly such calls is content.
- `none`: no tool calls; the whole reply is content.
- `auto` (`rollout.tool_parser`'s default): the parser whose format the chat template writes
  (`detect_tool_parser`; of several named templates, `tool_use`, the one a request with tools gets),
  `none` for a template that writes no format treerl knows. That is not
  silent: an agent run warns at its start, and the proxy refuses a request that needs a tool call
  (`tool_choice` "required" or a named function) with HTTP 400 naming `rollout.tool_parser` (`no_parser_hint`).

A call that does not parse is not dropped: it stays in the content, as the model wrote it, so the
agent sees what went wrong (as vLLM does). Each parsed call records where it ends in the text
(`ToolCall.end`), so a reply can be cut after its first call (`parallel_tool_calls=false`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

Tool = dict[str, Any]  # an OpenAI tool definition: {"type": "function", "function": {"name", "parameters", ...}}


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the function's name and its arguments as a JSON string (OpenAI's wire format)."""

    name: str
    arguments: str
    end: int = field(default=-1, compare=False)  # offset in the reply text just after the call


ToolParser = Callable[[str, "list[Tool] | None"], tuple[str, list[ToolCall]]]

_TAGGED_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_XML_FUNCTION = re.compile(r"<function=([^>\s]+)>(.*?)</function>", re.DOTALL)
_XML_PARAMETER = re.compile(r"<parameter=([^>\s]+)>(.*?)</parameter>", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"


def parse_hermes(text: str, tools: list[Tool] | None = None) -> tuple[str, list[ToolCall]]:
    """Every well-formed `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; the rest is content."""
    return _parse_tagged(text, _json_call)


def parse_qwen3_coder(text: str, tools: list[Tool] | None = None) -> tuple[str, list[ToolCall]]:
    """Every well-formed `<tool_call><function=f><parameter=p>v</parameter></function></tool_call>`."""
    return _parse_tagged(text, lambda body: _xml_call(body, tools))


def parse_llama3_json(text: str, tools: list[Tool] | None = None) -> tuple[str, list[ToolCall]]:
    """The whole reply as `{"name": ..., "parameters": {...}}` calls (joined by `;`), else all content."""
    start = text.find(_PYTHON_TAG) + len(_PYTHON_TAG) if _PYTHON_TAG in text else 0
    if text[:start].replace(_PYTHON_TAG, "").strip():
        return text, []
    decoder, calls, position = json.JSONDecoder(), [], start
    while True:
        position = _skip(text, position, " \n\t")
        try:
            value, position = decoder.raw_decode(text, position)
        except ValueError:
            return text, []
        call = _named_call(value, position)
        if call is None:
            return text, []
        calls.append(call)
        position = _skip(text, position, " \n\t")
        if position == len(text):
            return "", calls
        if text[position] != ";":
            return text, []
        position += 1


def parse_none(text: str, tools: list[Tool] | None = None) -> tuple[str, list[ToolCall]]:
    """No tool calls: the reply is all content."""
    return text, []


def _parse_tagged(text: str, read: Callable[[str], ToolCall | None]) -> tuple[str, list[ToolCall]]:
    """Calls between `<tool_call>` tags read by `read`; text outside the tags (and malformed calls) is content."""
    calls: list[ToolCall] = []
    kept: list[str] = []
    position = 0
    for match in _TAGGED_CALL.finditer(text):
        call = read(match.group(1))
        if call is None:
            continue  # malformed: left in the content
        kept.append(text[position : match.start()])
        position = match.end()
        calls.append(ToolCall(call.name, call.arguments, end=match.end()))
    kept.append(text[position:])
    return "".join(kept).strip(), calls


def _json_call(body: str) -> ToolCall | None:
    """`{"name": str, "arguments": object}` as a ToolCall, or None if it is not one."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    return _named_call(value, len(body))


def _named_call(value: Any, end: int) -> ToolCall | None:
    """A decoded `{"name": str, "arguments" | "parameters": object}` as a ToolCall, or None."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return ToolCall(value["name"], arguments if isinstance(arguments, str) else json.dumps(arguments), end=end)


def _xml_call(body: str, tools: list[Tool] | None) -> ToolCall | None:
    """`<function=name><parameter=p>v</parameter>...</function>` as a ToolCall, values typed by the schema."""
    match = _XML_FUNCTION.fullmatch(body.strip())
    if match is None:
        return None
    name, inner = match.groups()
    if _XML_PARAMETER.sub("", inner).strip():
        return None  # text outside the parameter tags (an unclosed or misspelt tag): not a call
    types = _parameter_types(tools, name)
    arguments = {key: _typed(value, types.get(key)) for key, value in _XML_PARAMETER.findall(inner)}
    return ToolCall(name, json.dumps(arguments))


def _parameter_types(tools: list[Tool] | None, name: str) -> dict[str, Any]:
    """The JSON-schema type of each parameter of tool `name` (empty if the tool is not offered)."""
    for tool in tools or []:
        function = tool.get("function", tool)
        if function.get("name") == name:
            properties = (function.get("parameters") or {}).get("properties") or {}
            return {key: (schema or {}).get("type") for key, schema in properties.items()}
    return {}


def _typed(value: str, schema_type: Any) -> Any:
    """A parameter's text as its schema type: strings stay text, anything else is JSON when it parses."""
    value = value.removeprefix("\n").removesuffix("\n")  # the template writes each value on its own line
    if schema_type == "string":
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value


def _skip(text: str, position: int, characters: str) -> int:
    while position < len(text) and text[position] in characters:
        position += 1
    return position


TOOL_PARSERS: dict[str, ToolParser] = {
    "hermes": parse_hermes, "qwen": parse_hermes, "qwen2.5": parse_hermes, "qwen3": parse_hermes,
    "qwen3_coder": parse_qwen3_coder, "qwen3.5": parse_qwen3_coder, "qwen3_xml": parse_qwen3_coder,
    "llama3_json": parse_llama3_json, "llama3": parse_llama3_json, "none": parse_none,
}
PARSER_NAMES = ("auto", *TOOL_PARSERS)
FORMATS = ", ".join(name for name in TOOL_PARSERS if name != "none")  # what rollout.tool_parser can be set to


def detect_tool_parser(chat_template: str | dict[str, str] | None) -> str:
    """The parser of the tool-call format a chat template writes: `none` when it writes none treerl knows.

    A tokenizer with several named templates (a dict, e.g. Hermes 2 Pro's `default` and `tool_use`) is read
    through the one transformers applies to a request with tools: `tool_use`, else `default`, else all of them."""
    template = _tool_template(chat_template)
    if "<function=" in template and "<parameter=" in template:
        return "qwen3_coder"
    if "<tool_call>" in template:
        return "hermes"
    if '"parameters": ' in template or _PYTHON_TAG in template:
        return "llama3_json"
    return "none"


def _tool_template(chat_template: str | dict[str, str] | None) -> str:
    """The template text a request with tools is rendered by (`get_chat_template(tools=...)`'s choice)."""
    if not isinstance(chat_template, dict):
        return chat_template or ""
    for name in ("tool_use", "default"):
        if name in chat_template:
            return chat_template[name]
    return "\n".join(chat_template.values())


def resolve_tool_parser(name: str, chat_template: str | dict[str, str] | None = None) -> str:
    """The registered parser `name` stands for (`auto`: the one the chat template's format needs)."""
    if name == "auto":
        name = detect_tool_parser(chat_template)
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(PARSER_NAMES)}")
    return name


def no_parser_hint(name: str) -> str:
    """Why a model's tool calls come back as plain text under rollout.tool_parser=`name` (auto finding no format,
    or none), and the setting that fixes it: said instead of failing silently."""
    why = ("rollout.tool_parser=auto found no tool-call format treerl knows in the chat template" if name == "auto"
           else "rollout.tool_parser=none")
    return (f"{why}, so tool calls come back as plain text: set rollout.tool_parser to the model's format, one of "
            f"{FORMATS}")
