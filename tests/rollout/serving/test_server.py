"""`treerl serve` as a real process on loopback, in each protocol it imitates: the client reads what it is, gets what
the embedded sampler gives, pushes weights through its routes, and meets the refusals of the real servers."""

from __future__ import annotations

import json
import urllib.request
from dataclasses import replace

import pytest
import torch
from support import treerl_serve

from treerl.engine import FlatEngine, PolicyHead
from treerl.errors import ServerError, UserError
from treerl.models import build_model
from treerl.rollout import CompletionsClient, EmbeddedSampler, SamplingParams
from treerl.rollout.sampling.client import prompt_seed, sample_seed
from treerl.tree import TokenSequence

pytestmark = pytest.mark.slow

SEED = 3  # the random-init weights the server builds (--seed)


@pytest.fixture(scope="module", params=["vllm", "sglang"])
def server(request):
    """`python -m treerl.cli.main serve --protocol P` with a tiny float64 model; killed whatever the tests do."""
    with treerl_serve("--dtype", "float64", "--seed", str(SEED), "--served-model-name", "tiny",
                      "--protocol", request.param) as url:
        yield url, request.param


@pytest.fixture(scope="module")
def same_model(tokenizer):
    """The model the server runs, built here with the same shape, vocabulary and seed."""
    return build_model(shape="tiny-qwen3", vocab_size=len(tokenizer), dtype=torch.float64, seed=SEED)


def _prompts(tokenizer):
    return [tokenizer.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True,
                                          return_dict=False) for c in ("3+4=", "guess 1-9", "x")]


def _client(server, **kwargs) -> CompletionsClient:
    url, _ = server
    client = CompletionsClient(url, model="tiny", **kwargs)
    client.connect()
    return client


def _local(model, prompts, params: SamplingParams, protocol: str):
    """What the server samples, computed here: each prompt with its own seed (SGLang: each sample with its own)."""
    groups = []
    for p, prompt in enumerate(prompts):
        seed = prompt_seed(params.seed, p)
        if protocol == "vllm":
            groups.append(EmbeddedSampler(model).generate([prompt], replace(params, seed=seed))[0])
        else:
            groups.append([EmbeddedSampler(model).generate([prompt], replace(params, n=1, seed=sample_seed(seed, j)))[0][0]
                           for j in range(params.n)])
    return groups


def test_the_client_reads_which_protocol_it_speaks(server):
    url, protocol = server
    [info] = _client(server).connect()
    assert info.kind == protocol and info.release.endswith("+treerl") and info.versions_per_token
    assert info.generate_route == ("/inference/v1/generate" if protocol == "vllm" else "/generate")


def test_server_samples_equal_the_embedded_sampler(server, tokenizer, same_model):
    """Same seeds: identical tokens, log-probs and finish reasons; the server adds its eos stop as vLLM does."""
    params = SamplingParams(n=3, max_new_tokens=8, temperature=0.9, stop_token_ids=(tokenizer.eos_token_id,), seed=11)
    remote = _client(server).generate(_prompts(tokenizer), params)
    local = _local(same_model, _prompts(tokenizer), params, server[1])
    assert len(remote) == 3
    for remote_group, local_group in zip(remote, local):
        assert len(remote_group) == 3
        for r, l in zip(remote_group, local_group):
            assert r.tokens == l.tokens and r.finish_reason == l.finish_reason
            torch.testing.assert_close(torch.tensor(r.logprobs), torch.tensor(l.logprobs), rtol=1e-12, atol=1e-12)
            assert r.versions == [0] * len(r.tokens)


def test_logprobs_are_the_trainers_recomputation(server, tokenizer, same_model):
    prompts = _prompts(tokenizer)
    groups = _client(server).generate(prompts, SamplingParams(n=2, max_new_tokens=8, temperature=0.7, seed=4))
    sequences = [TokenSequence(p + c.tokens) for p, g in zip(prompts, groups) for c in g]
    recomputed = FlatEngine(head=PolicyHead(temperature=0.7)).forward(same_model, sequences)
    starts = [len(p) for p in prompts for _ in range(2)]
    for start, c, out in zip(starts, [c for g in groups for c in g], recomputed, strict=True):
        torch.testing.assert_close(torch.tensor(c.logprobs, dtype=torch.float64), out["logprobs"][start:])


def test_bad_request_is_reported_with_the_server_message(server):
    with pytest.raises(ServerError, match="outside the vocabulary"):
        _client(server).generate([[10**6]], SamplingParams())


def test_a_push_changes_samples_and_version_and_a_failed_one_changes_nothing(server, tokenizer, same_model, tmp_path):
    """Weights pushed through the protocol's routes are used for the next request, tagged with the new version; a
    push of a missing checkpoint is a ServerError naming the route, and the server keeps what it had."""
    other = build_model(shape="tiny-qwen3", vocab_size=len(tokenizer), dtype=torch.float64, seed=SEED + 1)
    other.save_pretrained(tmp_path / "other")
    same_model.save_pretrained(tmp_path / "original")
    client = _client(server)
    route = "/collective_rpc" if server[1] == "vllm" else "/update_weights_from_disk"
    try:
        client.push_weights(str(tmp_path / "other"), version=5)
        params = SamplingParams(n=2, max_new_tokens=6, seed=1, stop_token_ids=(tokenizer.eos_token_id,))
        remote = client.generate(_prompts(tokenizer), params)
        local = _local(other, _prompts(tokenizer), params, server[1])
        assert [[c.tokens for c in g] for g in remote] == [[c.tokens for c in g] for g in local]
        assert all(c.versions == [5] * len(c.tokens) for g in remote for c in g)
        with pytest.raises(ServerError, match=rf"POST {server[0]}{route} \(rollout.server_type={server[1]}\): HTTP"):
            client.push_weights(str(tmp_path / "missing"), version=6)
        assert [[c.tokens for c in g] for g in client.generate(_prompts(tokenizer), params)] == [
            [c.tokens for c in g] for g in local]
    finally:  # the other tests expect the server's original weights and version 0
        client.push_weights(str(tmp_path / "original"), version=0)


def test_a_server_reporting_another_version_is_an_error(server, tmp_path, same_model, monkeypatch):
    """After a push the client reads the version back; a server that did not take it is an error, not a silent
    mismatch between the versions the trainer records and the weights that sampled."""
    same_model.save_pretrained(tmp_path / "original")
    client = _client(server)
    monkeypatch.setattr(client, "_get", lambda server, path: {"weight_version": "41"})
    try:
        with pytest.raises(ServerError, match="reports version '41'"):
            client.push_weights(str(tmp_path / "original"), version=42)
        assert client.version == 0
    finally:  # the push itself went through: the server holds "42"; the other tests expect version 0
        monkeypatch.undo()
        client.push_weights(str(tmp_path / "original"), version=0)


def _post(url: str, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request) as answer:
            return answer.status, json.loads(answer.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def test_a_model_name_the_server_does_not_serve_is_refused_when_connecting(server):
    """rollout.server_model is read against GET /v1/models once, at connect, for either protocol (SGLang ignores the
    name in its requests, so it would sample whatever it serves); vLLM's routes answer 404 for an unknown name."""
    url, protocol = server
    with pytest.raises(UserError, match=rf"^rollout.server_model='no-such-model': the server at {url} serves 'tiny' "):
        CompletionsClient(url, model="no-such-model").connect()
    assert _client(server).servers[0].info.models == ("tiny",)
    if protocol == "vllm":
        status, body = _post(url, "/v1/completions", {"model": "no-such-model", "prompt": [1, 2], "max_tokens": 1})
        assert status == 404 and "no-such-model" in body["error"]["message"]


def test_what_the_real_server_refuses_is_refused(server):
    """vLLM 0.32 answers collective_rpc update_config with HTTP 500 (the protocol treerl used to push with); SGLang
    refuses an unknown sampling_params key, `seed` among them (its name is sampling_seed), with 400; neither serves
    the other's routes."""
    url, protocol = server
    if protocol == "vllm":
        status, body = _post(url, "/collective_rpc", {"method": "update_config",
                                                       "args": [{"model_config": {"model": "/tmp"}}]})
        assert status == 500 and "_hf_config_revision" in body["error"]["message"]
        assert _post(url, "/update_weights_from_disk", {"model_path": "/tmp"})[0] == 404
    else:
        status, body = _post(url, "/generate", {"input_ids": [1, 2], "sampling_params": {"seed": 3}})
        assert status == 400 and "unknown field `seed`" in body["message"] and body["object"] == "error"
        assert _post(url, "/collective_rpc", {"method": "reload_weights"})[0] == 404
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(url + "/get_weight_version")  # gone in SGLang 0.5.23: /model_info has it
