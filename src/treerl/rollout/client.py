"""A client for an OpenAI-compatible completions server: vLLM, SGLang, or `treerl serve`.

Step 1 (docs/architecture.md): sampling on a server; after step 6, the new weights pushed to it.

Prompts go out as token ids (`prompt: [[ids], ...]`, `n` samples each) and completions come back
as token ids with one log-prob per generated token. The request asks for
`logprobs=1` and `return_token_ids=true` (vLLM >= 0.10.2 and SGLang put `token_ids` in each
choice), and for the stop token to be kept (`include_stop_str_in_output` for vLLM,
`no_stop_trim` for SGLang); `return_tokens_as_token_ids` ("token_id:123" strings, vLLM) is read
as a fallback. Choices come back prompt-major: choice `i` is sample `i % n` of prompt `i // n`.

Which log-prob the server returns matters: the trainer recomputes `log_softmax(logits / T)`.
- `treerl serve`: exactly that.
- vLLM: start it with `--logprobs-mode processed_logprobs` (the default, `raw_logprobs`, ignores the
  temperature) and sample with `top_p = 1` (processed log-probs are renormalised over the nucleus).
- SGLang: its default (temperature applied) is right; do not set `SGLANG_RETURN_ORIGINAL_LOGPROB`.

The policy version of each token is the server's `metadata.weight_version` (SGLang, `treerl serve`)
when it reports one, else the client's own `version`, which the trainer sets after pushing weights.

Weight sync (`update_weights_from_disk`), each server's documented endpoints, then a version check:
- `server_type="sglang"` (and `treerl serve`): `POST /update_weights_from_disk` with `model_path` and
  `weight_version`; then `GET /get_weight_version` must report that version.
- `server_type="vllm"` (start it with `VLLM_SERVER_DEV_MODE=1`; these are its RL/dev routes):
  `POST /pause?mode=wait`, `POST /collective_rpc` `update_config` (the model path), `POST /collective_rpc`
  `reload_weights` (in place, from that path), `POST /update_weight_version`, `POST /resume`; then
  `GET /weight_info` must report the version. The checkpoint must have the served model's architecture.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from treerl.errors import UserError
from treerl.rollout.sampler import Completion, SamplingParams, check_prompts

REACH_TIMEOUT = 30.0  # seconds `check_reachable` waits for the server's first answer
API_KEY_ENV = "TREERL_API_KEY"  # the server's key, for `treerl serve --api-key` and the trainer's client alike


class ServerError(RuntimeError):
    """The server could not be reached, refused the request, or answered in an unexpected shape."""


@dataclass
class CompletionsClient:
    """Sends token-id prompts to `{base_url}/v1/completions` and returns `Completion`s."""

    base_url: str
    model: str = "default"  # the served model name (vLLM: --served-model-name)
    version: int = 0  # policy version of the server's weights, when the server does not report one
    timeout: float = 600.0  # seconds per HTTP request
    prompts_per_request: int = 64  # larger batches are split into several requests, sent concurrently
    max_concurrency: int = 4
    api_key: str | None = None
    server_type: str = "sglang"  # which weight-reload endpoints it has: "sglang" (also treerl serve) or "vllm"

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        """`params.n` completions per prompt, in prompt order."""
        check_prompts(prompts)
        size = self.prompts_per_request
        chunks = [prompts[lo : lo + size] for lo in range(0, len(prompts), size)]
        with ThreadPoolExecutor(max_workers=min(self.max_concurrency, len(chunks))) as pool:
            answers = list(pool.map(lambda chunk: self._complete(chunk, params), chunks))
        return [group for answer in answers for group in answer]

    def check_reachable(self, key: str = "rollout.server_url") -> None:
        """A server that cannot be reached at all (refused, unknown host, no answer) is a UserError naming `key`,
        before the run computes anything. Any HTTP answer to `GET /health`, an error status too, counts: the
        server is there, and its first real request checks the rest."""
        request = urllib.request.Request(self.base_url.rstrip("/") + "/health", method="GET")
        try:
            with urllib.request.urlopen(request, timeout=min(self.timeout, REACH_TIMEOUT)):
                return
        except urllib.error.HTTPError:
            return
        except OSError as e:  # URLError (refused, unknown host), a timeout, a reset connection
            reason = getattr(e, "reason", None) or e
            raise UserError(f"{key}={self.base_url!r}: cannot reach the inference server ({reason}); start it "
                            f"first, or leave {key} unset to sample in process") from None

    def update_weights_from_disk(self, model_path: str, version: int) -> None:
        """Have the server load the checkpoint at `model_path` (a path on the server's machine) as `version`."""
        if self.server_type == "vllm":
            self._reload_vllm(model_path, version)
            reported = self._get("/weight_info").get("weight_version")
        elif self.server_type == "sglang":
            answer = self._post("/update_weights_from_disk", {"model_path": model_path, "weight_version": str(version)})
            if not answer.get("success", False):
                raise ServerError(f"{self.base_url}: could not load weights from {model_path!r}: {answer.get('message')}")
            reported = self._get("/get_weight_version").get("weight_version")
        else:
            raise ValueError(f"server_type must be 'sglang' or 'vllm', got {self.server_type!r}")
        if str(reported) != str(version):
            raise ServerError(f"{self.base_url}: after loading {model_path!r} as version {version} the server reports "
                              f"weight version {reported!r}")
        self.version = version

    def _reload_vllm(self, model_path: str, version: int) -> None:
        """vLLM's dev-mode routes: pause, point the model config at the checkpoint, reload in place, version, resume."""
        self._post("/pause?mode=wait", {})
        try:
            self._post("/collective_rpc", {"method": "update_config", "args": [{"model_config": {"model": model_path}}]})
            self._post("/collective_rpc", {"method": "reload_weights"})
            self._post("/update_weight_version", {"new_version": str(version)})
        finally:
            self._post("/resume", {})

    def _complete(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        """One request for a chunk of prompts."""
        body = {
            "model": self.model,
            "prompt": prompts,
            "n": params.n,
            "max_tokens": params.max_new_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "logprobs": 1,
            "stop_token_ids": list(params.stop_token_ids),
            "return_token_ids": True,
            "include_stop_str_in_output": True,  # vLLM
            "no_stop_trim": True,  # SGLang
            "skip_special_tokens": False,
        }
        if params.seed is not None:
            body["seed"] = params.seed
        answer = self._post("/v1/completions", body)
        choices = answer.get("choices")
        if not isinstance(choices, list) or len(choices) != len(prompts) * params.n:
            got = len(choices) if isinstance(choices, list) else "no"
            raise ServerError(
                f"{self.base_url}: asked for {len(prompts)} prompts x {params.n} samples, got {got} choices"
            )
        version = _weight_version(answer, self.version)
        choices = sorted(choices, key=lambda c: c.get("index", 0))
        completions = [parse_choice(c, version) for c in choices]
        return [completions[p * params.n : (p + 1) * params.n] for p in range(len(prompts))]

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return self._request(path, json.dumps(body).encode())

    def _get(self, path: str) -> dict[str, Any]:
        return self._request(path, None)

    def _request(self, path: str, data: bytes | None) -> dict[str, Any]:
        """POST `data` (GET when None) and the JSON answer ({} for an empty body)."""
        url = self.base_url.rstrip("/") + path
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(url, data=data, headers=headers, method="GET" if data is None else "POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                raw = response.read()
                return json.loads(raw) if raw.strip() else {}
        except urllib.error.HTTPError as e:
            raise ServerError(f"{url}: HTTP {e.code}: {_error_message(e.read())}") from None
        except urllib.error.URLError as e:
            raise ServerError(f"cannot reach the inference server at {url}: {e.reason}") from None


def parse_choice(choice: dict[str, Any], version: int) -> Completion:
    """One choice of a completions response -> a `Completion` (token ids, log-probs, finish reason)."""
    index = choice.get("index")
    logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
    if logprobs is None or any(lp is None for lp in logprobs):
        raise ServerError(f"choice {index}: no per-token log-probs in the response (the server must honour 'logprobs')")
    tokens = choice.get("token_ids")
    if tokens is None:
        names = (choice.get("logprobs") or {}).get("tokens") or []
        if not names or not all(isinstance(t, str) and t.startswith("token_id:") for t in names):
            raise ServerError(
                f"choice {index}: no token ids in the response; the server must support 'return_token_ids' "
                "(vLLM >= 0.10.2, SGLang) or 'return_tokens_as_token_ids' (vLLM)"
            )
        tokens = [int(t.split(":", 1)[1]) for t in names]
    stop = choice.get("matched_stop", choice.get("stop_reason"))
    if len(logprobs) == len(tokens) + 1 and isinstance(stop, int):  # a server that trimmed the stop token
        tokens = [*tokens, stop]
    if len(tokens) != len(logprobs):
        raise ServerError(f"choice {index}: {len(tokens)} token ids but {len(logprobs)} log-probs")
    finish = choice.get("finish_reason")
    if finish not in ("stop", "length"):
        raise ServerError(f"choice {index}: finish_reason {finish!r} (expected 'stop' or 'length')")
    return Completion(list(tokens), [float(lp) for lp in logprobs], finish, [version] * len(tokens))


def _weight_version(answer: dict[str, Any], default: int) -> int:
    """The `metadata.weight_version` a server reports (SGLang, treerl serve), if it is an integer."""
    value = (answer.get("metadata") or {}).get("weight_version")
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def _error_message(raw: bytes) -> str:
    """The message of an OpenAI-style error body ({"error": {"message": ...}} or {"message": ...})."""
    try:
        body = json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")[:500]
    if isinstance(body.get("error"), dict):
        return str(body["error"].get("message", body))
    return str(body.get("message", body.get("detail", body)))
