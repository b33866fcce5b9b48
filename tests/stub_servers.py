"""Stand-ins for inference servers, for tests of what the client does with what a server answers: a stub answering
fixed or computed JSON per path, and the answers of a vLLM 0.32 started with the docs' flags."""

from __future__ import annotations

import contextlib
import http.server
import json
import threading
from collections.abc import Iterator

from treerl.rollout.sampling.client import VLLM_RL_ROUTES


@contextlib.contextmanager
def stub_server(answers: dict[str, object], calls: list | None = None) -> Iterator[str]:
    """An HTTP server answering GET/POST `path` with the JSON `answers[path]`, or `answers[path](request body)` when
    it is a function (HTTP 500 with its message if it raises; 404 for other paths); each (path, body) is appended to `calls`. Yields its URL."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _answer(self):
            path = self.path.split("?")[0]
            length = int(self.headers.get("Content-Length") or 0)
            request = json.loads(self.rfile.read(length) or b"{}") if length else {}
            if calls is not None:
                calls.append((self.path, request))
            answer, status = answers.get(path, {"detail": "Not Found"}), 200 if path in answers else 404
            try:
                answer = answer(request) if callable(answer) else answer
            except Exception as e:  # a computed answer that raises is an HTTP 500 with its message
                answer, status = {"error": {"message": str(e)}}, 500
            body = json.dumps(answer).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _answer

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def vllm_stub(version: list[str], scale_out: bool = True) -> dict[str, object]:
    """A vLLM 0.32 with the docs' flags, as the client sees it: RL routes, scale-out generation (unless `scale_out`
    is false), processed log-probs (they change with the temperature), one generated token per sample, tagged with
    the version set."""
    paths = {route: {} for route in (*VLLM_RL_ROUTES, "/v1/completions", "/inference/v1/generate")}
    if not scale_out:
        paths.pop("/inference/v1/generate")

    def completions(body):
        return {"choices": [{"index": 0, "logprobs": {"top_logprobs": [{"a": -0.5 / body["temperature"]}]}}]}

    def generate(body):
        if not body:  # the client's probe of whether the route is enabled
            return {}
        n = body["sampling_params"]["n"]
        return {"choices": [{"index": j, "token_ids": [7], "finish_reason": "length",
                             "weight_versions": [{"version": version[0], "start": 0, "end": 1}],
                             "logprobs": {"content": [{"token_id": 7, "logprob": -1.0}]}} for j in range(n)]}

    def set_version(body):
        version[0] = body["new_version"]
        return {"success": True, "new_version": body["new_version"]}

    answers = {"/health": {}, "/version": {"version": "0.32.0"}, "/openapi.json": {"paths": paths},
               "/v1/models": {"object": "list", "data": [{"id": "default", "object": "model"}]},
               "/v1/completions": completions, "/pause": {"status": "paused"}, "/resume": {"status": "resumed"},
               "/collective_rpc": {"results": [None]}, "/update_weight_version": set_version,
               "/weight_info": lambda body: {"weight_version": version[0]}}
    return answers | ({"/inference/v1/generate": generate} if scale_out else {})
