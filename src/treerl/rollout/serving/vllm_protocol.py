"""`treerl serve --protocol vllm`: the routes of vLLM 0.32 that RL uses, with its request and answer shapes.

Beside the steps (docs/architecture.md): step 1's sampling served to other processes (treerl.rollout.serving.server).

Checked against vLLM 0.32's own code (vllm/entrypoints/openai/completion/protocol.py,
vllm/entrypoints/scale_out/token_in_token_out/protocol.py, vllm/entrypoints/rl/online/api_router.py)
and against the real server in tests/rollout/sampling/test_vllm.py. What vLLM refuses is refused here too:
`collective_rpc update_config` (HTTP 500 on 0.32), an unknown collective_rpc method (500),
`reload_weights` without `kwargs.weights_path`. vLLM accepts and ignores unknown request fields;
so does this server.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field

from treerl.errors import UserError
from treerl.rollout.sampling.sampler import Completion
from treerl.rollout.serving.served import ServedModel, openai_error, version_spans

RELEASE = "0.32.0+treerl"  # the vLLM release whose protocol this is (GET /version)


class VllmSampling(BaseModel):
    """The sampling fields of vLLM's two routes that this server honours (others are accepted and ignored)."""

    model_config = ConfigDict(extra="ignore")

    n: int = Field(1, ge=1)
    max_tokens: int = Field(16, ge=1)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no limit
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True


class CompletionRequest(VllmSampling):
    """POST /v1/completions (OpenAI's fields plus vLLM's)."""

    model: str | None = None
    prompt: list[int] | list[list[int]] | str | list[str]
    logprobs: int | None = None
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    stream: bool = False
    echo: bool = False


class GenerateRequest(BaseModel):
    """POST /inference/v1/generate: one prompt of token ids, vLLM's SamplingParams, token ids back."""

    model_config = ConfigDict(extra="ignore")

    token_ids: list[int] = Field(min_length=1)
    sampling_params: VllmSampling
    model: str | None = None
    stream: bool = False


class CollectiveRpcRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    method: str
    args: list[Any] = Field(default_factory=list)
    kwargs: dict[str, Any] = Field(default_factory=dict)


class WeightVersionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    new_version: str


def add_vllm_routes(app: FastAPI, served: ServedModel, authorized: list) -> None:
    """vLLM's sampling routes and its dev-mode weight-sync routes (VLLM_SERVER_DEV_MODE=1, --enable-scale-out)."""
    app.exception_handler(RequestValidationError)(lambda request, exc: openai_error(request, HTTPException(
        400, "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()))))  # vLLM: 400, not 422

    @app.get("/version")
    def version() -> dict[str, str]:
        return {"version": RELEASE}

    @app.post("/v1/completions", dependencies=authorized)
    async def completions(request: CompletionRequest, raw: Request) -> dict[str, Any]:
        if request.stream or request.echo:
            raise HTTPException(400, "treerl serve does not support 'stream' or 'echo'")
        check_model(request.model, served)
        prompts = prompt_ids(request.prompt, served)
        params = sampling(request, served, prompts)
        groups, _ = await served.generate(prompts, params, raw)
        choices = [completion_choice(p * request.n + j, c, prompt, request, served)
                   for p, (prompt, group) in enumerate(zip(prompts, groups)) for j, c in enumerate(group)]
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": served.name, "choices": choices, "usage": usage(prompts, groups)}

    @app.post("/inference/v1/generate", dependencies=authorized)
    async def generate(request: GenerateRequest, raw: Request) -> dict[str, Any]:
        if request.stream:
            raise HTTPException(400, "treerl serve does not support 'stream'")
        check_model(request.model, served)
        params = sampling(request.sampling_params, served, [request.token_ids])
        [group], label = await served.generate([request.token_ids], params, raw)
        choices = [{"index": j, "finish_reason": c.finish_reason, "stop_reason": stop_reason(c, request.sampling_params),
                    "token_ids": c.tokens, "weight_versions": version_spans(label, len(c.tokens)),
                    "logprobs": {"content": [{"token_id": t, "logprob": lp, "top_logprobs": [
                        {"token_id": t, "logprob": lp}]} for t, lp in zip(c.tokens, c.logprobs)]}}
                   for j, c in enumerate(group)]
        return {"request_id": f"generate-tokens-{uuid.uuid4().hex}", "model": served.name, "choices": choices,
                "usage": usage([request.token_ids], [group])}

    @app.post("/pause", dependencies=authorized)
    def pause(mode: Literal["abort", "wait", "keep"] = "abort") -> dict[str, str]:
        if mode == "abort":
            raise HTTPException(400, "treerl serve does not abort generations: pause with mode=wait or mode=keep")
        served.unpaused.clear()
        with served.lock:  # the generation in flight, if any, finishes first
            pass
        return {"status": "paused"}

    @app.post("/resume", dependencies=authorized)
    def resume() -> dict[str, str]:
        served.unpaused.set()
        return {"status": "resumed"}

    @app.get("/is_paused", dependencies=authorized)
    def is_paused() -> dict[str, bool]:
        return {"is_paused": not served.unpaused.is_set()}

    @app.post("/update_weight_version", dependencies=authorized)
    def update_weight_version(request: WeightVersionRequest) -> dict[str, Any]:
        served.label = request.new_version
        return {"success": True, "new_version": request.new_version}

    @app.get("/weight_info", dependencies=authorized)
    def weight_info() -> dict[str, str]:
        return {"weight_version": served.label}

    @app.post("/collective_rpc", dependencies=authorized)
    def collective_rpc(request: CollectiveRpcRequest) -> dict[str, Any]:
        if request.method == "reload_weights":
            path = request.kwargs.get("weights_path")
            if not isinstance(path, str):
                raise rpc_failed("reload_weights needs kwargs.weights_path (a checkpoint directory)")
            try:
                served.load(path, None)
            except UserError as e:
                raise rpc_failed(str(e)) from None
            return {"results": [None]}
        if request.method == "update_config":  # vLLM 0.32 fails it for every model_config override
            raise rpc_failed("Field '_hf_config_revision' not found in ModelConfig.")
        raise rpc_failed(f"'CPUWorker' object has no attribute {request.method!r}")


def check_model(model: str | None, served: ServedModel) -> None:
    """vLLM's 404 for a request naming a model it does not serve (no name: the served one)."""
    if model is not None and model != served.name:
        raise HTTPException(404, f"The model `{model}` does not exist.")


def rpc_failed(reason: str) -> HTTPException:
    """vLLM's answer to a collective_rpc whose worker call raised."""
    return HTTPException(500, f"Call to collective_rpc method failed: Worker failed with error {reason!r}")


def sampling(request: VllmSampling, served: ServedModel, prompts: list[list[int]]):
    """The request's SamplingParams, its limits checked first."""
    served.guard.check(request.n, request.max_tokens, prompts, served.max_positions)
    return served.sampling_params(n=request.n, max_new_tokens=request.max_tokens, temperature=request.temperature,
                                  top_p=request.top_p, top_k=max(request.top_k, 0), min_p=request.min_p,
                                  seed=request.seed, stop_token_ids=request.stop_token_ids,
                                  ignore_eos=request.ignore_eos)


def prompt_ids(prompt: list[int] | list[list[int]] | str | list[str], served: ServedModel) -> list[list[int]]:
    """Every accepted prompt form as a list of token-id lists (text is tokenized without special tokens)."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise HTTPException(400, "'prompt' is empty")
    if isinstance(prompt[0], int):
        return [list(prompt)]  # type: ignore[arg-type]
    if isinstance(prompt[0], str):
        return [served.tokenizer(text, add_special_tokens=False)["input_ids"] for text in prompt]  # type: ignore[misc]
    return [list(p) for p in prompt]  # type: ignore[arg-type]


def stop_reason(completion: Completion, request: VllmSampling) -> int | None:
    """vLLM's stop_reason: the stop token when one of the request's stop_token_ids ended the sample (None for eos)."""
    last = completion.tokens[-1] if completion.tokens else None
    return last if completion.finish_reason == "stop" and last in (request.stop_token_ids or []) else None


def completion_choice(index: int, completion: Completion, prompt: list[int], request: CompletionRequest,
                      served: ServedModel) -> dict[str, Any]:
    """One /v1/completions choice in vLLM's shape."""
    tokenizer = served.tokenizer
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
        logprobs = {"tokens": names, "token_logprobs": completion.logprobs,
                    "top_logprobs": [{name: lp} for name, lp in zip(names, completion.logprobs)],
                    "text_offset": offsets}
    return {
        "index": index,
        "text": tokenizer.decode(completion.tokens, skip_special_tokens=request.skip_special_tokens),
        "logprobs": logprobs,
        "finish_reason": completion.finish_reason,
        "stop_reason": stop_reason(completion, request),
        "token_ids": completion.tokens if request.return_token_ids else None,
        "prompt_token_ids": prompt if request.return_token_ids else None,
    }


def usage(prompts: list[list[int]], groups: list[list[Completion]]) -> dict[str, int]:
    generated = sum(len(c.tokens) for group in groups for c in group)
    prompt_tokens = sum(len(p) for p in prompts)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": generated, "total_tokens": prompt_tokens + generated}
