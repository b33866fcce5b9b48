"""The completions client reads vLLM's and SGLang's response shapes, and fails clearly on others."""

from __future__ import annotations

import socket

import pytest

from treerl.rollout import CompletionsClient, SamplingParams, ServerError
from treerl.rollout.client import _weight_version, parse_choice


def _choice(**overrides):
    choice = {"index": 0, "text": "7", "finish_reason": "stop", "token_ids": [17, 2],
              "logprobs": {"tokens": ["7", ""], "token_logprobs": [-0.25, -1.5], "top_logprobs": [], "text_offset": []}}
    choice.update(overrides)
    return choice


def test_vllm_and_sglang_choice_with_token_ids():
    completion = parse_choice(_choice(), version=4)
    assert completion.tokens == [17, 2] and completion.logprobs == [-0.25, -1.5]
    assert completion.finish_reason == "stop" and completion.versions == [4, 4]


def test_token_ids_from_return_tokens_as_token_ids_strings():
    choice = _choice(token_ids=None, logprobs={"tokens": ["token_id:17", "token_id:2"], "token_logprobs": [-1.0, -2.0]})
    assert parse_choice(choice, 0).tokens == [17, 2]


def test_a_trimmed_stop_token_is_restored():
    """A server that trims the matched stop token from token_ids but kept its log-prob (SGLang's default)."""
    choice = _choice(token_ids=[17], matched_stop=2)
    assert parse_choice(choice, 0).tokens == [17, 2]


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"logprobs": None}, "no per-token log-probs"),
        ({"logprobs": {"token_logprobs": [None, -1.0]}, "token_ids": [1, 2]}, "no per-token log-probs"),
        ({"token_ids": None, "logprobs": {"tokens": ["7", "x"], "token_logprobs": [-1.0, -1.0]}}, "no token ids"),
        ({"token_ids": [1, 2, 3]}, "3 token ids but 2 log-probs"),
        ({"finish_reason": "abort"}, "finish_reason 'abort'"),
    ],
)
def test_unusable_choices_are_clear_errors(overrides, message):
    with pytest.raises(ServerError, match=message):
        parse_choice(_choice(**overrides), 0)


def test_weight_version_from_metadata_or_default():
    assert _weight_version({"metadata": {"weight_version": "12"}}, 3) == 12
    assert _weight_version({"metadata": {"weight_version": "default"}}, 3) == 3
    assert _weight_version({}, 3) == 3


def test_unreachable_server_is_a_clear_error():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = CompletionsClient(f"http://127.0.0.1:{port}", timeout=5)
    with pytest.raises(ServerError, match="cannot reach the inference server"):
        client.generate([[1, 2]], SamplingParams())
