"""`treerl serve --protocol sglang`: the routes of SGLang 0.5.23 that RL uses, with its request and answer shapes.

Beside the steps (docs/architecture.md): step 1's sampling served to other processes (treerl.rollout.serving.server).

SGLang has no CPU build to test against here, so this follows its source at v0.5.23
(python/sglang/srt/entrypoints/http_server.py, managers/io_struct.py, managers/tokenizer_manager.py,
api/v1/api_types.py). As there:
- `POST /generate`: `input_ids` (one list or a batch), `sampling_params` (a dict, or one per prompt,
  every one with the same `n`), `return_logprob`; an unknown key inside `sampling_params` is refused
  with 400, `seed` among them (SGLang's is `sampling_seed`); unknown top-level keys are ignored. A
  single prompt with n = 1 answers one object, anything else a list, prompt-major. `output_ids`
  and `meta_info.output_token_logprobs` ([logprob, token_id, text] triples) include the stop token;
  `meta_info.finish_reason` is {"type": "stop", "matched": id} or {"type": "length", "length": n};
  `meta_info.weight_versions` tags the output tokens with the weights that sampled them.
- `POST /update_weights_from_disk`: `model_path`, `weight_version` (set only when given and the
  load succeeded); `{"success", "message", "num_paused_requests"}`, HTTP 400 on failure.
- `GET /model_info` (and its deprecated alias `/get_model_info`): `weight_version` among the fields;
  `GET /server_info`: `version`. No `/version`, no `/get_weight_version` (both 404 on SGLang 0.5.23).
- `POST /update_weight_version {"new_version"}`, `POST /pause_generation {"mode"}`,
  `POST /continue_generation`: each needs a JSON body.
- Errors: 400 for a body that does not validate, in SGLang's flat shape
  {"object": "error", "message", "type", "param", "code"}.
Differences, on purpose: `sampling_seed` is honoured always (SGLang only with
`--enable-deterministic-inference`), a failed load changes nothing, the log-probs are those of the
distribution sampled from (SGLang's are untruncated: treerl refuses truncated sampling with SGLang),
and sampling settings SGLang has but this server does not (penalties, grammars, stop strings) are
refused with 400 rather than ignored.
"""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from treerl.errors import UserError
from treerl.rollout.sampling.sampler import Completion
from treerl.rollout.serving.served import ServedModel, version_spans

RELEASE = "0.5.23+treerl"  # the SGLang release whose protocol this is (GET /server_info)
HONOURED = {"max_new_tokens": 128, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "n": 1,
            "stop_token_ids": None, "ignore_eos": False, "skip_special_tokens": True, "no_stop_trim": False,
            "sampling_seed": None}  # SGLang's sampling_params this server honours, with SGLang's defaults
NOT_HONOURED = ("stop", "stop_regex", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens",
                "json_schema", "regex", "ebnf", "structural_tag", "spaces_between_special_tokens", "stream_interval",
                "logit_bias", "custom_params", "beam_width", "watermark", "choice")  # SGLang's others: refused if set


class GenerateRequest(BaseModel):
    """POST /generate (the fields RL uses; other top-level fields are ignored, as SGLang does)."""

    model_config = ConfigDict(extra="ignore")

    input_ids: list[int] | list[list[int]]
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    return_logprob: bool | list[bool] = False
    stream: bool = False


class UpdateWeightsRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model_path: str
    weight_version: str | None = None


class VersionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    new_version: str
    abort_all_requests: bool = True


class PauseRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    mode: str = "abort"


class ContinueRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")


def add_sglang_routes(app: FastAPI, served: ServedModel, authorized: list) -> None:
    """SGLang's native generate route, its weight-update and pause routes, and its info routes."""
    app.exception_handler(HTTPException)(sglang_error)
    app.exception_handler(RequestValidationError)(lambda request, exc: sglang_error(
        request, HTTPException(400, "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()))))

    @app.post("/generate", dependencies=authorized)
    async def generate(request: GenerateRequest, raw: Request) -> Any:
        if request.stream:
            raise HTTPException(400, "treerl serve does not support 'stream'")
        prompts = request.input_ids if request.input_ids and isinstance(request.input_ids[0], list) else [
            request.input_ids]
        settings = request.sampling_params if isinstance(request.sampling_params, list) else [
            request.sampling_params or {}] * len(prompts)
        if len(settings) != len(prompts):
            raise HTTPException(400, f"{len(settings)} sampling_params for {len(prompts)} prompts")
        items = []
        for prompt, setting in zip(prompts, settings):  # each prompt with its own settings (and seed)
            checked = checked_sampling(setting)
            served.guard.check(checked["n"], checked["max_new_tokens"], [prompt], served.max_positions)
            [group], label = await served.generate([prompt], sglang_params(served, checked), raw)
            items.extend(output(c, prompt, checked, label, served, bool(request.return_logprob)) for c in group)
        return items[0] if len(prompts) == 1 and len(items) == 1 else items

    @app.post("/update_weights_from_disk", dependencies=authorized)
    def update_weights_from_disk(request: UpdateWeightsRequest) -> JSONResponse:
        try:
            served.load(request.model_path, request.weight_version)
        except UserError as e:
            return JSONResponse(status_code=400, content={"success": False, "message": f"Failed to update weights: {e}",
                                                          "num_paused_requests": 0})
        message = "Succeeded to update model weights."
        if request.weight_version is not None:
            message += f" Weight version updated to {request.weight_version}."
        return JSONResponse(content={"success": True, "message": message, "num_paused_requests": 0})

    def model_info() -> dict[str, Any]:
        return {"model_path": served.path, "served_model_name": served.name, "is_generation": True,
                "weight_version": served.label, "model_type": served.sampler.model.config.model_type}

    app.get("/model_info", dependencies=authorized)(model_info)
    app.get("/get_model_info", dependencies=authorized)(model_info)

    @app.get("/server_info", dependencies=authorized)
    def server_info() -> dict[str, Any]:
        return {"version": RELEASE, "weight_version": "default"}  # SGLang: the startup value

    @app.post("/update_weight_version", dependencies=authorized)
    def update_weight_version(request: VersionRequest) -> dict[str, Any]:
        served.label = request.new_version
        return {"success": True, "message": f"Weight version updated to {request.new_version}",
                "new_version": request.new_version}

    @app.post("/pause_generation", dependencies=authorized)
    def pause_generation(request: PauseRequest) -> dict[str, str]:
        if request.mode not in ("abort", "retract", "in_place"):
            raise HTTPException(400, f"mode: {request.mode!r} is not one of 'abort', 'retract', 'in_place'")
        if request.mode == "abort":
            raise HTTPException(400, "treerl serve does not abort generations: pause with mode retract or in_place")
        served.unpaused.clear()
        with served.lock:  # the generation in flight, if any, finishes first
            pass
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation", dependencies=authorized)
    def continue_generation(request: ContinueRequest) -> dict[str, str]:
        served.unpaused.set()
        return {"message": "Generation continued successfully.", "status": "ok"}


def sglang_error(_: Request, exc: HTTPException) -> JSONResponse:
    """SGLang's flat ErrorResponse."""
    return JSONResponse(status_code=exc.status_code, content={
        "object": "error", "message": str(exc.detail), "type": "Bad Request" if exc.status_code == 400 else
        str(exc.status_code), "param": None, "code": exc.status_code})


def checked_sampling(setting: dict[str, Any]) -> dict[str, Any]:
    """SGLang's sampling_params with its defaults filled in; 400 for an unknown key (as SGLang) or one this server
    does not honour set away from its default."""
    known = set(HONOURED) | set(NOT_HONOURED)
    for key, value in setting.items():
        if key not in known:
            raise HTTPException(400, f"unknown field `{key}`, expected one of {', '.join(sorted(known))}")
        if key in NOT_HONOURED and value not in (None, False, 0, 0.0, 1.0, [], {}, ""):
            raise HTTPException(400, f"sampling_params.{key}: treerl serve does not support it")
    return HONOURED | {k: v for k, v in setting.items() if k in HONOURED}


def sglang_params(served: ServedModel, setting: dict[str, Any]):
    """SamplingParams from SGLang's settings (a temperature near 0 samples greedily, as SGLang does)."""
    temperature, top_k = setting["temperature"], setting["top_k"]
    if temperature < 1e-6:
        temperature, top_k = 1.0, 1
    return served.sampling_params(n=setting["n"], max_new_tokens=setting["max_new_tokens"], temperature=temperature,
                                  top_p=setting["top_p"], top_k=max(top_k, 0), min_p=setting["min_p"],
                                  seed=setting["sampling_seed"], stop_token_ids=setting["stop_token_ids"],
                                  ignore_eos=setting["ignore_eos"])


def output(completion: Completion, prompt: list[int], setting: dict[str, Any], label: str, served: ServedModel,
           with_logprobs: bool) -> dict[str, Any]:
    """One sample in SGLang's shape: text, output_ids (the stop token included), meta_info."""
    if completion.finish_reason == "stop":
        finish: dict[str, Any] = {"type": "stop", "matched": completion.tokens[-1]}
    else:
        finish = {"type": "length", "length": setting["max_new_tokens"]}
    meta: dict[str, Any] = {
        "id": uuid.uuid4().hex, "finish_reason": finish, "prompt_tokens": len(prompt),
        "completion_tokens": len(completion.tokens), "weight_version": label,
        "weight_versions": version_spans(label, len(completion.tokens)),
    }
    if with_logprobs:
        meta["output_token_logprobs"] = [[lp, t, None] for t, lp in zip(completion.tokens, completion.logprobs)]
    text = served.tokenizer.decode(completion.tokens, skip_special_tokens=setting["skip_special_tokens"])
    return {"text": text, "output_ids": completion.tokens, "meta_info": meta}
