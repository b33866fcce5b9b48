"""`Rollout.collect(step)`: the trainer's one call per step, end to end with a tiny random-init policy."""

from __future__ import annotations

import http.server
import json
import threading

import pytest
import torch
from omegaconf import OmegaConf
from omegaconf.errors import ConfigAttributeError, ValidationError

from treerl.engine import FlatEngine, PolicyHead
from treerl.errors import UserError
from treerl.rollout import (
    CompletionsClient,
    EmbeddedSampler,
    Rollout,
    RolloutConfig,
    build_sampler,
    builtin_tokenizer,
    tool_format_warning,
)
from treerl.rollout.collect import server_client
from treerl.rollout.conversations.tokenizer import BUILTIN_CHAT_TEMPLATE, PLAIN_CHAT_TEMPLATE
from treerl.tree import PrefixTree, validate_sequences


def _same(a, b) -> bool:
    return [s.tokens.tolist() for s in a] == [s.tokens.tolist() for s in b] and [s.info for s in a] == [
        s.info for s in b
    ]


@pytest.mark.parametrize("task", ["arithmetic", "guess_number"])
def test_collect_is_valid_reproducible_and_rewarded(task, tokenizer, policy):
    config = RolloutConfig(task=task, prompts_per_step=4, group_size=4, seed=1)
    sampler = build_sampler(config, policy)
    sampler.version = 2
    rollout = Rollout(config, tokenizer, sampler)
    batch = rollout.collect(5)
    validate_sequences(batch.sequences, vocab_size=len(tokenizer))
    assert batch.stats.prompts == 4 and batch.stats.kept == batch.stats.samples > 0
    assert batch.stats.sequences == len(batch.sequences) and sum(batch.stats.dropped.values()) == 0
    # Every kept trajectory's reward is on its sequences, once; the mean is theirs (format credit: above zero).
    per_trajectory = {s.info["trajectory"]: s.info["reward"] for s in batch.sequences}
    assert len(per_trajectory) == batch.stats.kept and sorted(per_trajectory.values()) == sorted(batch.stats.rewards)
    mean = sum(per_trajectory.values()) / batch.stats.kept
    assert batch.stats.reward_mean == pytest.approx(mean) and mean > 0
    for seq in batch.sequences:
        generated = seq.fields["loss_mask"] == 1
        assert seq.fields["versions"][generated].eq(2).all() and seq.fields["versions"][~generated].eq(-1).all()
    assert _same(batch.sequences, Rollout(config, tokenizer, EmbeddedSampler(policy, version=2)).collect(5).sequences)
    assert not _same(batch.sequences, rollout.collect(6).sequences)
    assert PrefixTree.build(batch.sequences).stats().compression > 1


def test_behaviour_logprobs_are_what_the_trainer_recomputes(tokenizer, policy):
    config = RolloutConfig(task="guess_number", prompts_per_step=2, group_size=2, temperature=0.8)
    batch = Rollout(config, tokenizer, build_sampler(config, policy)).collect(0)
    outputs = FlatEngine(head=PolicyHead(temperature=0.8)).forward(policy, batch.sequences)
    for seq, out in zip(batch.sequences, outputs):
        mask = seq.fields["loss_mask"] == 1
        torch.testing.assert_close(out["logprobs"][mask], seq.fields["old_logprobs"][mask], rtol=1e-9, atol=1e-9)


def test_dataset_task_with_a_users_reward_that_sometimes_fails(tokenizer, policy, tmp_path, monkeypatch):
    (tmp_path / "data.jsonl").write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": i + 1}) + "\n"
                                                 for i in range(5)))
    (tmp_path / "user_reward_for_test.py").write_text(
        "def reward(prompt, completion, answer):\n"
        "    if len(completion) % 2:\n"
        "        raise ValueError('odd length')\n"
        "    return float(completion == str(answer))\n"
    )
    monkeypatch.chdir(tmp_path)
    config = RolloutConfig(task="dataset", data_path=str(tmp_path / "data.jsonl"),
                           reward_fn="user_reward_for_test:reward", prompts_per_step=3, group_size=4,
                           max_new_tokens=3)
    batch = Rollout(config, tokenizer, build_sampler(config, policy)).collect(0)
    stats = batch.stats
    assert stats.samples == 12 and stats.kept + stats.dropped["reward_raised"] == 12
    assert stats.dropped["reward_raised"] > 0 and len(batch.sequences) == stats.kept
    assert "odd length" in str(stats.dropped_samples[0])


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"task": "chess"}, "unknown task 'chess'"),
        ({"group_size": 0}, "rollout.group_size=0 must be >= 1"),
        ({"temperature": 0.0}, "rollout.temperature=0.0 must be > 0"),
        ({"top_p": 1.5}, "rollout.top_p"),
        ({"branch_at": [0]}, "rollout.branch_at"),
        ({"max_new_tokens": 0}, "rollout.max_new_tokens"),
        ({"task": "dataset"}, "needs rollout.data_path and rollout.reward_fn"),
        ({"task": "dataset", "data_path": "x.jsonl", "reward_fn": "no_such_module_q:fn"}, "cannot import"),
    ],
)
def test_bad_config_is_a_clear_error(overrides, message, tokenizer, policy):
    config = RolloutConfig(**overrides)
    with pytest.raises(ValueError, match=message):
        Rollout(config, tokenizer, EmbeddedSampler(policy))


def test_config_works_as_an_omegaconf_structured_config():
    """The trainer embeds RolloutConfig in its OmegaConf tree: typed, unknown keys refused."""
    config = OmegaConf.structured(RolloutConfig)
    config.merge_with_dotlist(["task=guess_number", "branch_at=[1,2]", "max_new_tokens=5"])
    rollout_config = OmegaConf.to_object(config)
    assert isinstance(rollout_config, RolloutConfig) and rollout_config.branch_at == [1, 2]
    rollout_config.check()
    with pytest.raises(ConfigAttributeError):
        config.merge_with_dotlist(["group_sise=4"])
    with pytest.raises(ValidationError):
        config.merge_with_dotlist(["group_size=many"])


def test_build_sampler_picks_the_server_client_or_needs_the_model():
    """A server that answers (here 501 to everything) is reached, then asked what it is: neither vLLM nor SGLang is a
    UserError naming rollout.server_url; one nobody listens on is a UserError too, before anything is sampled (it was
    a traceback at the first sample)."""
    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with pytest.raises(UserError, match=rf"rollout.server_url: {url} is neither vLLM"):
            build_sampler(RolloutConfig(server_url=url, server_model="m", request_timeout=3))
    finally:
        server.shutdown()
        server.server_close()
    client = server_client(RolloutConfig(server_url=[url, url + "0"], server_model="m", request_timeout=3))
    assert isinstance(client, CompletionsClient) and client.model == "m" and client.timeout == 3
    assert [s.url for s in client.servers] == [url, url + "0"]
    with pytest.raises(UserError, match=rf"rollout.server_url='{url}': cannot reach the inference server"):
        build_sampler(RolloutConfig(server_url=url))  # closed now
    with pytest.raises(ValueError, match="needs the model"):
        build_sampler(RolloutConfig())


def test_an_agent_task_whose_template_has_no_tool_call_format_is_warned_about():
    """rollout.tool_parser=auto on a template with no tool-call format treerl knows: the warning names the setting
    and the parsers it can be set to; a template that writes no tools at all is said to have every request with
    tools refused; nothing is said for a known format, a parser set by hand, or a task without an agent."""
    def tokenizer(template: str):
        made = builtin_tokenizer()
        made.chat_template = template
        return made

    unknown = tokenizer("{% if tools %}Tools: {{ tools | tojson }}\n{% endif %}" + PLAIN_CHAT_TEMPLATE)
    agent = RolloutConfig(task="agent_tools")
    said = tool_format_warning(agent, unknown)
    assert said is not None and said.startswith("rollout.tool_parser=auto found no tool-call format")
    assert "set rollout.tool_parser to the model's format, one of hermes, " in said and "qwen3_coder" in said
    blind = tool_format_warning(agent, tokenizer(PLAIN_CHAT_TEMPLATE))
    assert blind is not None and "writes no tools into the prompt: every request offering tools is refused" in blind
    assert tool_format_warning(agent, tokenizer(BUILTIN_CHAT_TEMPLATE)) is None
    assert tool_format_warning(RolloutConfig(task="agent_tools", tool_parser="hermes"), unknown) is None
    assert tool_format_warning(RolloutConfig(task="arithmetic"), tokenizer(PLAIN_CHAT_TEMPLATE)) is None
    # an environment whose episodes call tools through the proxy (a TRL class, verifiers) is an agent task too
    for env in ("trl:my_pkg.envs:Vault", ["reasoning_gym:leg_counting", "verifiers:my_tools"]):
        assert "every request offering tools is refused" in tool_format_warning(
            RolloutConfig(env=env), tokenizer(PLAIN_CHAT_TEMPLATE))
    assert tool_format_warning(RolloutConfig(env="textarena:GuessTheNumber-v0"), tokenizer(PLAIN_CHAT_TEMPLATE)) is None




def test_rollout_prefix_sharing_false_samples_the_same_through_the_padded_path(tokenizer, policy):
    config = RolloutConfig(task="arithmetic", prompts_per_step=4, group_size=4, seed=1)
    shared = Rollout(config, tokenizer, build_sampler(config, policy)).collect(0)
    padded = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(config), {"prefix_sharing": False}))
    sampler = build_sampler(padded, policy)
    batch = Rollout(padded, tokenizer, sampler).collect(0)
    assert not sampler.prefix_sharing and _same(batch.sequences, shared.sequences)
    assert 0 < shared.stats.prefill_tokens < shared.stats.prompt_tokens and batch.stats.prefill_tokens == 0
