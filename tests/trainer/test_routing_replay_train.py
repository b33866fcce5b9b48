"""trainer.routing_replay in treerl train: the embedded sampler records each token's experts, the trainer replays them
(train/routing/* logged every step), and the settings it cannot serve are refused in one line at the config check."""

from __future__ import annotations

import pytest
import torch
from test_rl import metrics_rows

from treerl.attention import UnsupportedModel
from treerl.engine.routing import recording_routes
from treerl.models import build_model
from treerl.rollout import EmbeddedSampler, SamplingParams
from treerl.trainer import ConfigError, train
from treerl.trainer.asynchronous.interruptible import InterruptibleSampler

REPLAY = ["model.shape=tiny-qwen3-moe", "rollout.return_routed_experts=true", "trainer.routing_replay=true"]


@pytest.mark.parametrize("engine", ["dfs", "flat"])
def test_an_moe_run_replays_the_samplers_routing(tiny_config, tmp_path, engine):
    """A GRPO group shares its prompt: one routing a node, the sequences' own routing of the prompt all alike (the
    sampler routed it once), so nothing disagrees; every sequence token but the last is routed."""
    train(tiny_config("trainer.steps=2", f"engine.name={engine}", "trainer.mismatch_metrics=true", *REPLAY))
    rows = [row for row in metrics_rows(tmp_path / "run") if "train/loss" in row]
    assert len(rows) == 2
    for row in rows:
        assert row["train/routing/disagree_tokens"] == 0.0
        assert row["train/routing/routed_tokens"] > row["batch/trained_tokens"] > 0
        assert row["mismatch/abs_logprob_diff_max"] < 1e-3  # the replayed routing is the sampler's own


@pytest.mark.parametrize(("overrides", "message"), [
    (["trainer.routing_replay=true"], "rollout.return_routed_experts=false does not go with it"),
    ([*REPLAY, "model.gradient_checkpointing=true"], "model.gradient_checkpointing=true does not go with it"),
    (["rollout.return_routed_experts=true", "rollout.server_url=http://127.0.0.1:9"], "does not read a server's"),
])
def test_settings_routing_replay_cannot_serve_are_refused(tiny_config, overrides, message):
    with pytest.raises(ConfigError, match=message):
        tiny_config(*overrides)


def test_routing_replay_on_a_dense_model_is_one_line(tiny_config):
    with pytest.raises(UnsupportedModel, match="no MoE layers"):
        train(tiny_config("rollout.return_routed_experts=true", "trainer.routing_replay=true"))


def test_an_agent_run_replays_the_routing_of_every_model_call(tiny_config, tmp_path):
    """Agent episodes (the proxy, replies cut after their first tool call): every call's sequence carries its routing,
    and calls that re-read a context share its nodes."""
    train(tiny_config("trainer.steps=1", *REPLAY, config="agent_tools"))
    [row] = [row for row in metrics_rows(tmp_path / "run") if "train/loss" in row]
    assert row["train/routing/routed_tokens"] > row["batch/trained_tokens"] > 0


def test_a_reply_resumed_in_segments_keeps_one_routing_a_token():
    """trainer.on_update=interrupt: a reply decoded in 2-token segments (prefilled again at each) carries one routing
    a token, the model's own (its weights did not change here), -1 on its last."""
    model = build_model(shape="tiny-qwen3-moe", vocab_size=64, seed=0)
    sampler = InterruptibleSampler(EmbeddedSampler(model, return_routed_experts=True), lambda: None, segment_tokens=2)
    [group] = sampler.generate([[5, 6, 7]], SamplingParams(n=2, max_new_tokens=7, seed=0))
    for completion in group:
        tokens = torch.tensor([5, 6, 7, *completion.tokens])
        with torch.no_grad(), recording_routes(model) as record:
            model(input_ids=tokens[None], use_cache=False)
            own = record.take(len(tokens))
        assert torch.equal(completion.routed_experts[:-1], own[:-1]) and bool((completion.routed_experts[-1] < 0).all())
