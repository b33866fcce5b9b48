"""`treerl serve`: the embedded sampler behind the HTTP protocol of vLLM 0.32 or of SGLang 0.5.23 (FastAPI + uvicorn).

Beside the steps (docs/architecture.md): step 1's sampling served to other processes.

`transformers serve` cannot be used for RL: its /v1/completions ignores `logprobs`. This server
answers what `CompletionsClient` asks of a real server, in that server's shapes, and refuses what
that server refuses, so the fast tests check the client against the protocols it meets in
production (the suite also runs it against a real vLLM: tests/rollout/sampling/test_vllm.py). It speaks one
protocol at a time (`--protocol`), as a real server does:

- `vllm` (treerl.rollout.serving.vllm_protocol): `GET /version`, `POST /v1/completions`,
  `POST /inference/v1/generate` (vLLM's scale-out route: token ids, log-probs and weight-version
  spans), and the dev-mode RL routes: `POST /pause?mode=`, `/resume`, `GET /is_paused`,
  `POST /collective_rpc` (`reload_weights` with `kwargs.weights_path`; `update_config` answers HTTP
  500 as on vLLM 0.32), `POST /update_weight_version`, `GET /weight_info`.
- `sglang` (treerl.rollout.serving.sglang_protocol): `POST /generate` (input_ids, a sampling_params dict or
  one per prompt, `sampling_seed`), `POST /update_weights_from_disk` (HTTP 400 on failure),
  `GET /model_info` (and its alias `/get_model_info`), `GET /server_info`,
  `POST /update_weight_version`, `POST /pause_generation`, `POST /continue_generation`.
- Both: `GET /health` (200, empty), `GET /v1/models`.

Behaviour log-probs are the embedded sampler's (the distribution each token was drawn from, see
`treerl.rollout.sampling.sampler`), as vLLM's `--logprobs-mode processed_logprobs` gives them.

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

from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Response
from transformers import PreTrainedTokenizerBase

from treerl.rollout.sampling.embedded import EmbeddedSampler
from treerl.rollout.serving.served import Guard, ServedModel, openai_error
from treerl.rollout.serving.sglang_protocol import add_sglang_routes
from treerl.rollout.serving.vllm_protocol import add_vllm_routes

PROTOCOLS = ("vllm", "sglang")
__all__ = ["PROTOCOLS", "Guard", "build_app", "run_server"]


def build_app(sampler: EmbeddedSampler, tokenizer: PreTrainedTokenizerBase, model_name: str = "default",
              guard: Guard | None = None, protocol: str = "vllm") -> FastAPI:
    """The FastAPI app serving `sampler` (its model) and `tokenizer` under the name `model_name`, speaking
    `protocol` (vllm or sglang)."""
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
