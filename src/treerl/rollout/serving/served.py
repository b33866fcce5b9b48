"""What `treerl serve`'s two protocols share (treerl.rollout.serving.vllm_protocol, treerl.rollout.serving.sglang_protocol): the
served model, its limits, its weight loads and the shape of its errors; below both, so that neither imports the
server module that mounts them.

Beside the steps (docs/architecture.md): step 1's sampling served to other processes (treerl.rollout.serving.server).
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
from fastapi import HTTPException, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from treerl.errors import UserError
from treerl.models import first_nonfinite, model_names, read_weights, tied_names
from treerl.rollout.sampling.embedded import EmbeddedSampler, GenerationCancelled
from treerl.rollout.sampling.sampler import Completion, SamplingParams

POLL_SECONDS = 0.2  # how often a request looks whether its client is still there


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
    weights = model_names(model, read_weights(path))  # a vision-language checkpoint is saved in its family's layout
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
