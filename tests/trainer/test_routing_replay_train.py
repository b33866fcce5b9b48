"""trainer.routing_replay in treerl train: the embedded sampler records each token's experts, the trainer replays them
(train/routing/* logged every step), and the settings it cannot serve are refused in one line at the config check."""

from __future__ import annotations

import pytest
from test_rl import metrics_rows

from treerl.attention import UnsupportedModel
from treerl.trainer import ConfigError, train

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
