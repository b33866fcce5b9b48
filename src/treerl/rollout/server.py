"""`treerl serve`: the embedded sampler behind the HTTP protocol of vLLM 0.32 or of SGLang 0.5.23 (FastAPI + uvicorn).

Beside the steps (docs/architecture.md): step 1's sampling served to other processes.

`transformers serve` cannot be used for RL: its /v1/completions ignores `logprobs`. This server
answers what `CompletionsClient` asks of a real server, in that server's shapes, and refuses what
that server refuses, so the fast tests check the client against the protocols it meets in
production (the suite also runs it against a real vLLM: tests/rollout/test_vllm.py). It speaks one
protocol at a time (`--protocol`), as a real server does:

- `vllm` (treerl.rollout.vllm_protocol): `GET /version`, `POST /v1/completions`,
  `POST /inference/v1/generate` (vLLM's scale-out route: token ids, log-probs and weight-version
  spans), and the dev-mode RL routes: `POST /pause?mode=`, `/resume`, `GET /is_paused`,
  `POST /collective_rpc` (`reload_weights` with `kwargs.weights_path`; `update_config` answers HTTP
  500 as on vLLM 0.32), `POST /update_weight_version`, `GET /weight_info`.
- `sglang` (treerl.rollout.sglang_protocol): `POST /generate` (input_ids, a sampling_params dict or
  one per prompt, `sampling_seed`), `POST /update_weights_from_disk` (HTTP 400 on failure),
  `GET /model_info` (and its alias `/get_model_info`), `GET /server_info`,
  `POST /update_weight_version`, `POST /pause_generation`, `POST /continue_generation`.
- Both: `GET /health` (200, empty), `GET /v1/models`.

Behaviour log-probs are the embedded sampler's (the distribution each token was drawn from, see
`treerl.rollout.sampler`), as vLLM's `--logprobs-mode processed_logprobs` gives them.

Generations run one at a time (a lock around the model), so a weight load always happens between
two generations: pausing with vLLM's `wait` or `keep` (SGLang's `retract` or `in_place`) lets the
generation in flight finish on the old weights, whose version its tokens are tagged with (a real
server can also move it onto the new weights mid-reply; the tags say which). vLLM's `abort` is
refused. While paused, new generations wait for the resume. A weight load reads and checks every
tensor (safetensors only: names, shapes, finite values) before one is copied in: it succeeds whole
or changes nothing (vLLM and SGLang give no such promise).

Limits (`Guard`): with an API key every endpoint but /health needs `Authorization: Bearer <key>`
(401 otherwise). `n`, `max_tokens` and the number of prompts have upper bounds, checked before
anything is allocated (400 naming the option that raises them). A generation stops, and frees the
model, when its client disconnects, when it runs past `request_timeout`, or when the server shuts
down (SIGTERM / Ctrl-C): the sampler looks between two decoding steps.
"""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from fastapi import Depends, FastAPI, HTTPException, Request, Response
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from treerl.errors import UserError
from treerl.models import first_nonfinite, read_weights, tied_names
from treerl.rollout.embedded import EmbeddedSampler, GenerationCancelled
from treerl.rollout.sampler import Completion, SamplingParams

POLL_SECONDS = 0.2  # how often a request looks whether its client is still there
PROTOCOLS = ("vllm", "sglang")


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

    def check(self, n: int, max_tokens: int, prompts: list[list[int]], max_positions: int | None) -> None:
        """400 for a request over a limit, before anything is allocated."""
        for value, limit, name, option in ((n, self.max_n, "n", "--max-n"),
                                           (max_tokens, self.max_tokens, "max_tokens", "--max-tokens"),
                                           (len(prompts), self.max_prompts, "prompts", "--max-prompts")):
            if value > limit:
                raise HTTPException(400, f"{name}={value} is more than this server allows ({limit}; treerl serve "
                                         f"{option} raises it)")
        if not prompts or any(len(p) == 0 for p in prompts):
            raise HTTPException(400, "a prompt is empty")
        longest = max(len(p) for p in prompts)
        if max_positions is not None and longest + max_tokens > max_positions:
            raise HTTPException(400, f"a prompt of {longest} tokens plus max_tokens={max_tokens} is more than "
                                     f"the model's {max_positions} positions")


@dataclass
class ServedModel:
    """What the routes of either protocol share: the sampler, its weights' version label, one generation at a time,
    and the pause between a server's pause and resume routes."""

    sampler: EmbeddedSampler
    tokenizer: PreTrainedTokenizerBase
    name: str
    guard: Guard
    label: str = "default"  # the weight version, as the servers name it (a string; "default" until one is set)
    path: str | None = None  # the checkpoint last loaded
    lock: threading.Lock = field(default_factory=threading.Lock)  # one generation or weight load at a time
    unpaused: threading.Event = field(default_factory=threading.Event)  # clear while paused

    def __post_init__(self) -> None:
        self.unpaused.set()

    @property
    def max_positions(self) -> int | None:
        return getattr(self.sampler.model.config, "max_position_embeddings", None)

    def sampling_params(self, **settings: Any) -> SamplingParams:
        """SamplingParams from a request's settings (400 naming a bad one); the tokenizer's eos stops a sample
        unless `ignore_eos`."""
        ignore_eos = settings.pop("ignore_eos", False)
        stop = set(settings.pop("stop_token_ids", None) or [])
        if not ignore_eos and self.tokenizer.eos_token_id is not None:
            stop.add(self.tokenizer.eos_token_id)
        try:
            return SamplingParams(stop_token_ids=tuple(sorted(stop)), **settings)
        except ValueError as e:
            raise HTTPException(400, str(e)) from None

    async def generate(self, prompts: list[list[int]], params: SamplingParams,
                       raw: Request) -> tuple[list[list[Completion]], str]:
        """Sample (waiting while paused); the completions and the version label of the weights that sampled them.
        Cancelled when the server shuts down, the deadline passes or the client leaves (503, 504, 499); 400 for a
        prompt the model refuses."""
        cancel = threading.Event()
        work = asyncio.ensure_future(run_in_threadpool(self._generate, prompts, params, cancel))
        deadline = time.monotonic() + self.guard.request_timeout
        why = None
        while not work.done():
            await asyncio.wait({work}, timeout=POLL_SECONDS)
            if work.done():
                break
            if self.guard.shutting_down.is_set():
                why = (503, "the server is shutting down")
            elif time.monotonic() > deadline:
                why = (504, f"generation took longer than {self.guard.request_timeout:g} s (treerl serve "
                            "--request-timeout)")
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

    def _generate(self, prompts: list[list[int]], params: SamplingParams,
                  cancel: threading.Event) -> tuple[list[list[Completion]], str]:
        """In a worker thread: wait for the resume and the model (giving up if cancelled), generate, free it."""
        while True:
            if cancel.is_set():
                raise GenerationCancelled("cancelled while waiting for the model")
            if self.unpaused.wait(POLL_SECONDS) and self.lock.acquire(timeout=POLL_SECONDS):
                if self.unpaused.is_set():  # not paused while it waited for the lock: its weights cannot change now
                    break
                self.lock.release()
        try:
            return self.sampler.generate(prompts, params, cancelled=cancel.is_set), self.label
        finally:
            self.lock.release()

    def load(self, path: str, label: str | None) -> None:
        """Check every tensor at `path`, then copy them in between two generations (and set the label, if given).
        A UserError says what does not fit; then nothing changed."""
        weights = checked_weights(self.sampler.model, path)
        with self.lock:
            swap_weights(self.sampler.model, weights)
            self.path = path
            if label is not None:
                self.label = label


def build_app(sampler: EmbeddedSampler, tokenizer: PreTrainedTokenizerBase, model_name: str = "default",
              guard: Guard | None = None, protocol: str = "vllm") -> FastAPI:
    """The FastAPI app serving `sampler` (its model) and `tokenizer` under the name `model_name`, speaking
    `protocol` (vllm or sglang)."""
    from treerl.rollout.sglang_protocol import add_sglang_routes
    from treerl.rollout.vllm_protocol import add_vllm_routes

    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {', '.join(PROTOCOLS)}, got {protocol!r}")
    served = ServedModel(sampler, tokenizer, model_name, guard or Guard())
    app = FastAPI(title=f"treerl serve ({protocol} protocol)")
    authorized = [Depends(served.guard.authorize)]
    app.exception_handler(HTTPException)(openai_error)
    app.get("/health")(lambda: Response(status_code=200))

    @app.get("/v1/models", dependencies=authorized)
    def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "treerl"}]}

    (add_vllm_routes if protocol == "vllm" else add_sglang_routes)(app, served, authorized)
    return app


def openai_error(_: Request, exc: HTTPException) -> JSONResponse:
    """Errors in the OpenAI shape vLLM uses, so every client prints the message."""
    return JSONResponse(
        status_code=exc.status_code,
        content={"error": {"message": str(exc.detail), "type": "invalid_request_error", "code": exc.status_code}},
    )


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


def version_spans(label: str, count: int) -> list[dict[str, Any]]:
    """Both servers' per-token version tags: [start, end) ranges of output tokens and the version that sampled them;
    here one range, as a generation runs on one set of weights."""
    return [{"version": label, "start": 0, "end": count}] if count else []


def run_server(sampler: EmbeddedSampler, tokenizer: PreTrainedTokenizerBase, host: str, port: int,
               model_name: str = "default", guard: Guard | None = None, protocol: str = "vllm") -> None:
    """Serve until SIGTERM or Ctrl-C; then generations in progress are cancelled and the server exits promptly."""
    import uvicorn

    guard = guard or Guard()

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            guard.shutting_down.set()  # running generations stop at their next token
            super().handle_exit(sig, frame)

    app = build_app(sampler, tokenizer, model_name, guard, protocol)
    Server(uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5)).run()
