"""`treerl serve` as a real process on loopback: the client gets what the embedded sampler gives."""

from __future__ import annotations

import pytest
import torch
from support import treerl_serve

from treerl.engine import FlatEngine, PolicyHead
from treerl.models import build_model
from treerl.rollout import CompletionsClient, EmbeddedSampler, SamplingParams, ServerError
from treerl.tree import TokenSequence

pytestmark = pytest.mark.slow

SEED = 3  # the random-init weights the server builds (--seed)


@pytest.fixture(scope="module")
def server():
    """`python -m treerl.cli.main serve` with a tiny float64 model; killed whatever the tests do."""
    with treerl_serve("--dtype", "float64", "--seed", str(SEED), "--served-model-name", "tiny") as url:
        yield url


@pytest.fixture(scope="module")
def same_model(tokenizer):
    """The model the server runs, built here with the same shape, vocabulary and seed."""
    return build_model(shape="tiny-qwen3", vocab_size=len(tokenizer), dtype=torch.float64, seed=SEED)


def _prompts(tokenizer):
    return [tokenizer.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True,
                                          return_dict=False) for c in ("3+4=", "guess 1-9", "x")]


def test_server_completions_equal_the_embedded_sampler(server, tokenizer, same_model):
    """Same seed: identical tokens, log-probs and finish reasons; the server adds its eos stop like vLLM."""
    params = SamplingParams(n=3, max_new_tokens=8, temperature=0.9, stop_token_ids=(tokenizer.eos_token_id,), seed=11)
    remote = CompletionsClient(server, model="tiny").generate(_prompts(tokenizer), params)
    local = EmbeddedSampler(same_model).generate(_prompts(tokenizer), params)
    assert len(remote) == 3
    for remote_group, local_group in zip(remote, local):
        assert len(remote_group) == 3
        for r, l in zip(remote_group, local_group):
            assert r.tokens == l.tokens and r.finish_reason == l.finish_reason
            torch.testing.assert_close(torch.tensor(r.logprobs), torch.tensor(l.logprobs), rtol=1e-12, atol=1e-12)
            assert r.versions == [0] * len(r.tokens)


def test_split_requests_keep_prompt_order_and_logprob_semantics(server, tokenizer, same_model):
    """Prompts split over concurrent requests come back in order; log-probs are the trainer's recomputation."""
    prompts = _prompts(tokenizer)
    params = SamplingParams(n=2, max_new_tokens=8, temperature=0.7, seed=4)
    groups = CompletionsClient(server, prompts_per_request=1).generate(prompts, params)
    sequences = [TokenSequence(p + c.tokens) for p, g in zip(prompts, groups) for c in g]
    recomputed = FlatEngine(head=PolicyHead(temperature=0.7)).forward(same_model, sequences)
    starts = [len(p) for p in prompts for _ in range(2)]
    for start, c, out in zip(starts, [c for g in groups for c in g], recomputed, strict=True):
        torch.testing.assert_close(torch.tensor(c.logprobs, dtype=torch.float64), out["logprobs"][start:])


def test_bad_request_is_reported_with_the_server_message(server):
    with pytest.raises(ServerError, match="outside the vocabulary"):
        CompletionsClient(server).generate([[10**6]], SamplingParams())


def test_update_weights_from_disk_changes_samples_and_version(server, tokenizer, same_model, tmp_path):
    """Weights pushed from a checkpoint directory are used for the next request, with the new version."""
    other = build_model(shape="tiny-qwen3", vocab_size=len(tokenizer), dtype=torch.float64, seed=SEED + 1)
    other.save_pretrained(tmp_path / "other")
    same_model.save_pretrained(tmp_path / "original")
    client = CompletionsClient(server)
    try:
        client.update_weights_from_disk(str(tmp_path / "other"), version=5)
        params = SamplingParams(n=2, max_new_tokens=6, seed=1)
        remote = client.generate(_prompts(tokenizer), params)
        local = EmbeddedSampler(other).generate(_prompts(tokenizer), params)
        assert [[c.tokens for c in g] for g in remote] == [[c.tokens for c in g] for g in local]
        assert all(c.versions == [5] * len(c.tokens) for g in remote for c in g)
        with pytest.raises(ServerError, match="could not load weights"):
            client.update_weights_from_disk(str(tmp_path / "missing"), version=6)
    finally:  # the other tests expect the server's original weights and version 0
        client.update_weights_from_disk(str(tmp_path / "original"), version=0)


def test_vllm_reload_protocol_changes_samples_and_version(server, tokenizer, same_model, tmp_path):
    """vLLM's dev-mode reload (pause, collective_rpc update_config + reload_weights, update_weight_version, resume),
    as `treerl serve` answers it: the next samples come from the new weights, tagged with the new version."""
    other = build_model(shape="tiny-qwen3", vocab_size=len(tokenizer), dtype=torch.float64, seed=SEED + 2)
    other.save_pretrained(tmp_path / "other")
    same_model.save_pretrained(tmp_path / "original")
    client = CompletionsClient(server, server_type="vllm")
    try:
        client.update_weights_from_disk(str(tmp_path / "other"), version=9)
        params = SamplingParams(n=2, max_new_tokens=6, seed=2, stop_token_ids=(tokenizer.eos_token_id,))
        remote = client.generate(_prompts(tokenizer), params)
        local = EmbeddedSampler(other).generate(_prompts(tokenizer), params)
        assert [[c.tokens for c in g] for g in remote] == [[c.tokens for c in g] for g in local]
        assert all(c.versions == [9] * len(c.tokens) for g in remote for c in g)
        assert client._get("/weight_info") == {"weight_version": "9"}
        assert CompletionsClient(server)._get("/get_weight_version") == {"weight_version": "9"}
        with pytest.raises(ServerError, match="reload_weights"):
            client.update_weights_from_disk(str(tmp_path / "missing"), version=10)
    finally:
        CompletionsClient(server).update_weights_from_disk(str(tmp_path / "original"), version=0)


@pytest.mark.parametrize("server_type", ["sglang", "vllm"])
def test_a_server_reporting_another_version_is_an_error(server, tmp_path, same_model, server_type, monkeypatch):
    """After a reload the client reads the version back; a server that did not take it is an error, not a silent
    mismatch between the versions the trainer records and the weights that sampled."""
    same_model.save_pretrained(tmp_path / "original")
    client = CompletionsClient(server, server_type=server_type)
    monkeypatch.setattr(client, "_get", lambda path: {"weight_version": "41"})
    try:
        with pytest.raises(ServerError, match="reports weight version '41'"):
            client.update_weights_from_disk(str(tmp_path / "original"), version=42)
        assert client.version == 0
    finally:
        CompletionsClient(server).update_weights_from_disk(str(tmp_path / "original"), version=0)
