"""The server client: it reads vLLM's and SGLang's answer shapes, tells the servers apart by what they answer, refuses
one that cannot serve RL naming the flag it lacks, and fails clearly on anything else."""

from __future__ import annotations

import socket
import time

import pytest
from stub_servers import stub_server, vllm_stub

from treerl.errors import ServerError, UserError
from treerl.rollout import CompletionsClient, SamplingParams
from treerl.rollout.sampling.client import (
    VLLM_RL_ROUTES,
    completions_choice,
    sglang_completion,
    span_versions,
    vllm_generate_completion,
)


def vllm_choice(**overrides):
    """A choice of vLLM 0.32's /inference/v1/generate (the shape seen from the real server)."""
    choice = {"index": 0, "finish_reason": "stop", "stop_reason": 2, "token_ids": [17, 5, 2],
              "weight_versions": [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 3}],
              "logprobs": {"content": [{"token_id": t, "logprob": lp, "rank": 1, "top_logprobs": []}
                                       for t, lp in ((17, -0.25), (5, -1.0), (2, -1.5))]}}
    return choice | overrides


def sglang_item(**meta):
    """One item of SGLang 0.5.23's /generate answer (the shape of its source)."""
    info = {"id": "a1", "finish_reason": {"type": "stop", "matched": 2}, "weight_version": "4",
            "weight_versions": [{"version": "4", "start": 0, "end": 3}],
            "output_token_logprobs": [[-0.25, 17, None], [-1.0, 5, None], [-1.5, 2, None]]}
    return {"text": "7x", "output_ids": [17, 5, 2], "meta_info": info | meta}


def test_vllm_generate_choice_with_versions_per_token():
    completion = vllm_generate_completion(vllm_choice(), version=9)
    assert completion.tokens == [17, 5, 2] and completion.logprobs == [-0.25, -1.0, -1.5]
    assert completion.finish_reason == "stop" and completion.versions == [3, 3, 4]


def test_vllm_completions_choice_takes_the_version_the_client_pushed():
    choice = {"index": 0, "finish_reason": "length", "token_ids": [17, 5],
              "logprobs": {"tokens": ["7", "x"], "token_logprobs": [-0.25, -1.0]}}
    completion = completions_choice(choice, version=6)
    assert completion.tokens == [17, 5] and completion.versions == [6, 6] and completion.finish_reason == "length"


def test_sglang_item_with_versions_per_token():
    completion = sglang_completion(sglang_item(), version=0)
    assert completion.tokens == [17, 5, 2] and completion.logprobs == [-0.25, -1.0, -1.5]
    assert completion.versions == [4, 4, 4] and completion.finish_reason == "stop"
    assert sglang_completion(sglang_item(finish_reason={"type": "length", "length": 3}), 0).finish_reason == "length"


def test_version_spans():
    assert span_versions(None, 3, 7) == [7, 7, 7]
    assert span_versions([{"version": "default", "start": 0, "end": 2}, {"version": "8", "start": 2, "end": 3}], 3,
                         7) == [7, 7, 8]  # "default": the weights the server started with, not yet pushed to
    with pytest.raises(ServerError, match="weight version 'v-other'"):
        span_versions([{"version": "v-other", "start": 0, "end": 3}], 3, 7)


@pytest.mark.parametrize("parse, answer, message", [
    (vllm_generate_completion, vllm_choice(logprobs=None), "no token ids or log-probs"),
    (vllm_generate_completion, vllm_choice(token_ids=[17, 5]), "2 token ids but 3 log-probs"),
    (vllm_generate_completion, vllm_choice(finish_reason="abort"), "aborted the generation"),
    (vllm_generate_completion, vllm_choice(finish_reason="error"), "finish_reason 'error'"),
    (completions_choice, {"index": 0, "finish_reason": "stop", "token_ids": [1], "logprobs": None},
     "no token ids or per-token log-probs"),
    (sglang_completion, sglang_item(output_token_logprobs=[[-0.25, 17, None]]), "not those of its output_ids"),
    (sglang_completion, sglang_item(finish_reason={"type": "abort", "message": "Aborted"}), "aborted"),
])
def test_unusable_answers_are_clear_errors(parse, answer, message):
    with pytest.raises(ServerError, match=message):
        parse(answer, 0)


# ---------------------------------------------------------------------------------------------- telling servers apart
def test_vllm_without_dev_mode_is_refused_naming_the_flag():
    """A vLLM started without VLLM_SERVER_DEV_MODE=1 answers /version but serves none of the RL routes."""
    answers = {"/health": {}, "/version": {"version": "0.32.0"}, "/openapi.json": {"paths": {"/v1/completions": {}}}}
    with stub_server(answers) as url, pytest.raises(UserError, match="start it with VLLM_SERVER_DEV_MODE=1"):
        CompletionsClient(url).connect()


def test_vllm_with_raw_logprobs_is_refused_naming_the_flag():
    """vLLM's default --logprobs-mode returns the same log-prob at every temperature: refused when connecting."""
    paths = {route: {} for route in (*VLLM_RL_ROUTES, "/v1/completions")}
    raw = {"choices": [{"index": 0, "logprobs": {"top_logprobs": [{"a": -0.5, "b": -2.0}]}}]}
    answers = {"/health": {}, "/version": {"version": "0.32.0"}, "/openapi.json": {"paths": paths},
               "/v1/completions": raw, "/weight_info": {"weight_version": "default"},
               "/v1/models": {"data": [{"id": "default"}]}}
    with stub_server(answers) as url, pytest.raises(UserError, match="--logprobs-mode processed_logprobs"):
        CompletionsClient(url).connect()


def test_requests_are_balanced_over_several_servers_and_pushes_reach_every_one():
    """rollout.server_url as a list: prompts go to the server with the fewest requests in flight (both get some),
    and a push goes to every server, each checked."""
    calls_a, calls_b = [], []
    with stub_server(vllm_stub(["default"]), calls_a) as a, stub_server(vllm_stub(["default"]), calls_b) as b:
        client = CompletionsClient([a, b], max_concurrency=8)
        client.push_weights("/weights", version=3)
        groups = client.generate([[1, 2]] * 16, SamplingParams(n=2, max_new_tokens=1, seed=1))
    assert len(groups) == 16 and all(c.versions == [3] for g in groups for c in g)
    for calls in (calls_a, calls_b):
        generated = [body for path, body in calls if path == "/inference/v1/generate" and body]
        assert generated, "a server got no request"
        reloads = [body for path, body in calls if path == "/collective_rpc"]
        assert reloads == [{"method": "reload_weights", "kwargs": {"weights_path": "/weights"}}]
    seeds = {body["sampling_params"]["seed"] for calls in (calls_a, calls_b) for path, body in calls
             if path == "/inference/v1/generate" and body}
    assert len(seeds) == 16  # a seed of its own for every prompt


def test_a_failed_request_is_raised_at_once_not_after_the_other_servers_requests():
    """Server A answers its generations with HTTP 500, server B takes 20 s for each: the ServerError comes in about a
    second (B's requests are not waited for: an async worker waiting on them would be taken for hung)."""
    failing, slow = vllm_stub(["default"]), vllm_stub(["default"])
    failing["/inference/v1/generate"] = lambda body: {} if not body else (_ for _ in ()).throw(RuntimeError("dead"))
    generate = slow["/inference/v1/generate"]
    slow["/inference/v1/generate"] = lambda body: generate(body) if not body else (time.sleep(20), generate(body))[1]
    with stub_server(failing) as a, stub_server(slow) as b:
        client = CompletionsClient([a, b])
        client.connect()
        started = time.monotonic()
        with pytest.raises(ServerError, match=f"POST {a}/inference/v1/generate"):
            client.generate([[1, 2]] * 4, SamplingParams(n=1, max_new_tokens=1))
        assert time.monotonic() - started < 10


def test_a_server_that_is_neither_is_named_as_such():
    with stub_server({"/health": {}}) as url, pytest.raises(UserError, match="is neither vLLM .* nor SGLang"):
        CompletionsClient(url, setting="rollout.server_url").connect()


def test_an_unreachable_server_is_a_user_error_naming_the_setting():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = CompletionsClient(f"http://127.0.0.1:{port}", timeout=5)
    with pytest.raises(UserError, match=r"rollout.server_url='http://127.0.0.1:\d+': cannot reach the inference server"):
        client.generate([[1, 2]], SamplingParams())


def test_a_server_that_dies_mid_answer_is_a_server_error():
    """A server killed while it sends its answer (a body shorter than its Content-Length) is a ServerError naming the
    request, like one that never answers, not http.client's IncompleteRead."""
    import threading

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)

    def answer_half() -> None:
        conn, _ = listener.accept()
        request = b""
        while not request.endswith(b"{}"):  # the whole request read, so closing sends no reset
            request += conn.recv(65536)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"a\": 1")
        conn.close()

    threading.Thread(target=answer_half, daemon=True).start()
    client = CompletionsClient([f"http://127.0.0.1:{listener.getsockname()[1]}"], timeout=5)
    try:
        with pytest.raises(ServerError, match="no answer"):
            client._post(client.servers[0], "/pause", {})
    finally:
        listener.close()


def test_images_go_to_servers_that_take_them_collapsed_to_one_token_each():
    """Before any request: a prompt that shows images needs a server whose route takes them (vLLM's token-in/token-
    out) and each image's source; the prompt goes with each image's placeholders collapsed to the first, and the
    server's expansion must be the trainer's (else the server saw other images than the ones trained on)."""
    import torch

    from treerl.rollout.sampling.client import Server, ServerInfo, check_expanded, check_sendable, collapsed
    from treerl.tree import ImageSpan

    generate = Server("http://a", ServerInfo("vllm", "0.32.0", "/inference/v1/generate", True))
    completions = Server("http://b", ServerInfo("vllm", "0.32.0", "/v1/completions", False))
    sglang = Server("http://c", ServerInfo("sglang", "0.5", "/generate", True))
    span = ImageSpan(2, 3, torch.zeros(3, 4), source=b"png")
    prompt = [1, 5, 9, 9, 9, 6, 9, 9, 9, 7]
    shown = (span, ImageSpan(6, 3, torch.ones(3, 4), source=b"png"))
    assert collapsed(prompt, shown) == [1, 5, 9, 6, 9, 7]
    check_sendable([shown], [completions, generate])
    for servers in ([completions], [sglang]):
        with pytest.raises(UserError, match="vLLM's token-in/token-out route only"):
            check_sendable([shown], servers)
    with pytest.raises(UserError, match="has no source"):
        check_sendable([(ImageSpan(2, 3, torch.zeros(3, 4)),)], [generate])
    answer = {"prompt_token_ids": prompt, "mm_placeholders": {"image": [{"offset": 2, "length": 3},
                                                                        {"offset": 6, "length": 3}]}}
    check_expanded(generate, answer, prompt, shown)
    for wrong in ({**answer, "prompt_token_ids": prompt + [9]},
                  {**answer, "mm_placeholders": {"image": [{"offset": 2, "length": 3}]}}):
        with pytest.raises(ServerError, match="expanded the prompt's images into other tokens"):
            check_expanded(generate, wrong, prompt, shown)
    with pytest.raises(ServerError, match="without placing the prompt's images"):
        check_expanded(generate, {"prompt_token_ids": prompt}, prompt, shown)
