"""`treerl serve`'s limits: API key, request sizes refused before any work, generations that stop (client gone,
deadline, shutdown) and free the model, weight updates that succeed whole or change nothing."""

from __future__ import annotations

import json
import re
import signal
import socket
import time
import urllib.parse

import pytest
import torch
from fastapi.testclient import TestClient
from support import treerl_serve_process

from treerl.models import build_model
from treerl.rollout import CompletionsClient, EmbeddedSampler, SamplingParams
from treerl.rollout.sampling.embedded import GenerationCancelled
from treerl.rollout.serving.server import Guard, build_app

KEY = "s3cret-key"


@pytest.fixture
def served(tokenizer):
    """A tiny model behind the app with an API key; returns (client, sampler)."""
    sampler = EmbeddedSampler(build_model(shape="tiny-qwen3", vocab_size=len(tokenizer), seed=0))
    app = build_app(sampler, tokenizer, "tiny", Guard(api_key=KEY, max_n=4, max_tokens=32, max_prompts=2,
                                                     request_timeout=30))
    with TestClient(app) as client:
        yield client, sampler


def ask(client, key: str | None = KEY, path: str = "/v1/completions", **body):
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    return client.post(path, json={"prompt": [1, 2, 3], "max_tokens": 2, **body}, headers=headers)


def snapshot(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_every_endpoint_but_health_needs_the_key(served):
    client, _ = served
    assert client.get("/health").status_code == 200
    for key in (None, "wrong", ""):
        answer = ask(client, key)
        assert answer.status_code == 401
        assert "Authorization: Bearer <key>" in answer.json()["error"]["message"]
        assert ask(client, key, "/collective_rpc", method="reload_weights").status_code == 401
    assert client.get("/v1/models").status_code == 401
    assert client.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert ask(client).status_code == 200


@pytest.mark.parametrize("body, message", [
    ({"n": 1000}, r"n=1000 is more than this server allows \(4; treerl serve --max-n raises it\)"),
    ({"max_tokens": 10**9}, r"max_tokens=1000000000 is more than this server allows \(32; .*--max-tokens"),
    ({"prompt": [[1], [2], [3]]}, r"prompts=3 is more than this server allows \(2; .*--max-prompts"),
    ({"prompt": [1] * 32760, "max_tokens": 30}, r"a prompt of 32760 tokens plus max_tokens=30 is more than the model's"),
    ({"prompt": [10**6]}, r"outside the vocabulary"),
    ({"stream": True}, r"does not support 'stream'"),
])
def test_requests_over_a_limit_are_refused_before_any_work(served, monkeypatch, body, message):
    client, sampler = served
    calls = []
    original = sampler.generate
    monkeypatch.setattr(sampler, "generate", lambda *a, **k: calls.append(1) or original(*a, **k))
    answer = ask(client, **body)
    assert answer.status_code == 400
    assert re.search(message, answer.json()["error"]["message"])
    if "vocabulary" not in message:
        assert not calls  # refused before the model was touched


def test_a_generation_past_the_deadline_stops_and_frees_the_model(tokenizer):
    """request_timeout=0.5 s: a generation of 30000 tokens answers 504 at once, and the next request is served."""
    sampler = EmbeddedSampler(build_model(shape="tiny-qwen3", vocab_size=len(tokenizer)))
    cancelled: list[str] = []
    generate = sampler.generate

    def recording(*args, **kwargs):
        try:
            return generate(*args, **kwargs)
        except GenerationCancelled as stopped:
            cancelled.append(str(stopped))
            raise

    sampler.generate = recording  # type: ignore[method-assign]
    with TestClient(build_app(sampler, tokenizer, guard=Guard(max_tokens=10**6, request_timeout=0.5))) as client:
        answer = ask(client, None, max_tokens=30000, ignore_eos=True)
        assert answer.status_code == 504 and "--request-timeout" in answer.json()["error"]["message"]
        assert ask(client, None).status_code == 200  # the model was free again
    assert len(cancelled) == 1 and re.search(r"after \d+ of 30000 tokens", cancelled[0]), cancelled


def test_generate_stops_when_asked(tokenizer):
    sampler = EmbeddedSampler(build_model(shape="tiny-qwen3", vocab_size=len(tokenizer)))
    asked = []

    def cancelled() -> bool:
        asked.append(1)
        return len(asked) > 3

    with pytest.raises(GenerationCancelled, match="after 3 of 100 tokens"):
        sampler.generate([[1, 2]], SamplingParams(max_new_tokens=100), cancelled=cancelled)


def save_model(path, tokenizer, **kwargs):
    model = build_model(shape=kwargs.pop("shape", "tiny-qwen3"), vocab_size=len(tokenizer), **kwargs)
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("protocol", ["vllm", "sglang"])
def test_a_weight_update_succeeds_whole_or_changes_nothing(tokenizer, tmp_path, protocol):
    """Every refused checkpoint leaves the weights and the version as they were (vLLM answers HTTP 500 through
    collective_rpc, SGLang 400 with success false); a good one changes both."""
    sampler = EmbeddedSampler(build_model(shape="tiny-qwen3", vocab_size=len(tokenizer), seed=0))
    before = snapshot(sampler.model)
    other = save_model(tmp_path / "other", tokenizer, seed=1)
    save_model(tmp_path / "llama", tokenizer, shape="tiny-llama")
    nan = save_model(tmp_path / "nan", tokenizer, seed=2)
    with torch.no_grad():
        nan.model.norm.weight[0] = float("nan")
    nan.save_pretrained(tmp_path / "nan")
    (tmp_path / "empty").mkdir()
    bad = [
        (str(tmp_path / "missing"), "is not a directory"),
        (str(tmp_path / "empty"), "no model.safetensors"),
        (str(tmp_path / "llama"), "do not fit the served model"),
        (str(tmp_path / "nan"), "model.norm.weight holds NaN or inf"),
    ]
    with TestClient(build_app(sampler, tokenizer, "tiny", protocol=protocol)) as client:
        def load(path: str):
            if protocol == "vllm":
                return client.post("/collective_rpc", json={"method": "reload_weights",
                                                            "kwargs": {"weights_path": path}})
            return client.post("/update_weights_from_disk", json={"model_path": path, "weight_version": "3"})

        def version() -> str:
            return client.get("/weight_info" if protocol == "vllm" else "/model_info").json()["weight_version"]

        for path, message in bad:
            answer = load(path)
            assert answer.status_code == (500 if protocol == "vllm" else 400), answer.text
            assert message in answer.text
            assert all(torch.equal(before[k], v) for k, v in sampler.model.state_dict().items())  # nothing changed
            assert version() == "default"
        assert load(str(tmp_path / "other")).status_code == 200
        assert all(torch.equal(other.state_dict()[k], v) for k, v in sampler.model.state_dict().items())
        assert version() == ("default" if protocol == "vllm" else "3")  # vLLM sets it with /update_weight_version


def post_and_leave(url: str, body: dict, key: str | None = None) -> None:
    """Send a completions request on a raw socket and close it without reading the answer (a client that left)."""
    parts = urllib.parse.urlparse(url)
    payload = json.dumps(body).encode()
    headers = f"POST /v1/completions HTTP/1.1\r\nHost: {parts.hostname}\r\nContent-Type: application/json\r\n" \
              f"Content-Length: {len(payload)}\r\n" + (f"Authorization: Bearer {key}\r\n" if key else "") + "\r\n"
    with socket.create_connection((parts.hostname, parts.port)) as s:
        s.sendall(headers.encode() + payload)
        time.sleep(1.0)  # it is generating now


@pytest.mark.slow
def test_a_client_that_leaves_frees_the_model_and_sigterm_stops_the_server_promptly():
    long = {"prompt": [1, 2, 3], "max_tokens": 32000, "ignore_eos": True}  # a minute of decoding or more
    with treerl_serve_process("--max-tokens", str(10**6), "--request-timeout", "3600") as (process, url):
        post_and_leave(url, long)
        started = time.monotonic()
        CompletionsClient(url, timeout=30).generate([[1, 2]], SamplingParams(max_new_tokens=2))
        assert time.monotonic() - started < 15  # not a million tokens later
        parts = urllib.parse.urlparse(url)
        with socket.create_connection((parts.hostname, parts.port)) as s:  # a long generation in progress ...
            payload = json.dumps(long).encode()
            s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
            time.sleep(1.0)
            process.send_signal(signal.SIGTERM)  # ... does not keep the server alive
            started = time.monotonic()
            process.wait(timeout=20)
        assert time.monotonic() - started < 4  # the generation stopped (uvicorn alone would wait 5 s, then cut it)
