"""The client of one or several inference servers: vLLM, SGLang, or `treerl serve` (which imitates either).

Step 1 (docs/architecture.md): sampling on servers; after step 6, the new weights pushed to them.

    client = CompletionsClient(["http://127.0.0.1:8000"], model="policy")
    client.connect()                                  # reachable? which server, which routes? (before any compute)
    client.push_weights("/dev/shm/treerl-run/weights", version=0)   # every server loads them, tagged 0
    groups = client.generate(prompts, SamplingParams(n=8, seed=1))  # token ids in, Completions out

What each server is, and so how to talk to it, is read from the server itself (`connect`): a
vLLM server answers `GET /version` and serves its RL routes (`VLLM_SERVER_DEV_MODE=1`); an
SGLang server answers `GET /model_info`. `rollout.server_type` may name the kind instead of
`auto`; a server that lacks the routes its kind needs is refused at once, naming the flag that
adds them.

Sampling, one request per prompt, sent concurrently (requests to several servers balanced: each
goes to the server with the fewest requests in flight):
- vLLM with `--enable-scale-out`: `POST /inference/v1/generate` (token ids in and out, each token's
  log-prob, and the weight version that sampled each token); otherwise `POST /v1/completions`
  (synchronous training only: it does not say which weights sampled a token).
- SGLang: `POST /generate` with the prompt repeated once per sample, each with its own
  `sampling_seed` (SGLang seeds only with `--enable-deterministic-inference`, and then gives the n
  copies of one request the same seed); per-token versions from `meta_info.weight_versions`.
Images (a prompt's `ImageSpan`s): vLLM's token-in/token-out route only, as `content_parts` (PNG data URLs of the
images as read, `ImageSpan.source`) beside the ids with each image's placeholders collapsed to one token; vLLM expands
them again and must answer with the trainer's ids and image places (`check_expanded`). Other routes are sent none.
Seeds: a call's seed gives every prompt (SGLang: every sample) a seed of its own, derived from it,
so no two prompts share a random stream (one seed for a whole multi-prompt request makes vLLM
sample j of every prompt from the same stream) and a seeded call is reproducible.

Behaviour log-probs (see `treerl.rollout.sampling.sampler`): those of the distribution the tokens were drawn
from. vLLM returns them with `--logprobs-mode processed_logprobs` (top_p / top_k / min_p included);
SGLang 0.5.23 returns the untruncated log-prob on these routes, so `generate` refuses truncated
sampling on an SGLang server (the trainer refuses it when it connects).

Weight sync (`push_weights`): the trainer writes a transformers checkpoint (safetensors; on one
machine under /dev/shm, so nothing touches a disk) and each server loads it in place:
- vLLM 0.32: `POST /pause?mode=wait|keep`, `POST /collective_rpc` `reload_weights` with
  `kwargs.weights_path`, `POST /update_weight_version`, `POST /resume`; `GET /weight_info` must
  then report the version. (`collective_rpc update_config` answers HTTP 500 on 0.32, and a failed
  `reload_weights` leaves vLLM's model half loaded: the server must be restarted.)
- SGLang: `POST /update_weights_from_disk` with `model_path` and `weight_version` (it waits for the
  requests in flight), or between `POST /pause_generation {"mode": "retract"}` and
  `POST /continue_generation` to move them onto the new weights; `GET /model_info` must then
  report the version.
`pause="wait"` lets generations in flight finish on the old weights; `pause="keep"` freezes them
and resumes them on the new weights (the per-token versions say which tokens came from which).

Every failure is a `ServerError`: one line naming the server, the endpoint, the server's answer and
`rollout.server_type`.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import logging
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Callable

from treerl.errors import ServerError, UserError
from treerl.rollout.sampling.sampler import Completion, SamplingParams, check_prompts
from treerl.rollout.tasks.base import rng_for
from treerl.tree import ImageSpan

log = logging.getLogger("treerl.rollout")
REACH_TIMEOUT = 30.0  # seconds `connect` waits for a server's first answer
API_KEY_ENV = "TREERL_API_KEY"  # the server's key, for `treerl serve --api-key` and the trainer's client alike
SERVER_TYPES = ("auto", "vllm", "sglang")
PAUSE_MODES = ("wait", "keep")  # generations in flight during a push: finish on the old weights | resume on the new
VLLM_RL_ROUTES = ("/pause", "/resume", "/collective_rpc", "/update_weight_version", "/weight_info")
VLLM_GENERATE = "/inference/v1/generate"
SERVER_IMAGES = ("a prompt shows an image: treerl sends images to vLLM's token-in/token-out route only (vLLM started "
                 "with --enable-scale-out), not to {server} (rollout.server_url); or sample in process (no "
                 "rollout.server_url)")
SGLANG_ROUTES = ("/generate", "/update_weights_from_disk", "/model_info", "/pause_generation", "/continue_generation")


@dataclass(frozen=True)
class ServerInfo:
    """What one server is and how it is spoken to, as read from it by `connect`."""

    kind: str  # "vllm" | "sglang"
    release: str  # the server's version string (vLLM's /version, SGLang's /server_info)
    generate_route: str  # where samples come from
    versions_per_token: bool  # its answers say which weight version sampled each token
    models: tuple[str, ...] = ()  # the model names it serves (GET /v1/models), read once when connecting


@dataclass
class Server:
    """One server: its URL, what `connect` found, and its requests in flight (for balancing)."""

    url: str
    info: ServerInfo | None = None
    in_flight: int = 0


@dataclass
class CompletionsClient:
    """Samples token ids from inference servers and pushes new weights to all of them."""

    base_url: str | list[str]  # one server or several (requests balanced, weights pushed to every one)
    model: str = "default"  # the served model name (vLLM: --served-model-name)
    version: int = 0  # the weight version the servers hold (set by push_weights; the trainer's step)
    timeout: float = 600.0  # seconds per HTTP request
    max_concurrency: int = 64  # requests in flight at once, over all servers
    api_key: str | None = None
    server_type: str = "auto"  # auto (read from each server) | vllm | sglang
    setting: str = "rollout.server_url"  # the config key named in errors
    model_setting: str = "rollout.server_model"  # the config key of `model`, named in errors
    on_wait: Callable[[], None] | None = None  # called about once a second while requests are in flight
    push_timeout: float = 3600.0  # seconds a pause (vLLM's `wait` drains every request in flight) or reload may take
    servers: list[Server] = field(init=False)

    def __post_init__(self) -> None:
        urls = [self.base_url] if isinstance(self.base_url, str) else list(self.base_url)
        if not urls:
            raise ValueError(f"{self.setting}: no server URL")
        self.servers = [Server(url.rstrip("/")) for url in urls]
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ connecting
    def connect(self) -> list[ServerInfo]:
        """Reach every server and read what it is; a UserError naming the setting (and the server flag that is
        missing) for one that cannot be reached or cannot serve RL. Before any compute."""
        for server in self.servers:
            server.info = self._detect(server)
        return [s.info for s in self.servers if s.info is not None]

    def _detect(self, server: Server) -> ServerInfo:
        """The kind of `server` (from its answers, or `server_type`) and the routes it serves."""
        self._reach(server)
        routes = self._routes(server)
        kind = self.server_type
        if kind == "auto":
            if "/update_weights_from_disk" in routes or self._answers(server, "/model_info"):
                kind = "sglang"
            elif "/collective_rpc" in routes or self._answers(server, "/version"):
                kind = "vllm"
            else:
                raise UserError(f"{self.setting}: {server.url} is neither vLLM (no GET /version) nor SGLang (no GET "
                                "/model_info); set rollout.server_type=vllm or sglang if it is one of them")
        if kind == "vllm":
            return self._vllm_info(server, routes)
        if kind == "sglang":
            return self._sglang_info(server, routes)
        raise UserError(f"rollout.server_type={kind!r} is not one of {', '.join(SERVER_TYPES)}")

    def _vllm_info(self, server: Server, routes: set[str]) -> ServerInfo:
        """vLLM must serve its RL routes (dev mode); per-token versions come with its scale-out generate route."""
        missing = [r for r in VLLM_RL_ROUTES if r not in routes] if routes else []
        if missing:
            raise UserError(f"{self.setting}: the vLLM server at {server.url} does not serve {', '.join(missing)} "
                            "(rollout.server_type=vllm pushes weights through them): start it with "
                            "VLLM_SERVER_DEV_MODE=1")
        release = str(self._get(server, "/version").get("version", "unknown"))
        if (not routes or "/is_paused" in routes) and self._get(server, "/is_paused").get("is_paused"):
            log.warning("the vLLM server at %s is paused (a push interrupted?); resuming it", server.url)
            self._post(server, "/resume", {})
        scale_out = self._generate_enabled(server) if (not routes or VLLM_GENERATE in routes) else False
        route = VLLM_GENERATE if scale_out else "/v1/completions"
        models = self._served_models(server)  # before the probe below, which asks for the model by name
        self._check_processed_logprobs(server)
        return ServerInfo("vllm", release, route, versions_per_token=scale_out, models=models)

    def _check_processed_logprobs(self, server: Server) -> None:
        """vLLM's default `--logprobs-mode raw_logprobs` returns log-probs before the temperature (and the top_p /
        top_k / min_p cut): not those of the distribution a token was drawn from. Two one-token requests tell: at
        temperatures 1 and 0.5 the best token's log-prob differs only when the temperature is applied."""
        best = []
        for temperature in (1.0, 0.5):
            answer = self._post(server, "/v1/completions", {"model": self.model, "prompt": [0], "max_tokens": 1,
                                                             "temperature": temperature, "logprobs": 5, "seed": 0})
            top = ((answer.get("choices") or [{}])[0].get("logprobs") or {}).get("top_logprobs") or [{}]
            best.append(max(top[0].values(), default=None))
        if None not in best and abs(best[0] - best[1]) < 1e-6:
            raise UserError(f"{self.setting}: the vLLM server at {server.url} returns raw log-probs (before the "
                            "temperature and the top_p / top_k cut), not those of the distribution it samples from: "
                            "start it with --logprobs-mode processed_logprobs")

    def _sglang_info(self, server: Server, routes: set[str]) -> ServerInfo:
        """SGLang must serve its native generate route and the weight-update routes."""
        missing = [r for r in SGLANG_ROUTES if r not in routes] if routes else []
        if missing:
            raise UserError(f"{self.setting}: the SGLang server at {server.url} does not serve {', '.join(missing)} "
                            "(rollout.server_type=sglang samples and pushes weights through them)")
        release = str(self._get(server, "/server_info").get("version", "unknown")) if (
            not routes or "/server_info" in routes) else "unknown"
        return ServerInfo("sglang", release, "/generate", versions_per_token=True, models=self._served_models(server))

    def _served_models(self, server: Server) -> tuple[str, ...]:
        """The models `server` serves (`GET /v1/models`, both vLLM and SGLang); `model` must be one of them, or every
        request would be refused (vLLM: 404) or, on a server that ignores the name, sample another model."""
        try:
            listed = self._get(server, "/v1/models").get("data")
        except ServerError as e:
            raise UserError(f"{self.setting}: the server at {server.url} does not list its models ({e})") from None
        models = tuple(str(m["id"]) for m in listed if isinstance(m, dict) and "id" in m) if isinstance(
            listed, list) else ()
        if self.model not in models:
            raise UserError(f"{self.model_setting}={self.model!r}: the server at {server.url} serves "
                            f"{', '.join(repr(m) for m in models) or 'no model'} (GET /v1/models)")
        return models

    def _reach(self, server: Server) -> None:
        """Any HTTP answer to `GET /health` (an error status too) means the server is there."""
        request = urllib.request.Request(server.url + "/health", method="GET", headers=self._headers())
        try:
            with urllib.request.urlopen(request, timeout=min(self.timeout, REACH_TIMEOUT)):
                return
        except urllib.error.HTTPError:
            return
        except OSError as e:  # URLError (refused, unknown host), a timeout, a reset connection
            reason = getattr(e, "reason", None) or e
            raise UserError(f"{self.setting}={server.url!r}: cannot reach the inference server ({reason}); start it "
                            f"first, or leave {self.setting} unset to sample in process") from None

    def _routes(self, server: Server) -> set[str]:
        """The paths of the server's OpenAPI schema (vLLM, SGLang and treerl serve are FastAPI apps); empty when
        it publishes none (then each route is tried when used)."""
        try:
            return set(self._get(server, "/openapi.json").get("paths", {}))
        except ServerError:
            return set()

    def _answers(self, server: Server, path: str) -> bool:
        """`GET path` answers 200."""
        try:
            self._get(server, path)
            return True
        except ServerError:
            return False

    def _generate_enabled(self, server: Server) -> bool:
        """vLLM's token-in/token-out route is mounted always but answers only with --enable-scale-out: an empty
        request is refused as invalid (400/422) where it is enabled, forbidden (403) where not."""
        try:
            self._post(server, VLLM_GENERATE, {})
        except ServerError as e:
            return e.status in (400, 422)
        return True

    # ------------------------------------------------------------------ sampling
    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 images: list[tuple[ImageSpan, ...]] | None = None) -> list[list[Completion]]:
        """`params.n` completions per prompt, in prompt order, each token tagged with the weights that sampled it."""
        check_prompts(prompts)
        if any(s.info is None for s in self.servers):
            self.connect()
        shown = images if images is not None else [()] * len(prompts)
        if any(shown):
            check_sendable(shown, self.servers)
        seeds = [None if params.seed is None else prompt_seed(params.seed, p) for p in range(len(prompts))]
        pool = ThreadPoolExecutor(max_workers=min(self.max_concurrency, len(prompts)))
        try:
            futures = [pool.submit(self._sample, prompt, params, seed, tuple(spans))
                       for prompt, seed, spans in zip(prompts, seeds, shown)]
            self._wait(futures)
            return [f.result() for f in futures]
        finally:  # after a failure, not waiting for the other servers' requests (they may run for minutes)
            pool.shutdown(wait=False, cancel_futures=True)

    def _wait(self, futures: list[Future]) -> None:
        """Until every request is answered or one failed (raised at once); `on_wait` about once a second meanwhile."""
        pending = set(futures)
        while pending:
            done, pending = wait(pending, timeout=1.0, return_when=FIRST_EXCEPTION)
            if any(f.exception() is not None for f in done):
                next(f for f in done if f.exception() is not None).result()  # raises it
            if self.on_wait is not None:
                self.on_wait()

    def _sample(self, prompt: list[int], params: SamplingParams, seed: int | None,
                images: tuple[ImageSpan, ...] = ()) -> list[Completion]:
        """One prompt's samples from the least busy server (one whose route takes images, where the prompt shows
        any: `check_sendable` made sure there is one)."""
        with self._lock:
            able = [s for s in self.servers if not images or takes_images(s)]
            server = min(able, key=lambda s: s.in_flight)
            server.in_flight += 1
        try:
            info = server.info
            assert info is not None
            if info.kind == "sglang":
                if params.truncates:
                    raise UserError(f"top_p / top_k / min_p with the SGLang server at {server.url}: SGLang returns the "
                                    "log-prob of the untruncated distribution, not of the one it sampled from")
                return self._sample_sglang(server, prompt, params, seed)
            if info.generate_route == VLLM_GENERATE:
                return self._sample_vllm_generate(server, prompt, params, seed, images)
            return self._sample_vllm_completions(server, prompt, params, seed)
        finally:
            with self._lock:
                server.in_flight -= 1

    def _sample_vllm_generate(self, server: Server, prompt: list[int], params: SamplingParams,
                              seed: int | None, images: tuple[ImageSpan, ...] = ()) -> list[Completion]:
        """vLLM's token-in/token-out route: sample j gets seed + j (vLLM's own rule), versions per token. Images go
        as content parts (PNG data URLs) beside the prompt with each image's placeholders collapsed to one token:
        vLLM's processor expands them again, and the ids and places it answers with must be the trainer's."""
        body = {"model": self.model, "token_ids": prompt, "sampling_params": vllm_sampling(params, seed) | {
            "logprobs": 0, "detokenize": False}}
        if images:
            images = tuple(sorted(images, key=lambda span: span.start))  # the content parts in the prompt's order
            body |= {"token_ids": collapsed(prompt, images), "return_token_ids": True,
                     "content_parts": [{"type": "image_url", "url": data_url(span)} for span in images]}
        answer = self._post(server, VLLM_GENERATE, body)
        if images:
            check_expanded(server, answer, prompt, images)
        choices = self._choices(server, answer, params.n)
        return [vllm_generate_completion(c, self.version) for c in choices]

    def _sample_vllm_completions(self, server: Server, prompt: list[int], params: SamplingParams,
                                 seed: int | None) -> list[Completion]:
        """vLLM's OpenAI route: the same samples, every token tagged with the version the client pushed last."""
        answer = self._post(server, "/v1/completions", {
            "model": self.model, "prompt": prompt, **vllm_sampling(params, seed), "logprobs": 0,
            "return_token_ids": True, "include_stop_str_in_output": True})
        return [completions_choice(c, self.version) for c in self._choices(server, answer, params.n)]

    def _sample_sglang(self, server: Server, prompt: list[int], params: SamplingParams,
                       seed: int | None) -> list[Completion]:
        """SGLang's native route: the prompt once per sample, each with its own seed."""
        samples = []
        for j in range(params.n):
            sampling = {"max_new_tokens": params.max_new_tokens, "temperature": params.temperature,
                        "top_p": params.top_p, "top_k": params.top_k or -1, "min_p": params.min_p,
                        "stop_token_ids": list(params.stop_token_ids), "skip_special_tokens": False,
                        "no_stop_trim": True}
            if seed is not None:
                sampling["sampling_seed"] = sample_seed(seed, j)
            samples.append(sampling)
        answer = self._post(server, "/generate", {"input_ids": [prompt] * params.n, "sampling_params": samples,
                                                  "return_logprob": True, "logprob_start_len": -1})
        items = answer if isinstance(answer, list) else [answer]
        if len(items) != params.n:
            raise ServerError(f"{server.url}/generate: asked for {params.n} samples, got {len(items)} "
                              f"(rollout.server_type={self._kind(server)})")
        return [sglang_completion(item, self.version) for item in items]

    def _choices(self, server: Server, answer: dict[str, Any], n: int) -> list[dict[str, Any]]:
        """The n choices of an OpenAI-shaped answer, in sample order."""
        choices = answer.get("choices")
        if not isinstance(choices, list) or len(choices) != n:
            got = len(choices) if isinstance(choices, list) else "no"
            raise ServerError(f"{server.url}: asked for {n} samples, got {got} choices "
                              f"(rollout.server_type={self._kind(server)})")
        return sorted(choices, key=lambda c: c.get("index", 0))

    # ------------------------------------------------------------------ weights
    def push_weights(self, path: str, version: int, pause: str = "wait") -> None:
        """Have every server load the checkpoint at `path` (a path on the servers' machine) as `version`, then
        check that each reports it. `pause`: what happens to generations in flight (see the module docstring)."""
        if pause not in PAUSE_MODES:
            raise ValueError(f"pause must be one of {PAUSE_MODES}, got {pause!r}")
        if any(s.info is None for s in self.servers):
            self.connect()
        for server in self.servers:
            if server.info.kind == "vllm":  # type: ignore[union-attr]
                reported = self._push_vllm(server, path, version, pause)
            else:
                reported = self._push_sglang(server, path, version, pause)
            if str(reported) != str(version):
                raise ServerError(f"{server.url}: after loading {path!r} as weight version {version} the server "
                                  f"reports version {reported!r} (rollout.server_type={self._kind(server)})")
        self.version = version

    def _push_vllm(self, server: Server, path: str, version: int, pause: str) -> str:
        """Pause, reload in place, tag, resume (also when a step failed); the version the server then reports."""
        with self._resumed(server, "/resume"):
            self._post(server, f"/pause?mode={pause}", {}, timeout=self.push_timeout)  # `wait` drains in-flight work
            try:
                self._post(server, "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": path}},
                           timeout=self.push_timeout)
            except ServerError as e:
                raise ServerError(f"{e}; a failed reload leaves vLLM's weights half loaded: restart the server",
                                  status=e.status) from None
            self._post(server, "/update_weight_version", {"new_version": str(version)})
        return str(self._get(server, "/weight_info").get("weight_version"))

    def _push_sglang(self, server: Server, path: str, version: int, pause: str) -> str:
        """Load from disk (its requests in flight finish first, or are retracted and resumed on the new weights);
        the version the server then reports."""
        if pause == "keep":
            with self._resumed(server, "/continue_generation"):
                self._post(server, "/pause_generation", {"mode": "retract"}, timeout=self.push_timeout)
                self._post(server, "/update_weights_from_disk", {"model_path": path, "weight_version": str(version)},
                           timeout=self.push_timeout)
        else:
            self._post(server, "/update_weights_from_disk", {"model_path": path, "weight_version": str(version)},
                       timeout=self.push_timeout)
        return str(self._get(server, "/model_info").get("weight_version"))

    @contextlib.contextmanager
    def _resumed(self, server: Server, route: str) -> Iterator[None]:
        """Resume the server after the block, however it ends; when the block failed, its error is the one raised
        (a server that died fails the resume too, and the first error says more)."""
        try:
            yield
        except BaseException:
            with contextlib.suppress(ServerError):
                self._post(server, route, {})
            raise
        self._post(server, route, {})

    # ------------------------------------------------------------------ HTTP
    def _kind(self, server: Server) -> str:
        return server.info.kind if server.info is not None else self.server_type

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers

    def _post(self, server: Server, path: str, body: dict[str, Any], timeout: float | None = None) -> Any:
        return self._request(server, path, json.dumps(body).encode(), timeout)

    def _get(self, server: Server, path: str) -> Any:
        return self._request(server, path, None)

    def _request(self, server: Server, path: str, data: bytes | None, timeout: float | None = None) -> Any:
        """POST `data` (GET when None) and the JSON answer ({} for an empty body); a ServerError in one line.
        `timeout`: seconds to wait for the answer (default: the client's per-request timeout)."""
        url = server.url + path
        method = "GET" if data is None else "POST"
        request = urllib.request.Request(url, data=data, headers=self._headers(), method=method)
        where = f"{method} {url} (rollout.server_type={self._kind(server)})"
        try:
            with urllib.request.urlopen(request, timeout=timeout or self.timeout) as response:
                raw = response.read()
        except urllib.error.HTTPError as e:
            raise ServerError(f"{where}: HTTP {e.code}: {error_message(e.read())}", status=e.code) from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as e:  # refused, reset, cut off mid-answer,
            # timed out: the server died or hangs
            reason = getattr(e, "reason", None) or e
            raise ServerError(f"{where}: no answer ({reason})") from None
        try:
            return json.loads(raw) if raw.strip() else {}
        except ValueError:
            raise ServerError(f"{where}: the answer is not JSON: {raw[:200]!r}") from None


# ---------------------------------------------------------------------------------------------- request fields
def takes_images(server: Server) -> bool:
    """Whether treerl sends images to this server: vLLM's token-in/token-out route, whose prompts carry content
    parts (SGLang's /generate and vLLM's /v1/completions are not tried against a real server here)."""
    return server.info is not None and server.info.generate_route == VLLM_GENERATE


def check_sendable(images: list[tuple[ImageSpan, ...]] | list[tuple], servers: list[Server]) -> None:
    """Before any request: some server takes images, and every image has its source to send."""
    if not any(takes_images(s) for s in servers):
        first = servers[0]
        raise UserError(SERVER_IMAGES.format(server=f"the {first.info.kind if first.info else ''} server at {first.url}"))
    if any(span.source is None for spans in images for span in spans):
        raise UserError("an image to send to an inference server has no source (ImageSpan.source, the image's PNG "
                        "bytes): ChatFormat keeps it where it expands the images' ids itself (Qwen-VL, LLaVA); Gemma "
                        "3's prompts, expanded in their text, are not sent to servers")


def collapsed(prompt: list[int], images: tuple[ImageSpan, ...]) -> list[int]:
    """The prompt with each image's placeholder tokens (`images` in the prompt's order) collapsed to the first: as
    the chat template writes it."""
    out, last = [], 0
    for span in images:
        out += prompt[last : span.start + 1]
        last = span.end
    return out + prompt[last:]


def data_url(span: ImageSpan) -> str:
    """The image as a base64 PNG data URL."""
    assert span.source is not None
    return "data:image/png;base64," + base64.b64encode(span.source).decode()


def check_expanded(server: Server, answer: dict[str, Any], prompt: list[int], images: tuple[ImageSpan, ...]) -> None:
    """vLLM expanded the images (in the prompt's order) as the trainer did: the same prompt ids and image places (else
    its processor, e.g. another preprocessor config or resize, sees other images than the ones trained on)."""
    ids = answer.get("prompt_token_ids")
    if not (answer.get("mm_placeholders") or {}).get("image"):
        raise ServerError(f"{server.url}{VLLM_GENERATE}: the server answered without placing the prompt's images "
                          "(no mm_placeholders): it does not take images on this route (a vLLM 0.32 server does)")
    places = [(p.get("offset"), p.get("length")) for p in answer["mm_placeholders"]["image"]]
    ours = [(span.start, span.length) for span in images]
    if ids != prompt or places != ours:
        raise ServerError(f"{server.url}: the server's processor expanded the prompt's images into other tokens than "
                          f"the trainer's (image places {places}, the trainer's {ours}; {len(ids or [])} prompt tokens, "
                          f"the trainer's {len(prompt)}): serve the checkpoint whose preprocessor_config.json the "
                          "trainer reads (model.path)")


def prompt_seed(seed: int, index: int) -> int:
    """The seed of prompt `index` of a call seeded `seed`: no two prompts share a random stream."""
    return rng_for("prompt", seed, index).getrandbits(62)


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample `index` of a prompt seeded `seed`, for SGLang (which gives a request's n samples one seed;
    vLLM gives sample j the seed + j itself)."""
    return rng_for("sample", seed, index).getrandbits(62)


def vllm_sampling(params: SamplingParams, seed: int | None) -> dict[str, Any]:
    """vLLM's sampling fields (the same names on both of its routes)."""
    fields: dict[str, Any] = {"n": params.n, "max_tokens": params.max_new_tokens, "temperature": params.temperature,
                              "top_p": params.top_p, "min_p": params.min_p, "stop_token_ids": list(params.stop_token_ids),
                              "skip_special_tokens": False}
    if params.top_k:
        fields["top_k"] = params.top_k
    if seed is not None:
        fields["seed"] = seed
    return fields


# ---------------------------------------------------------------------------------------------- answers
def vllm_generate_completion(choice: dict[str, Any], version: int) -> Completion:
    """A choice of vLLM's /inference/v1/generate: token ids, `logprobs.content[i].logprob`, weight version spans."""
    tokens = choice.get("token_ids")
    content = (choice.get("logprobs") or {}).get("content")
    if not isinstance(tokens, list) or not isinstance(content, list):
        raise ServerError(f"choice {choice.get('index')}: no token ids or log-probs in vLLM's answer")
    logprobs = [float(entry["logprob"]) for entry in content]
    versions = span_versions(choice.get("weight_versions"), len(tokens), version)
    return checked_completion(choice.get("index"), tokens, logprobs, choice.get("finish_reason"), versions)


def completions_choice(choice: dict[str, Any], version: int) -> Completion:
    """A choice of an OpenAI /v1/completions answer (vLLM's shape: `token_ids`, `logprobs.token_logprobs`)."""
    logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
    tokens = choice.get("token_ids")
    if tokens is None or logprobs is None or any(lp is None for lp in logprobs):
        raise ServerError(f"choice {choice.get('index')}: no token ids or per-token log-probs in the answer (the "
                          "server must honour 'return_token_ids' and 'logprobs')")
    return checked_completion(choice.get("index"), tokens, [float(lp) for lp in logprobs], choice.get("finish_reason"),
                              [version] * len(tokens))


def sglang_completion(item: dict[str, Any], version: int) -> Completion:
    """One item of SGLang's /generate answer: `output_ids`, `meta_info.output_token_logprobs` as
    [logprob, token_id, text] triples, `meta_info.finish_reason` as {"type": ...}, weight version spans."""
    meta = item.get("meta_info") or {}
    tokens = item.get("output_ids")
    triples = meta.get("output_token_logprobs")
    if not isinstance(tokens, list) or not isinstance(triples, list):
        raise ServerError("SGLang's answer has no output_ids or meta_info.output_token_logprobs")
    if [int(t[1]) for t in triples] != list(tokens):
        raise ServerError("SGLang's log-probs are not those of its output_ids")
    finish = (meta.get("finish_reason") or {}).get("type")
    versions = span_versions(meta.get("weight_versions"), len(tokens), version)
    return checked_completion(meta.get("id"), tokens, [float(t[0]) for t in triples], finish, versions)


def span_versions(spans: Any, count: int, version: int) -> list[int]:
    """Per-token versions from a server's [{"version", "start", "end"}] spans; none reported: `version` for all.
    A server not yet pushed to says "default": the weights it started with, which the client counts as `version`."""
    if not spans:
        return [version] * count
    versions = [version] * count
    for span in spans:
        label = span["version"]
        try:
            value = version if label == "default" else int(label)
        except (TypeError, ValueError):
            raise ServerError(f"the server tags tokens with weight version {label!r}, not one treerl pushed (another "
                              "client loads weights into it?)") from None
        versions[span["start"] : span["end"]] = [value] * (span["end"] - span["start"])
    return versions


def checked_completion(index: Any, tokens: list[int], logprobs: list[float], finish: Any,
                       versions: list[int]) -> Completion:
    """A Completion from a server's parts, or a ServerError saying what does not fit."""
    if len(tokens) != len(logprobs):
        raise ServerError(f"choice {index}: {len(tokens)} token ids but {len(logprobs)} log-probs")
    if finish == "abort":
        raise ServerError(f"choice {index}: the server aborted the generation (paused with mode=abort, or "
                          "/abort_request by another client)")
    if finish not in ("stop", "length"):
        raise ServerError(f"choice {index}: finish_reason {finish!r} (expected 'stop' or 'length')")
    return Completion(list(tokens), logprobs, finish, versions)


def error_message(raw: bytes) -> str:
    """The message of an error body: OpenAI's {"error": {"message"}}, SGLang's flat {"message"}, FastAPI's
    {"detail"}; otherwise the body's start."""
    try:
        body = json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")[:500]
    if not isinstance(body, dict):
        return str(body)[:500]
    if isinstance(body.get("error"), dict):
        return str(body["error"].get("message", body))
    return str(body.get("message", body.get("detail", body.get("error", body))))
