"""An OpenAI-compatible proxy that records every model call of an agent at token level.

Steps 1 and 2 (docs/architecture.md): an agent's model calls, sampled and recorded token for token.

An agent written with the OpenAI SDK talks to `{proxy.url}/episodes/<id>/v1` (one id per
episode). The proxy serves

    POST /v1/chat/completions   chat completions, `stream` or not   (`treerl.rollout.agents.chat_api`)
    POST /v1/responses          the Responses API, `stream` or not  (`treerl.rollout.agents.responses_api`)
    GET  /v1/models             the one model, `policy`

and answers any other path with HTTP 404 and a JSON body naming these. A request is rendered with
the model's own chat template (tools included), sampled with the rollout's sampler (the embedded
one, or a vLLM / SGLang / `treerl serve` server through `CompletionsClient`), and its tool calls are
parsed with the model family's parser (`treerl.rollout.agents.tool_parsers`). Each call is recorded:
prompt token ids, completion token ids, behaviour log-probs and policy versions, the same whichever
API or wire format asked for it.

Token-in / token-out. A chat template may render an earlier turn differently from how it was
sampled (a tool call the model wrote as bare arguments is re-rendered as `<tool_call>{...}`;
Qwen3 drops old reasoning), and text re-tokenised need not give the sampled ids. So when a new
request's messages start with the messages of a recorded call of the same episode followed by
the assistant reply the proxy returned for it (compared as messages: role, text, tool calls), its
prompt is that call's prompt + completion token ids, as recorded, plus the template's tokens for
the messages after the reply (`ChatFormat.continuation`). Such calls extend each other token for
token and form one family in the prefix tree.

A cut history. A request that holds earlier replies but extends no recorded call (the agent
truncated or summarised its history, or edited a reply) is rendered afresh: a new subtree, whose
later calls extend it as usual. It is counted (`history_mismatches`), it `follows` the call before
the cut (the latest call whose reply it still holds, else the episode's latest call), and the
tokens of that call it no longer shares are counted too (`sharing_lost_tokens`, beside
`shared_tokens`, the tokens that extending calls reuse), so a run's metrics say how much sharing
the cuts cost.

Sampling semantics: `temperature` must be the trainer's (the one its loss recomputes log-probs
at) or unset, and so must `top_p` (the rollout's cut: rollout.top_p, top_k and min_p hold for
every call, so the loss knows how each token was drawn); `max_tokens` / `max_completion_tokens` / `max_output_tokens` are capped at the
rollout's budget; `stop` strings must each be one token; `n` samples are recorded as sibling
calls. Nothing constrains decoding (a grammar would make the sampling distribution differ from
the policy the trainer trains), so tool choices are enforced on what the model wrote:
- `tool_choice="required"`: a reply without a tool call is not returned: the request fails with
  HTTP 422 (`tool_call_required`) and that sample is not recorded (it is counted in
  `tool_choice_failures`), so the agent never sees a reply that breaks the contract; an agent may
  catch the error and retry or end the episode with a low reward.
- a named `tool_choice`: the reply is read as that function's call: the parsed call if the model
  wrote one, else the reply text as its arguments (vLLM's named tool choice also answers with the
  arguments alone).
- `parallel_tool_calls=false`: at most one tool call per reply. A reply with more is cut after
  its first call, and the recorded completion is cut there too (its later tokens are neither
  returned nor trained; the turn is closed with a stop token that is not trained), so the next
  call's context holds exactly the call the agent ran.
- `tool_choice="none"`: the reply is all content.
- no parser (`rollout.tool_parser` resolves to `none`): no reply can hold a tool call, so a request
  with `tools` and a required or named tool choice is refused with HTTP 400 (`no_tool_parser`),
  naming `rollout.tool_parser` and its values, before anything is sampled.
- a chat template that does not write tools into the prompt (SmolLM2's: the same prompt with and without them):
  any request offering tools, unless `tool_choice="none"`, is refused with HTTP 400 (`template_without_tools`):
  the model would never see the tools it is asked to call.
Penalties, `logit_bias`, constrained output formats and `top_logprobs` are refused with HTTP 400.

Images (a vision-language policy): a user or tool message may show `image_url` parts (base64 data URLs; the
Responses API's `input_image`). Each recorded call keeps the images its prompt shows (`treerl.rollout.conversations.images`); a
call that extends another keeps that call's images where they were and places the new ones after them, so an
episode's screenshots are shared down its tree.

Requests are answered concurrently; the `RequestBatcher` gathers the requests in flight into one
sampler call (the embedded sampler samples them as one batch), behind a lock.
"""

from __future__ import annotations

import asyncio
import bisect
import socket
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, StreamingResponse

from treerl.errors import ServerError, UserError
from treerl.rollout.agents.chat_api import (
    Answer,
    ChatRequest,
    ModelRequest,
    chat_chunks,
    chat_response,
    same_turn,
    tool_call,
)
from treerl.rollout.agents.responses_api import ResponsesRequest, continued, response_events, response_object
from treerl.rollout.agents.tool_parsers import TOOL_PARSERS, ToolCall, no_parser_hint, resolve_tool_parser
from treerl.rollout.conversations.chat import ChatFormat, Message, Tool
from treerl.rollout.sampling.sampler import Completion, Sampler, SamplingParams, images_kwarg
from treerl.rollout.tasks.base import rng_for
from treerl.tree import ImageSpan

ENDPOINTS = "POST /v1/chat/completions (stream or not), POST /v1/responses (stream or not), GET /v1/models"


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
    follows: int | None = None  # the call this one continues: `parent`, or the call before a cut history
    response_id: str = ""  # the id of the response that returned it (per-turn rewards name it)
    instructions: str | None = None  # the Responses API's instructions (not carried over by previous_response_id)
    images: tuple[ImageSpan, ...] = ()  # the images the prompt shows (an agent's screenshots), over its placeholders


@dataclass
class Context:
    """A request's prompt token ids and where they come from."""

    tokens: list[int]
    parent: int | None = None  # the recorded call these tokens extend
    follows: int | None = None  # the call the request continues (`parent`, or the call before a cut)
    shared: int = 0  # tokens reused from `parent`
    lost: int = 0  # tokens of `follows` the prompt no longer shares (a cut history)
    images: tuple[ImageSpan, ...] = ()  # the images the tokens show


@dataclass
class EpisodeLog:
    """The calls of one open episode."""

    id: str
    calls: list[RecordedCall] = field(default_factory=list)
    history_mismatches: int = 0  # requests holding earlier replies that extend no recorded call (rendered afresh)
    shared_tokens: int = 0  # prompt tokens reused from the calls they extend
    sharing_lost_tokens: int = 0  # tokens of the call before a cut that the call after it no longer shares
    tool_choice_failures: int = 0  # samples not returned: tool_choice="required" and no tool call written
    max_calls: int | None = None
    over_context: str | None = None  # why a request was refused for rollout.max_context_tokens (the episode is dropped)

    def response(self, response_id: str) -> RecordedCall:
        """The recorded call that answered `response_id` (its first choice)."""
        for call in self.calls:
            if call.response_id == response_id:
                return call
        raise HTTPException(400, f"previous_response_id {response_id!r} is not a response of episode {self.id!r}")


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


# ---------------------------------------------------------------------------------------------- sampling
@dataclass
class _Pending:
    prompt: list[int]
    params: SamplingParams
    future: Future
    images: tuple[ImageSpan, ...] = ()


class RequestBatcher:
    """Collects concurrent requests and samples them in as few sampler calls as possible, one at a time.

    A batch starts when as many requests wait as there are open episodes (every agent is waiting
    for the model), or when no new request came for `gather_seconds`.
    """

    def __init__(self, sampler: Sampler, expected: Any = lambda: 1, gather_seconds: float = 0.02,
                 max_rows: int = 256):
        self.sampler = sampler
        self.expected = expected
        self.gather_seconds = gather_seconds
        self.max_rows = max_rows
        self.seed: int | None = None  # set per rollout step; each batch gets the next seed
        self.server_error: ServerError | None = None  # an inference server's failure: the step stops with it
        self.lock = threading.Lock()  # held while the sampler samples (the trainer may hold it too)
        self._queue: list[_Pending] = []
        self._arrived = threading.Condition()
        self._last_arrival = 0.0
        self._batches = 0
        self._thread = threading.Thread(target=self._loop, name="treerl-proxy-sampler", daemon=True)
        self._thread.start()

    def submit(self, prompt: list[int], params: SamplingParams, images: tuple[ImageSpan, ...] = ()) -> Future:
        """A future of the `params.n` completions of `prompt` (which shows `images`)."""
        pending = _Pending(prompt, params, Future(), images)
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
        once); one sampler call per setting and sample count; errors go to the requests' futures."""
        same: dict[tuple, list[_Pending]] = {}
        for pending in batch:
            shown = tuple((image.start, image.digest) for image in pending.images)
            same.setdefault((tuple(pending.prompt), shown, replace(pending.params, n=1, seed=None)), []).append(pending)
        calls: dict[SamplingParams, list[list[_Pending]]] = {}
        for (_, _, params), members in same.items():
            calls.setdefault(replace(params, n=sum(m.params.n for m in members)), []).append(members)
        for params, prompts in calls.items():
            self._batches += 1
            seed = None if self.seed is None else rng_for("batch", self.seed, self._batches).getrandbits(62)
            try:
                with self.lock:
                    results = self.sampler.generate([members[0].prompt for members in prompts],
                                                    replace(params, seed=seed),
                                                    **images_kwarg([members[0].images for members in prompts]))
            except Exception as e:  # handed to each waiting request, which answers with an error
                if isinstance(e, ServerError):  # not the agent's fault: the workflow raises it after the episodes
                    self.server_error = self.server_error or e
                for members in prompts:
                    for m in members:
                        m.future.set_exception(e)
                continue
            for members, completions in zip(prompts, results):
                for m in members:
                    m.future.set_result(completions[: m.params.n])
                    completions = completions[m.params.n :]


# ---------------------------------------------------------------------------------------------- the proxy
class ToolCallRequired(HTTPException):
    """HTTP 422: tool_choice="required" and a sampled reply holds no tool call."""

    code = "tool_call_required"


class NoToolParser(HTTPException):
    """HTTP 400: the request needs a tool call, and the parser is `none`: no reply could ever hold one."""

    code = "no_tool_parser"


class TemplateWithoutTools(HTTPException):
    """HTTP 400: the request offers tools, and the chat template writes no tools into the prompt: the model would
    never see them."""

    code = "template_without_tools"


@dataclass
class ChatProxy:
    """The proxy: sampling settings of the rollout, its sampler, and the recorder of open episodes."""

    sampler: Sampler
    chat: ChatFormat
    tool_parser: str = "auto"  # a name of treerl.rollout.agents.tool_parsers; auto: the chat template's format
    temperature: float = 1.0  # the trainer's: requests must use it (or leave it unset)
    top_p: float = 1.0  # the rollout's: requests must use it (or leave it unset)
    top_k: int = 0  # the rollout's, for every request
    min_p: float = 0.0  # the rollout's, for every request
    max_new_tokens: int = 256  # cap of max_tokens / max_completion_tokens (and the default)
    max_context_tokens: int = 4096  # prompt + max_new_tokens must fit
    model_name: str = "policy"

    def __post_init__(self) -> None:
        self.parser_name = resolve_tool_parser(self.tool_parser, self.chat.tokenizer.chat_template)
        self.parse = TOOL_PARSERS[self.parser_name]
        self.recorder = CallRecorder()
        self.batcher = RequestBatcher(self.sampler, expected=lambda: self.recorder.open_count)
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

    # ------------------------------------------------------------------ the two APIs
    async def chat_completions(self, request: ChatRequest, episode_id: str | None) -> Any:
        """A chat completions request, recorded under `episode_id` (None: not recorded); streamed if it asks."""
        log = self.recorder.get(episode_id) if episode_id is not None else None
        response_id = f"chatcmpl-{uuid.uuid4().hex}"
        prompt, answers = await self.answer(request.model_request(), log, response_id)
        response = chat_response(request, response_id, request.model or self.model_name, prompt, answers,
                                 self.token_strings)
        if request.stream:
            return StreamingResponse(chat_chunks(response, request), media_type="text/event-stream")
        return response

    async def responses(self, request: ResponsesRequest, episode_id: str | None) -> Any:
        """A Responses API request, recorded under `episode_id` (None: not recorded; `previous_response_id` then
        refused: only a recorded episode remembers its responses); streamed if it asks."""
        log = self.recorder.get(episode_id) if episode_id is not None else None
        previous: list[Message] = []
        if request.previous_response_id is not None:
            if log is None:
                raise HTTPException(400, "previous_response_id is served only for recorded episodes "
                                         "(/episodes/<id>/v1/responses)")
            before = log.response(request.previous_response_id)
            previous = continued(before.messages, before.instructions, before.reply)
        response_id = f"resp_{uuid.uuid4().hex}"
        prompt, [answer] = await self.answer(request.model_request(previous), log, response_id, request.instructions)
        response = response_object(request, response_id, request.model or self.model_name, prompt, answer,
                                   self.token_strings)
        if request.stream:
            return StreamingResponse(response_events(response), media_type="text/event-stream")
        return response

    # ------------------------------------------------------------------ one request
    async def answer(self, request: ModelRequest, log: EpisodeLog | None, response_id: str,
                     instructions: str | None = None) -> tuple[list[int], list[Answer]]:
        """Sample the request's replies, enforce its tool choice, record them; the prompt and the answers."""
        context, params = self.prepare(request, log)
        try:
            completions: list[Completion] = await asyncio.wrap_future(
                self.batcher.submit(context.tokens, params, context.images))
        except ValueError as e:
            raise HTTPException(400, str(e)) from None
        answers = [self.reply(completion, request) for completion in completions]
        missing = sum(not a.reply.get("tool_calls") for a in answers) if request.tool_choice == "required" else 0
        if missing:
            if log is not None:
                log.tool_choice_failures += missing
            raise ToolCallRequired(422, "tool_choice='required' but the model wrote no tool call (treerl does not "
                                        "constrain decoding; the sample is not recorded): retry, or end the episode")
        if log is not None:
            log.shared_tokens += context.shared * len(answers)
            log.sharing_lost_tokens += context.lost * len(answers)
            for answer in answers:
                log.calls.append(RecordedCall(len(log.calls), request.messages, request.tools, context.tokens,
                                              answer.completion, answer.reply, context.parent, context.follows,
                                              response_id, instructions, context.images))
        return context.tokens, answers

    def prepare(self, request: ModelRequest, log: EpisodeLog | None) -> tuple[Context, SamplingParams]:
        """Check the request; its prompt (and where it comes from) and sampling parameters."""
        if request.temperature is not None and abs(request.temperature - self.temperature) > 1e-9:
            raise HTTPException(400, f"temperature {request.temperature} differs from the trainer's "
                                     f"{self.temperature} (rollout.temperature); leave it unset")
        if request.top_p is not None and abs(request.top_p - self.top_p) > 1e-9:
            raise HTTPException(400, f"top_p {request.top_p} differs from the rollout's {self.top_p} (rollout.top_p); "
                                     "leave it unset")
        if request.tools and request.tool_choice != "none" and not self.chat.shows_tools:
            raise TemplateWithoutTools(400, "the request offers tools, but the policy's chat template does not write "
                                            "tools into the prompt (it renders the same with and without them), so the "
                                            "model would never see them: give the policy a template that shows tools "
                                            "(model.tokenizer_path), or send no tools")
        if request.tools and request.tool_choice in ("required", "function") and self.parser_name == "none":
            raise NoToolParser(400, f"tool_choice {request.tool_choice!r} needs a tool call, but "
                                    f"{no_parser_hint(self.tool_parser)}")
        if log is not None and log.max_calls is not None and len(log.calls) >= log.max_calls:
            raise HTTPException(400, f"episode {log.id!r} made {len(log.calls)} model calls, the limit "
                                     "(rollout.max_turns)")
        try:
            context = self._context(request.messages, request.tools, log)
        except UserError as e:  # an image that cannot be read, or a model that takes none
            raise HTTPException(400, str(e)) from None
        budget = min(request.max_tokens or self.max_new_tokens, self.max_new_tokens)
        if len(context.tokens) + budget > self.max_context_tokens:
            refused = (f"the prompt has {len(context.tokens)} tokens; with max_tokens {budget} it exceeds "
                       f"rollout.max_context_tokens={self.max_context_tokens}")
            if log is not None:
                log.over_context = log.over_context or refused
            raise HTTPException(400, refused)
        params = SamplingParams(n=request.n, max_new_tokens=budget, temperature=self.temperature, top_p=self.top_p,
                                top_k=self.top_k, min_p=self.min_p,
                                stop_token_ids=tuple(self.chat.stop_token_ids + self._stop_ids(request.stop)),
                                seed=request.seed)
        return context, params

    def _context(self, messages: list[Message], tools: list[Tool] | None, log: EpisodeLog | None) -> Context:
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
            return self._cut(messages, tools, log)
        rest = messages[len(best.messages) + 1 :]
        stopped = best.completion.finish_reason == "stop"
        extended = best.prompt + best.completion.tokens
        continuation, images = self.chat.continuation_with_images(rest, reply_stopped=stopped, tools=tools,
                                                                  offset=len(extended))
        return Context(extended + continuation, best.index, best.index, shared=len(extended),
                       images=best.images + images)

    def _cut(self, messages: list[Message], tools: list[Tool] | None, log: EpisodeLog | None) -> Context:
        """A request rendered afresh; if it holds earlier replies, the call before the cut and the sharing lost."""
        tokens, images = self.chat.prompt_with_images(messages, tools)
        replies = [m for m in messages if m["role"] == "assistant"]
        if log is None or not replies:
            return Context(tokens, images=images)
        log.history_mismatches += 1
        if not log.calls:  # replies the proxy never returned (few-shot examples): nothing was shared to lose
            return Context(tokens, images=images)
        held = [call for call in log.calls if any(same_turn(m, call.reply) for m in replies)]
        before = (held or log.calls)[-1]
        full = before.prompt + before.completion.tokens
        return Context(tokens, None, before.index, lost=len(full) - common_prefix(full, tokens), images=images)

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

    def reply(self, completion: Completion, request: ModelRequest) -> Answer:
        """The answer of one sampled completion: tool calls parsed, the named or single-call choice applied."""
        text = self.chat.reply_text(completion.tokens)
        calls: list[ToolCall] = []
        content = text
        if request.tools and request.tool_choice != "none":
            content, calls = self.parse(text, request.tools)
            if request.tool_choice == "function":  # that function's call: the one written, or the text as arguments
                chosen = [c for c in calls if c.name == request.tool_name]
                calls, content = [chosen[0] if chosen else ToolCall(str(request.tool_name), text.strip())], ""
            elif len(calls) > 1 and not request.parallel_tool_calls:
                completion = self._cut_after(completion, calls[0].end)
                content, calls = self.parse(self.chat.reply_text(completion.tokens), request.tools)
        message: Message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [tool_call(f"call_{uuid.uuid4().hex[:24]}", c.name, c.arguments) for c in calls]
        if completion.finish_reason == "length":
            finish = "length"
        else:
            finish = "tool_calls" if calls and request.tool_choice != "function" else "stop"
        return Answer(message, finish, completion)

    def _cut_after(self, completion: Completion, end: int) -> Completion:
        """The completion's shortest prefix whose text reaches offset `end` (a reply cut after its first call)."""
        def length(k: int) -> int:
            return len(self.chat.tokenizer.decode(completion.tokens[:k], skip_special_tokens=False))

        k = bisect.bisect_left(range(len(completion.tokens) + 1), end, key=length)
        routes = completion.routed_experts  # prompt and reply: the reply's rows after the cut go
        return Completion(completion.tokens[:k], completion.logprobs[:k], "cut", completion.versions[:k],
                          routed_experts=None if routes is None else routes[: len(routes) - len(completion.tokens) + k])

    def token_strings(self, token_ids: list[int]) -> list[str]:
        """Token ids as the tokenizer's token strings (OpenAI's `logprobs` shape)."""
        return self.chat.tokenizer.convert_ids_to_tokens(token_ids)


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two sequences share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# ---------------------------------------------------------------------------------------------- the app
def build_proxy_app(proxy: ChatProxy) -> FastAPI:
    """The endpoints of `ENDPOINTS`, recorded under `/episodes/{id}/v1/...`, unrecorded at `/v1/...`."""
    app = FastAPI(title="treerl agent proxy")

    @app.exception_handler(HTTPException)
    def openai_error(_: Request, exc: HTTPException) -> JSONResponse:
        code = getattr(exc, "code", exc.status_code)
        return JSONResponse(status_code=exc.status_code,
                            content={"error": {"message": str(exc.detail), "type": "invalid_request_error",
                                               "code": code}})

    def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": proxy.model_name, "object": "model", "owned_by": "treerl"}]}

    @app.post("/episodes/{episode_id}/v1/chat/completions")
    async def episode_chat(episode_id: str, request: ChatRequest) -> Any:
        return await proxy.chat_completions(request, episode_id)

    @app.post("/v1/chat/completions")
    async def plain_chat(request: ChatRequest) -> Any:
        return await proxy.chat_completions(request, None)

    @app.post("/episodes/{episode_id}/v1/responses")
    async def episode_responses(episode_id: str, request: ResponsesRequest) -> Any:
        return await proxy.responses(request, episode_id)

    @app.post("/v1/responses")
    async def plain_responses(request: ResponsesRequest) -> Any:
        return await proxy.responses(request, None)

    app.get("/episodes/{episode_id}/v1/models")(lambda episode_id: models())
    app.get("/v1/models")(models)
    app.get("/health")(lambda: {"status": "ok"})

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
    def not_served(path: str) -> None:
        raise HTTPException(404, f"/{path} is not served by the treerl proxy; it serves {ENDPOINTS}")

    return app
