"""`treerl serve`: the embedded sampler behind an OpenAI-compatible completions API (FastAPI + uvicorn).

Beside the steps (docs/architecture.md): step 1's sampling served to other processes.

`transformers serve` cannot be used for RL: its /v1/completions ignores `logprobs`. This server
answers the subset of vLLM's / SGLang's API that `CompletionsClient` uses, with the same shapes:

- `POST /v1/completions`: `prompt` (token ids, a list of them, or text), `n`, `max_tokens`,
  `temperature`, `top_p`, `logprobs`, `stop_token_ids`, `ignore_eos`, `seed`, `return_token_ids`,
  `return_tokens_as_token_ids`, `skip_special_tokens`. Each choice carries `token_ids`,
  `logprobs.token_logprobs` (log_softmax(logits / T) of the sampled token, see
  `treerl.rollout.sampler`), `finish_reason` and `stop_reason`; `metadata.weight_version` is
  the policy version. `top_logprobs` holds only the sampled token (no top-k alternatives).
  Generation stops at the tokenizer's eos token unless `ignore_eos`, and at any `stop_token_ids`;
  the stop token is part of `token_ids`. Streaming and `echo` are refused.
- `POST /update_weights_from_disk` (as SGLang): `{"model_path": ..., "weight_version": ...}`;
  `GET /get_weight_version`, `GET /get_model_info` (as SGLang).
- vLLM's dev-mode reload routes (`add_weight_sync_routes`): `POST /pause`, `/resume`, `/collective_rpc`
  (`update_config` with `{"model_config": {"model": path}}`, then `reload_weights`),
  `/update_weight_version`, `GET /weight_info`.
- `GET /health`, `GET /v1/models`.

Requests are served one at a time (a lock around the model); a request's prompts and samples
are batched together by the sampler.

Limits (`Guard`): with an API key every endpoint but /health needs `Authorization: Bearer <key>`
(401 otherwise). `n`, `max_tokens` and the number of prompts have upper bounds, checked before
anything is allocated (400 naming the option that raises them). A generation stops, and frees the
model, when its client disconnects, when it runs past `request_timeout`, or when the server shuts
down (SIGTERM / Ctrl-C): the sampler looks between two decoding steps. A weight update reads and
checks every tensor (safetensors only: names, shapes, finite values) before one is copied in: it
succeeds whole or changes nothing.
"""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from treerl.errors import UserError
from treerl.models import first_nonfinite, read_weights, tied_names
from treerl.rollout.embedded import EmbeddedSampler, GenerationCancelled
from treerl.rollout.sampler import Completion, SamplingParams

POLL_SECONDS = 0.2  # how often a request looks whether its client is still there


class CompletionRequest(BaseModel):
    """The fields of an OpenAI / vLLM completions request that the server honours (others are ignored)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: list[int] | list[list[int]] | str | list[str]
    n: int = Field(1, ge=1)
    max_tokens: int = Field(16, ge=1)
    temperature: float = 1.0
    top_p: float = 1.0
    logprobs: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    echo: bool = False


class UpdateWeightsRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model_path: str
    weight_version: str | None = None


@dataclass
class Guard:
    """Who may call the server and how much one request may ask for."""

    api_key: str | None = None  # None: no authentication (loopback only; `treerl serve` enforces that)
    max_n: int = 64  # samples per prompt
    max_tokens: int = 4096  # tokens generated per sample
    max_prompts: int = 256  # prompts per request
    request_timeout: float = 600.0  # seconds a generation may run before it is stopped (504)
    shutting_down: threading.Event = field(default_factory=threading.Event)  # set on SIGTERM / Ctrl-C

    def authorize(self, request: Request) -> None:
        """A FastAPI dependency: the request's bearer token must be the key (compared in constant time)."""
        if self.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise HTTPException(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'")

    def check(self, request: CompletionRequest, prompts: list[list[int]], max_positions: int | None) -> None:
        """400 for a request over a limit, before anything is allocated."""
        for value, limit, name, option in ((request.n, self.max_n, "n", "--max-n"),
                                           (request.max_tokens, self.max_tokens, "max_tokens", "--max-tokens"),
                                           (len(prompts), self.max_prompts, "prompts", "--max-prompts")):
            if value > limit:
                raise HTTPException(400, f"{name}={value} is more than this server allows ({limit}; treerl serve "
                                         f"{option} raises it)")
        longest = max(len(p) for p in prompts)
        if max_positions is not None and longest + request.max_tokens > max_positions:
            raise HTTPException(400, f"a prompt of {longest} tokens plus max_tokens={request.max_tokens} is more than "
                                     f"the model's {max_positions} positions")


def build_app(sampler: EmbeddedSampler, tokenizer: PreTrainedTokenizerBase, model_name: str = "default",
              guard: Guard | None = None) -> FastAPI:
    """The FastAPI app serving `sampler` (its model) and `tokenizer` under the name `model_name`."""
    guard = guard or Guard()
    app = FastAPI(title="treerl serve")
    lock = threading.Lock()  # one generation or weight update at a time
    authorized = [Depends(guard.authorize)]
    app.exception_handler(HTTPException)(openai_error)
    app.get("/health")(lambda: {"status": "ok"})

    @app.get("/v1/models", dependencies=authorized)
    def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "treerl"}]}

    @app.post("/v1/completions", dependencies=authorized)
    async def completions(request: CompletionRequest, raw: Request) -> dict[str, Any]:
        if request.stream or request.echo:
            raise HTTPException(400, "treerl serve does not support 'stream' or 'echo'")
        prompts = _prompt_ids(request.prompt, tokenizer)
        guard.check(request, prompts, getattr(sampler.model.config, "max_position_embeddings", None))
        params = _sampling_params(request, tokenizer)
        cancel = threading.Event()
        work = asyncio.ensure_future(run_in_threadpool(_generate, sampler, lock, prompts, params, cancel))
        groups, version = await _finished(work, cancel, raw, guard)
        return _completions_response(request, prompts, groups, version, tokenizer, model_name)

    @app.post("/update_weights_from_disk", dependencies=authorized)
    def update_weights_from_disk(request: UpdateWeightsRequest) -> dict[str, Any]:
        return _load_weights(sampler, lock, request.model_path, request.weight_version)

    add_weight_sync_routes(app, sampler, lambda path: _load_weights(sampler, lock, path, None), dependencies=authorized)
    return app


def openai_error(_: Request, exc: HTTPException) -> JSONResponse:
    """Errors in the OpenAI shape, so every client prints the message."""
    return JSONResponse(
        status_code=exc.status_code,
        content={"error": {"message": str(exc.detail), "type": "invalid_request_error", "code": exc.status_code}},
    )


def _sampling_params(request: CompletionRequest, tokenizer: PreTrainedTokenizerBase) -> SamplingParams:
    """The request's sampling settings; it stops at the tokenizer's eos unless `ignore_eos` (400 if one is invalid)."""
    stop = set(request.stop_token_ids or [])
    if not request.ignore_eos and tokenizer.eos_token_id is not None:
        stop.add(tokenizer.eos_token_id)
    try:
        return SamplingParams(n=request.n, max_new_tokens=request.max_tokens, temperature=request.temperature,
                              top_p=request.top_p, stop_token_ids=tuple(sorted(stop)), seed=request.seed)
    except ValueError as e:
        raise HTTPException(400, str(e)) from None


def _generate(sampler: EmbeddedSampler, lock: threading.Lock, prompts: list[list[int]], params: SamplingParams,
              cancel: threading.Event) -> tuple[list[list[Completion]], int]:
    """In a worker thread: wait for the model (giving up if cancelled), generate, free it; the completions and the
    policy version that sampled them."""
    while not lock.acquire(timeout=POLL_SECONDS):
        if cancel.is_set():
            raise GenerationCancelled("cancelled while waiting for the model")
    try:
        return sampler.generate(prompts, params, cancelled=cancel.is_set), sampler.version
    finally:
        lock.release()


async def _finished(work: asyncio.Future, cancel: threading.Event, raw: Request,
                    guard: Guard) -> tuple[list[list[Completion]], int]:
    """Wait for a generation; cancel it (and answer 503, 504 or 499) when the server shuts down, the request runs
    past its deadline or the client leaves; 400 for a prompt the model refuses."""
    deadline = time.monotonic() + guard.request_timeout
    why = None
    while not work.done():
        await asyncio.wait({work}, timeout=POLL_SECONDS)
        if work.done():
            break
        if guard.shutting_down.is_set():
            why = (503, "the server is shutting down")
        elif time.monotonic() > deadline:
            why = (504, f"generation took longer than {guard.request_timeout:g} s (treerl serve --request-timeout)")
        elif await raw.is_disconnected():
            why = (499, "the client disconnected")
        if why is not None:
            cancel.set()
    try:
        return await work
    except GenerationCancelled:
        raise HTTPException(*(why or (503, "generation cancelled"))) from None
    except ValueError as e:
        raise HTTPException(400, str(e)) from None


def _completions_response(request: CompletionRequest, prompts: list[list[int]], groups: list[list[Completion]],
                          version: int, tokenizer: PreTrainedTokenizerBase, model_name: str) -> dict[str, Any]:
    """The completions response in vLLM's shape: a choice per sample, usage, and the policy version."""
    choices = [
        _choice(p * request.n + j, completion, prompt, request, tokenizer)
        for p, (prompt, group) in enumerate(zip(prompts, groups))
        for j, completion in enumerate(group)
    ]
    generated = sum(len(c.tokens) for group in groups for c in group)
    prompt_tokens = sum(len(p) for p in prompts)
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": choices,
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": generated,
                  "total_tokens": prompt_tokens + generated},
        "metadata": {"weight_version": str(version)},
    }


def _load_weights(sampler: EmbeddedSampler, lock: threading.Lock, path: str, version: str | None) -> dict[str, Any]:
    """SGLang's `update_weights_from_disk`: check every tensor at `path`, then copy them in between two generations
    and set the version (given, else one more); the answer says whether it succeeded and why not."""
    try:
        new_version = int(version) if version is not None else None
        weights = checked_weights(sampler.model, path)
    except (UserError, ValueError) as e:
        return {"success": False, "message": f"{type(e).__name__}: {e}"}
    with lock:
        swap_weights(sampler.model, weights)
        sampler.version = new_version if new_version is not None else sampler.version + 1
    return {"success": True, "message": f"loaded {path}", "weight_version": str(sampler.version)}


def checked_weights(model: PreTrainedModel, path: str) -> dict[str, torch.Tensor]:
    """The safetensors weights at `path`, every name, shape and value checked against `model`, cast to its dtype and
    device: what `swap_weights` can copy in without failing halfway. A UserError says what does not fit."""
    if not Path(path).is_dir():
        raise UserError(f"{path!r} is not a directory")
    weights = read_weights(path)
    state = model.state_dict()
    missing = set(state) - set(weights) - tied_names(model)
    unexpected = set(weights) - set(state)
    if missing or unexpected:
        raise UserError(f"{path}: the weights do not fit the served model (missing {sorted(missing)[:3]}, "
                        f"unexpected {sorted(unexpected)[:3]})")
    if bad := first_nonfinite(weights):
        raise UserError(f"{path}: {bad} holds NaN or inf")
    out = {}
    for name, tensor in weights.items():
        if tensor.shape != state[name].shape:
            raise UserError(f"{path}: {name} has shape {tuple(tensor.shape)}, the served model's is "
                            f"{tuple(state[name].shape)}")
        out[name] = tensor.to(device=state[name].device, dtype=state[name].dtype)
    return out


@torch.no_grad()
def swap_weights(model: PreTrainedModel, weights: dict[str, torch.Tensor]) -> None:
    """Copy checked weights (see `checked_weights`) into the model's own tensors."""
    state = model.state_dict()
    for name, tensor in weights.items():
        state[name].copy_(tensor)


def _prompt_ids(
    prompt: list[int] | list[list[int]] | str | list[str], tokenizer: PreTrainedTokenizerBase
) -> list[list[int]]:
    """Every accepted prompt form as a list of token-id lists (text is tokenized without special tokens)."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise HTTPException(400, "'prompt' is empty")
    if isinstance(prompt[0], int):
        return [list(prompt)]  # type: ignore[arg-type]
    if isinstance(prompt[0], str):
        return [tokenizer(text, add_special_tokens=False)["input_ids"] for text in prompt]  # type: ignore[misc]
    return [list(p) for p in prompt]  # type: ignore[arg-type]


def _choice(
    index: int,
    completion: Completion,
    prompt: list[int],
    request: CompletionRequest,
    tokenizer: PreTrainedTokenizerBase,
) -> dict[str, Any]:
    """One choice in vLLM's shape."""
    if request.return_tokens_as_token_ids:
        names = [f"token_id:{t}" for t in completion.tokens]
    else:
        names = [tokenizer.decode([t]) for t in completion.tokens]
    logprobs = None
    if request.logprobs is not None:
        offsets, offset = [], 0
        for name in names:
            offsets.append(offset)
            offset += len(name)
        logprobs = {
            "tokens": names,
            "token_logprobs": completion.logprobs,
            "top_logprobs": [{name: lp} for name, lp in zip(names, completion.logprobs)],
            "text_offset": offsets,
        }
    last = completion.tokens[-1] if completion.tokens else None
    stopped_by_request = completion.finish_reason == "stop" and last in (request.stop_token_ids or [])
    return {
        "index": index,
        "text": tokenizer.decode(completion.tokens, skip_special_tokens=request.skip_special_tokens),
        "logprobs": logprobs,
        "finish_reason": completion.finish_reason,
        "stop_reason": last if stopped_by_request else None,
        "token_ids": completion.tokens if request.return_token_ids else None,
        "prompt_token_ids": prompt if request.return_token_ids else None,
    }


def run_server(sampler: EmbeddedSampler, tokenizer: PreTrainedTokenizerBase, host: str, port: int,
               model_name: str = "default", guard: Guard | None = None) -> None:
    """Serve until SIGTERM or Ctrl-C; then generations in progress are cancelled and the server exits promptly."""
    import uvicorn

    guard = guard or Guard()

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            guard.shutting_down.set()  # running generations stop at their next token
            super().handle_exit(sig, frame)

    app = build_app(sampler, tokenizer, model_name, guard)
    Server(uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5)).run()


class CollectiveRpcRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    method: str
    args: list[Any] = Field(default_factory=list)
    kwargs: dict[str, Any] = Field(default_factory=dict)


class WeightVersionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    new_version: str


def add_weight_sync_routes(app: FastAPI, sampler: EmbeddedSampler, load: Any, dependencies: list | None = None) -> None:
    """The version routes of SGLang and the weight-reload routes of vLLM (VLLM_SERVER_DEV_MODE=1), so one client
    is tested against both protocols. `load(path)` loads a checkpoint as the SGLang route does.

    Requests are served one at a time and weights load under the same lock, so a generation never sees half
    the new weights: `/pause` and `/resume` have nothing to wait for and only acknowledge.
    """
    reload_path: dict[str, str | None] = {"model": None}

    @app.get("/get_weight_version", dependencies=dependencies)
    def get_weight_version() -> dict[str, str]:
        return {"weight_version": str(sampler.version)}

    @app.get("/get_model_info", dependencies=dependencies)
    def get_model_info() -> dict[str, Any]:
        return {"model_path": reload_path["model"], "is_generation": True, "weight_version": str(sampler.version)}

    @app.get("/weight_info", dependencies=dependencies)
    def weight_info() -> dict[str, str]:
        return {"weight_version": str(sampler.version)}

    @app.post("/pause", dependencies=dependencies)
    def pause() -> dict[str, str]:
        return {"status": "paused"}

    @app.post("/resume", dependencies=dependencies)
    def resume() -> dict[str, str]:
        return {"status": "resumed"}

    @app.post("/update_weight_version", dependencies=dependencies)
    def update_weight_version(request: WeightVersionRequest) -> dict[str, Any]:
        try:
            sampler.version = int(request.new_version)
        except ValueError:
            raise HTTPException(400, f"new_version {request.new_version!r} is not an integer") from None
        return {"success": True, "new_version": request.new_version}

    @app.post("/collective_rpc", dependencies=dependencies)
    def collective_rpc(request: CollectiveRpcRequest) -> dict[str, Any]:
        if request.method == "update_config":
            overrides = request.args[0] if request.args else request.kwargs.get("overrides", {})
            path = (overrides.get("model_config") or {}).get("model") if isinstance(overrides, dict) else None
            if not isinstance(path, str):
                raise HTTPException(400, "update_config: expected {'model_config': {'model': <checkpoint path>}}")
            reload_path["model"] = path
            return {"results": [None]}
        if request.method == "reload_weights":
            if reload_path["model"] is None:
                raise HTTPException(400, "reload_weights: no checkpoint path (call update_config first)")
            answer = load(reload_path["model"])
            if not answer.get("success"):
                raise HTTPException(500, f"reload_weights: {answer.get('message')}")
            return {"results": [None]}
        raise HTTPException(400, f"treerl serve answers collective_rpc 'update_config' and 'reload_weights' only, "
                                 f"not {request.method!r}")
