"""An OpenAI-compatible chat proxy that records every model call of an agent at token level.

An agent written with the OpenAI SDK talks to `{proxy.url}/episodes/<id>/v1` (one id per
episode); the proxy renders the messages with the model's own chat template (tools included),
samples with the inference engine (the embedded one, or a vLLM / SGLang / `treerl serve` server
through `CompletionsClient`), parses tool calls with the model family's parser
(`treerl.rollout.tool_parsers`) and answers in OpenAI's `chat.completion` shape. Each call is
recorded: prompt token ids, completion token ids, behaviour log-probs and policy versions.

Token-in / token-out. A chat template may render an earlier turn differently from how it was
sampled (a tool call the model wrote as bare arguments is re-rendered as `<tool_call>{...}`;
Qwen3 drops old reasoning), and text re-tokenised need not give the sampled ids. So when a new
request's messages start with the messages of a recorded call of the same episode followed by
the assistant reply the proxy returned for it (compared as messages: role, text, tool calls), its
prompt is that call's prompt + completion token ids, as recorded, plus the template's tokens for
the messages after the reply (`ChatFormat.continuation`). Such calls extend each other token for
token and form one family in the prefix tree; a request that matches no recorded reply is
rendered afresh (counted in `history_mismatches`).

Sampling semantics: `temperature` must be the trainer's (the one its loss recomputes log-probs
at) or unset; `max_tokens` / `max_completion_tokens` are capped at the rollout's budget; `stop`
strings must each be one token; `n` samples are recorded as sibling calls. Nothing constrains
decoding (a grammar would make the sampling distribution differ from the policy the trainer
trains): `tool_choice="required"` is not enforced, and with a named `tool_choice` the reply is
read as that function's call: the parsed call if the model wrote one, else the reply text as its
arguments (vLLM's named tool choice also answers with the arguments alone). Streaming, penalties,
`logit_bias` and `response_format` are refused with HTTP 400.

Requests are answered concurrently; the `BatchingSampler` gathers the requests in flight into one
engine call (the embedded engine samples them as one batch), behind a lock.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from treerl.rollout.chat import ChatFormat, Message, Tool
from treerl.rollout.inference import Completion, InferenceEngine, SamplingParams
from treerl.rollout.tool_parsers import ToolCall, get_tool_parser


# ---------------------------------------------------------------------------------------------- records
@dataclass
class RecordedCall:
    """One sampled reply of one call, as the trainer will see it."""

    index: int  # order in the episode (the n choices of one request get consecutive indices)
    messages: list[Message]  # the request's conversation, normalised
    tools: list[Tool] | None
    prompt: list[int]  # the exact token ids the model was conditioned on
    completion: Completion  # the sampled token ids, their behaviour log-probs and policy versions
    reply: Message  # the assistant message returned for this choice, normalised
    parent: int | None  # the recorded call whose prompt + completion this prompt extends (None: rendered afresh)


@dataclass
class EpisodeLog:
    """The calls of one open episode."""

    id: str
    calls: list[RecordedCall] = field(default_factory=list)
    history_mismatches: int = 0  # requests holding an assistant turn the proxy never returned (rendered afresh)
    max_calls: int | None = None
    over_context: str | None = None  # why a request was refused for rollout.max_context_tokens (the episode is dropped)


class CallRecorder:
    """Episodes by id: opened before the agent runs, closed (and handed over) when it returns."""

    def __init__(self) -> None:
        self._open: dict[str, EpisodeLog] = {}
        self._lock = threading.Lock()

    def open(self, episode_id: str, max_calls: int | None = None) -> EpisodeLog:
        with self._lock:
            if episode_id in self._open:
                raise ValueError(f"episode {episode_id!r} is already open")
            log = self._open[episode_id] = EpisodeLog(episode_id, max_calls=max_calls)
            return log

    def get(self, episode_id: str) -> EpisodeLog:
        with self._lock:
            if episode_id not in self._open:
                raise HTTPException(404, f"no open episode {episode_id!r} (calls are recorded only while the "
                                         "episode runs)")
            return self._open[episode_id]

    def close(self, episode_id: str) -> EpisodeLog:
        with self._lock:
            return self._open.pop(episode_id)

    @property
    def open_count(self) -> int:
        return len(self._open)


# ---------------------------------------------------------------------------------------------- messages
def normalise_message(message: dict[str, Any], where: str) -> Message:
    """An OpenAI message as the chat template expects it: text content, tool-call arguments as objects."""
    role = message.get("role")
    if role not in ("system", "developer", "user", "assistant", "tool"):
        raise HTTPException(400, f"{where}: unknown role {role!r}")
    content = message.get("content")
    if isinstance(content, list):  # content parts: only text is supported
        if any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
            raise HTTPException(400, f"{where}: only text content parts are supported")
        content = "".join(p.get("text", "") for p in content)
    if content is not None and not isinstance(content, str):
        raise HTTPException(400, f"{where}: content must be a string or a list of text parts")
    out: Message = {"role": "system" if role == "developer" else role, "content": content or ""}
    if message.get("tool_calls"):
        calls = []
        for call in message["tool_calls"]:
            function = call.get("function") or {}
            if not isinstance(function.get("name"), str):
                raise HTTPException(400, f"{where}: a tool call without a function name")
            calls.append({"id": call.get("id"), "type": "function",
                          "function": {"name": function["name"], "arguments": _arguments(function.get("arguments"))}})
        out["tool_calls"] = calls
    for key in ("tool_call_id", "name"):
        if message.get(key) is not None:
            out[key] = message[key]
    return out


def _arguments(arguments: Any) -> Any:
    """Tool-call arguments as an object for the template (a JSON string is parsed; anything else kept)."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return {} if arguments is None else arguments


def same_turn(a: Message, b: Message) -> bool:
    """Two messages say the same thing (tool-call ids aside)."""
    def key(m: Message) -> tuple:
        calls = [(c["function"]["name"], json.dumps(c["function"]["arguments"], sort_keys=True))
                 for c in m.get("tool_calls", [])]
        return m["role"], m["content"], calls, m.get("tool_call_id"), m.get("name")

    return key(a) == key(b)


# ---------------------------------------------------------------------------------------------- sampling
@dataclass
class _Pending:
    prompt: list[int]
    params: SamplingParams
    future: Future


class BatchingSampler:
    """Collects concurrent requests and samples them in as few engine calls as possible, one at a time.

    A batch starts when as many requests wait as there are open episodes (every agent is waiting
    for the model), or when no new request came for `gather_seconds`.
    """

    def __init__(self, engine: InferenceEngine, expected: Any = lambda: 1, gather_seconds: float = 0.02,
                 max_rows: int = 256):
        self.engine = engine
        self.expected = expected
        self.gather_seconds = gather_seconds
        self.max_rows = max_rows
        self.seed: int | None = None  # set per rollout step; each batch gets the next seed
        self.lock = threading.Lock()  # held while the engine samples (the trainer may hold it too)
        self._queue: list[_Pending] = []
        self._arrived = threading.Condition()
        self._last_arrival = 0.0
        self._batches = 0
        self._thread = threading.Thread(target=self._loop, name="treerl-proxy-sampler", daemon=True)
        self._thread.start()

    def submit(self, prompt: list[int], params: SamplingParams) -> Future:
        """A future of the `params.n` completions of `prompt`."""
        pending = _Pending(prompt, params, Future())
        with self._arrived:
            self._queue.append(pending)
            self._last_arrival = time.monotonic()
            self._arrived.notify()
        return pending.future

    def _loop(self) -> None:
        while True:
            with self._arrived:
                while not self._queue:
                    self._arrived.wait()
                while (len(self._queue) < max(1, self.expected())
                       and time.monotonic() - self._last_arrival < self.gather_seconds
                       and sum(p.params.n for p in self._queue) < self.max_rows):
                    self._arrived.wait(self.gather_seconds / 4)
                batch, self._queue = self._queue, []
            self._sample(batch)

    def _sample(self, batch: list[_Pending]) -> None:
        """Requests with the same prompt and settings become one prompt with their samples added up (prefilled
        once); one engine call per setting and sample count; errors go to the requests' futures."""
        same: dict[tuple, list[_Pending]] = {}
        for pending in batch:
            same.setdefault((tuple(pending.prompt), replace(pending.params, n=1, seed=None)), []).append(pending)
        calls: dict[SamplingParams, list[list[_Pending]]] = {}
        for (_, params), members in same.items():
            calls.setdefault(replace(params, n=sum(m.params.n for m in members)), []).append(members)
        for params, prompts in calls.items():
            self._batches += 1
            seed = None if self.seed is None else self.seed + self._batches
            try:
                with self.lock:
                    results = self.engine.generate([members[0].prompt for members in prompts], replace(params, seed=seed))
            except Exception as e:  # handed to each waiting request, which answers with an error
                for members in prompts:
                    for m in members:
                        m.future.set_exception(e)
                continue
            for members, completions in zip(prompts, results):
                for m in members:
                    m.future.set_result(completions[: m.params.n])
                    completions = completions[m.params.n :]


# ---------------------------------------------------------------------------------------------- the API
class ChatRequest(BaseModel):
    """The fields of an OpenAI chat-completions request the proxy reads (others are ignored)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
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
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    return_token_ids: bool = False  # vLLM's extension: prompt_token_ids and each choice's token_ids


@dataclass
class ChatProxy:
    """The proxy: sampling settings of the rollout, the engine, and the recorder of open episodes."""

    engine: InferenceEngine
    chat: ChatFormat
    tool_parser: str = "hermes"
    temperature: float = 1.0  # the trainer's: requests must use it (or leave it unset)
    top_p: float = 1.0  # default for requests that do not set it
    max_new_tokens: int = 256  # cap of max_tokens / max_completion_tokens (and the default)
    max_context_tokens: int = 4096  # prompt + max_new_tokens must fit
    model_name: str = "policy"

    def __post_init__(self) -> None:
        self.parse = get_tool_parser(self.tool_parser)
        self.recorder = CallRecorder()
        self.sampler = BatchingSampler(self.engine, expected=lambda: self.recorder.open_count)
        self.app = build_proxy_app(self)
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self.url = ""

    # ------------------------------------------------------------------ server lifetime
    def start(self) -> str:
        """Serve on a free loopback port in a background thread (once); returns the base URL."""
        if self._server is not None:
            return self.url
        import uvicorn

        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        config = uvicorn.Config(self.app, log_level="warning", lifespan="off", timeout_keep_alive=30)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        name="treerl-proxy", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the agent proxy did not start")
            time.sleep(0.01)
        return self.url

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(timeout=10)  # type: ignore[union-attr]
            self._server = None

    def episode_url(self, episode_id: str) -> str:
        """The base_url an agent's OpenAI client uses for this episode."""
        return f"{self.url}/episodes/{episode_id}/v1"

    # ------------------------------------------------------------------ one request
    def prepare(self, request: ChatRequest, log: EpisodeLog | None) -> tuple[list[Message], list[int], int | None,
                                                                           SamplingParams]:
        """Check the request; its normalised messages, prompt token ids, parent call, sampling parameters."""
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(request, name):
                raise HTTPException(400, f"'{name}' is not supported: it would change the sampled policy")
        if request.stream:
            raise HTTPException(400, "streaming is not supported by the treerl proxy")
        if request.logit_bias:
            raise HTTPException(400, "'logit_bias' is not supported: it would change the sampled policy")
        if request.response_format and request.response_format.get("type", "text") != "text":
            raise HTTPException(400, "'response_format' is not supported (no constrained decoding)")
        if request.top_logprobs:
            raise HTTPException(400, "'top_logprobs' is not supported (only the sampled tokens' log-probs)")
        if request.temperature is not None and abs(request.temperature - self.temperature) > 1e-9:
            raise HTTPException(400, f"temperature {request.temperature} differs from the trainer's "
                                     f"{self.temperature} (rollout.temperature); leave it unset")
        if log is not None and log.max_calls is not None and len(log.calls) >= log.max_calls:
            raise HTTPException(400, f"episode {log.id!r} made {len(log.calls)} model calls, the limit "
                                     "(rollout.max_turns)")
        messages = [normalise_message(m, f"messages[{i}]") for i, m in enumerate(request.messages)]
        prompt, parent = self._prompt(messages, request.tools, log)
        budget = min(request.max_completion_tokens or request.max_tokens or self.max_new_tokens, self.max_new_tokens)
        if len(prompt) + budget > self.max_context_tokens:
            refused = (f"the prompt has {len(prompt)} tokens; with max_tokens {budget} it exceeds "
                       f"rollout.max_context_tokens={self.max_context_tokens}")
            if log is not None:
                log.over_context = log.over_context or refused
            raise HTTPException(400, refused)
        params = SamplingParams(n=request.n, max_new_tokens=budget, temperature=self.temperature,
                                top_p=request.top_p if request.top_p is not None else self.top_p,
                                stop_token_ids=tuple(self.chat.stop_token_ids + self._stop_ids(request.stop)),
                                seed=request.seed)
        return messages, prompt, parent, params

    def _prompt(self, messages: list[Message], tools: list[Tool] | None,
                log: EpisodeLog | None) -> tuple[list[int], int | None]:
        """Token-in/token-out: extend the recorded call whose conversation + reply this request continues."""
        best: RecordedCall | None = None
        if log is not None:
            for call in log.calls:
                k = len(call.messages)
                if (len(messages) > k and call.tools == tools and (best is None or k > len(best.messages))
                        and all(same_turn(a, b) for a, b in zip(messages[:k], call.messages))
                        and same_turn(messages[k], call.reply)):
                    best = call
        if best is None:
            if log is not None and any(m["role"] == "assistant" for m in messages):
                log.history_mismatches += 1
            return self.chat.prompt(messages, tools), None
        rest = messages[len(best.messages) + 1 :]
        stopped = best.completion.finish_reason == "stop"
        continuation = self.chat.continuation(rest, reply_stopped=stopped, tools=tools)
        return best.prompt + best.completion.tokens + continuation, best.index

    def _stop_ids(self, stop: str | list[str] | None) -> list[int]:
        """Stop strings as token ids (each must be one token of the tokenizer)."""
        ids = []
        for text in [stop] if isinstance(stop, str) else stop or []:
            encoded = self.chat.tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(encoded) != 1:
                raise HTTPException(400, f"stop string {text!r} is {len(encoded)} tokens; only single-token stop "
                                         "strings are supported")
            ids.append(encoded[0])
        return ids

    def reply(self, completion: Completion, tool_choice: str | dict | None, has_tools: bool) -> tuple[Message, str]:
        """The assistant message of one sampled completion (tool calls parsed), and its finish reason."""
        text = self.chat.reply_text(completion.tokens)
        calls: list[ToolCall] = []
        content = text
        named = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
        if has_tools and tool_choice != "none":
            content, calls = self.parse(text)
            if named is not None:  # the reply is that function's call: the one written, or the text as arguments
                chosen = [c for c in calls if c.name == named]
                calls, content = [chosen[0] if chosen else ToolCall(named, text.strip())], ""
        message: Message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [
                {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                 "function": {"name": c.name, "arguments": _arguments(c.arguments)}} for c in calls]
        if completion.finish_reason == "length":
            finish = "length"
        else:
            finish = "tool_calls" if calls and named is None else "stop"
        return message, finish


def _wire_message(message: Message) -> dict[str, Any]:
    """A normalised assistant message in OpenAI's response shape (arguments as JSON strings)."""
    out: dict[str, Any] = {"role": "assistant", "content": message["content"] or None}
    if message.get("tool_calls"):
        out["tool_calls"] = [
            {"id": c["id"], "type": "function",
             "function": {"name": c["function"]["name"], "arguments": _json_string(c["function"]["arguments"])}}
            for c in message["tool_calls"]]
    return out


def _json_string(arguments: Any) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments)


def build_proxy_app(proxy: ChatProxy) -> FastAPI:
    """`/v1/chat/completions` and `/v1/models`, recorded under `/episodes/{id}/v1/...`, unrecorded at `/v1/...`."""
    app = FastAPI(title="treerl agent proxy")

    @app.exception_handler(HTTPException)
    def openai_error(_: Request, exc: HTTPException) -> JSONResponse:
        return JSONResponse(status_code=exc.status_code,
                            content={"error": {"message": str(exc.detail), "type": "invalid_request_error",
                                               "code": exc.status_code}})

    def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": proxy.model_name, "object": "model", "owned_by": "treerl"}]}

    async def complete(request: ChatRequest, episode_id: str | None) -> dict[str, Any]:
        log = proxy.recorder.get(episode_id) if episode_id is not None else None
        messages, prompt, parent, params = proxy.prepare(request, log)
        try:
            completions: list[Completion] = await asyncio.wrap_future(proxy.sampler.submit(prompt, params))
        except ValueError as e:
            raise HTTPException(400, str(e)) from None
        choices = []
        for i, completion in enumerate(completions):
            reply, finish = proxy.reply(completion, request.tool_choice, bool(request.tools))
            if log is not None:
                log.calls.append(RecordedCall(len(log.calls), messages, request.tools, prompt, completion, reply,
                                              parent))
            choice: dict[str, Any] = {"index": i, "message": _wire_message(reply), "finish_reason": finish,
                                      "logprobs": None}
            if request.logprobs:
                tokens = proxy.chat.tokenizer.convert_ids_to_tokens(completion.tokens)
                choice["logprobs"] = {"content": [{"token": t, "logprob": lp, "bytes": None, "top_logprobs": []}
                                                  for t, lp in zip(tokens, completion.logprobs)]}
            if request.return_token_ids:
                choice["token_ids"] = completion.tokens
            choices.append(choice)
        generated = sum(len(c.tokens) for c in completions)
        response = {
            "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": request.model or proxy.model_name, "choices": choices,
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": generated,
                      "total_tokens": len(prompt) + generated},
        }
        if request.return_token_ids:
            response["prompt_token_ids"] = prompt
        return response

    @app.post("/episodes/{episode_id}/v1/chat/completions")
    async def episode_chat(episode_id: str, request: ChatRequest) -> dict[str, Any]:
        return await complete(request, episode_id)

    @app.post("/v1/chat/completions")
    async def chat(request: ChatRequest) -> dict[str, Any]:
        return await complete(request, None)

    app.get("/episodes/{episode_id}/v1/models")(lambda episode_id: models())
    app.get("/v1/models")(models)
    app.get("/health")(lambda: {"status": "ok"})
    return app
