"""The config tree: defaults are the demo, YAML + overrides, every key documented, clear errors."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from treerl.trainer import ConfigError, load_config, to_yaml
from treerl.trainer.core.config import all_keys, packaged_configs, trained_algo
from treerl.trainer.core.config_docs import render
from treerl.trainer.core.optim import lr_factor
from treerl.trainer.core.update import minibatch_indices
from treerl.tree import TokenSequence

DOCS = Path(__file__).resolve().parents[2] / "docs" / "config.md"


def test_no_config_is_the_packaged_arithmetic_demo():
    default, demo = load_config(), load_config("arithmetic")
    assert dataclasses.replace(demo.trainer, output_dir=default.trainer.output_dir) == default.trainer
    assert (demo.model, demo.rollout, demo.algo, demo.engine) == (default.model, default.rollout, default.algo,
                                                                  default.engine)
    assert default.engine.name == "dfs" and default.model.path is None and default.rollout.task == "arithmetic"


def test_packaged_configs_load_by_name_or_path():
    assert {"arithmetic", "guess_number", "sft_example"} <= set(packaged_configs())
    assert load_config("guess_number").rollout.task == "guess_number"
    assert load_config("configs/guess_number.yaml").rollout.group_size == 4  # the repo's configs/ or the package's
    with pytest.raises(ConfigError, match="config file 'nope.yaml' does not exist"):
        load_config("nope.yaml")


def test_yaml_then_overrides_win(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("trainer:\n  steps: 7\n  lr: 0.5\nrollout:\n  branch_at: [1, 2]\n")
    config = load_config(path, ["trainer.lr=0.25", "model.path=null", "algo.kl_coef=0.1"])
    assert (config.trainer.steps, config.trainer.lr, config.rollout.branch_at, config.algo.kl_coef) == (7, 0.25, [1, 2], 0.1)
    assert "steps: 7" in to_yaml(config)
    assert load_config(path, [f"trainer.output_dir={tmp_path}"]).trainer.output_dir == str(tmp_path)


@pytest.mark.parametrize("overrides, message", [
    (["trainer.lrr=1"], r"unknown key 'trainer.lrr': section 'trainer' has no 'lrr'; did you mean 'trainer.lr'\?"),
    (["trainr.lr=1"], r"unknown key 'trainr'.*did you mean 'trainer'\?"),
    (["rollout.group_sise=2"], r"did you mean 'rollout.group_size'\?"),
    (["trainer.steps=many"], r"trainer.steps: Value 'many'.*could not be converted"),
    (["trainer.steps"], r"expected key=value"),
    (["trainer.steps=0"], r"trainer.steps=0 must be > 0"),
    (["engine.name=tree"], r"engine.name='tree' is not one of: dfs, flat, packed"),
    (["algo.loss=foo"], r"algo.loss='foo' is not one of"),
    (["rollout.task=dataset"], r"rollout.task = 'dataset' needs rollout.data_path"),
    (["model.shape=huge"], r"model.shape='huge' is not one of"),
    (["algo.loss=ppo", "trainer.mode=async"], r"trains a critic, which trainer.mode=async does not run"),
    (["algo.loss=ppo", "critic.path=/no/such/critic"], r"critic.path='/no/such/critic' does not exist"),
    (["critic.lr=0"], r"critic.lr=0.0 must be > 0"),
    (["trainer.context_parallel_path=ring"], r"trainer.context_parallel_path='ring' must be one of sharded, replicated"),
    (["trainer.context_parallel_mixers=wavefront"], r"trainer.context_parallel_mixers='wavefront' must be one of "
                                                    r"side-by-side, in-turn"),
    (["rollout.top_k=-1"], r"rollout.top_k=-1 must be >= 0"),
    (["rollout.min_p=1"], r"rollout.min_p must be in \[0, 1\)"),
    (["rollout.server_url=[]"], r"rollout.server_url is an empty list"),
    (["rollout.server_url=[http://127.0.0.1:8000,ftp://x]"], r"rollout.server_url='ftp://x' must be an http"),
    (["rollout.top_p=0.9", "algo.loss=gspo"], r"rollout.top_p=0.9 samples from a truncated distribution.*"
                                              r"algo.loss=gspo has no form of"),
    (["rollout.top_k=5", "trainer.decoupled_loss=false"], r"rollout.top_k=5 .*set trainer.decoupled_loss=true"),
    (["rollout.min_p=0.1", "trainer.recompute_logprobs=true"], r"trainer.recompute_logprobs=true would overwrite"),
])
def test_bad_values_are_clear_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_unknown_key_in_a_yaml_file_names_the_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("trainer:\n  stepz: 3\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: unknown key 'trainer.stepz'.*did you mean 'trainer.steps'"):
        load_config(path)
    path.write_text("- a list\n")
    with pytest.raises(ConfigError, match="expected a mapping of sections"):
        load_config(path)


def test_every_key_is_documented_and_the_reference_is_up_to_date():
    text = DOCS.read_text()
    assert text == render(), "docs/config.md is stale: python -m treerl.trainer.core.config_docs > docs/config.md"
    for key in all_keys():
        row = next(line for line in text.splitlines() if line.startswith(f"| `{key}` |"))
        assert not row.endswith("|  |"), f"{key} has no comment in its dataclass"


def test_truncated_sampling_trains_decoupled_ppo_and_untruncated_the_configured_loss():
    """top_p / top_k / min_p make the samples off-policy by design: the run trains the loss as decoupled PPO (same
    advantages and aggregation), as asynchronous training does; untruncated synchronous training keeps the loss."""
    assert trained_algo(load_config(None, ["algo.loss=grpo"])).loss == "grpo"
    for cut in ("rollout.top_p=0.9", "rollout.top_k=20", "rollout.min_p=0.05"):
        algo = trained_algo(load_config(None, ["algo.loss=grpo", cut]))
        assert algo.loss == "decoupled_ppo" and algo.aggregation == "seq_mean_token_mean" and algo.advantage == "group"
    assert trained_algo(load_config(None, ["algo.loss=grpo", "trainer.mode=async"])).loss == "decoupled_ppo"


def test_lr_schedule():
    config = load_config(None, ["trainer.steps=11", "trainer.warmup_steps=2", "trainer.lr_schedule=cosine",
                                "trainer.min_lr_ratio=0.1"]).trainer
    assert [lr_factor(s, config) for s in range(3)] == [0.5, 1.0, 1.0]
    assert lr_factor(10, config) == pytest.approx(0.1) and 0.1 < lr_factor(6, config) < 1
    constant = load_config(None, ["trainer.warmup_steps=0"]).trainer
    assert {lr_factor(s, constant) for s in range(5)} == {1.0}


def test_minibatches_keep_groups_whole_and_cover_the_batch():
    import torch

    batch = [TokenSequence(torch.arange(3 + i % 4), info={"group": f"g{i // 3}"}) for i in range(30)]
    parts = minibatch_indices(batch, 4, torch.Generator().manual_seed(0))
    assert len(parts) == 4 and sorted(i for p in parts for i in p) == list(range(30))
    for part in parts:
        groups = {batch[i].info["group"] for i in part}
        assert all(batch[j].info["group"] not in groups for other in parts if other is not part for j in other)
    again = minibatch_indices(batch, 4, torch.Generator().manual_seed(0))
    assert parts == again
    assert minibatch_indices(batch[:3], 4, torch.Generator().manual_seed(0)) == [[0, 1, 2]]  # one group: one part


def test_a_frozen_vision_tower_is_frozen_and_a_text_policy_cannot_freeze_one():
    """`model.freeze_vision_tower=true`: the tower and its projector take no gradient, the language model does; a
    text policy with the setting is a config error, not a silently ignored key."""
    import torch

    from treerl.engine.images import tower_parameters
    from treerl.trainer.core.build import load_policy

    config = load_config("shapes", ["model.freeze_vision_tower=true"]).model
    model, _ = load_policy(config, torch.device("cpu"))
    tower = {id(p) for p in tower_parameters(model)}
    assert tower and all(p.requires_grad == (id(p) not in tower) for p in model.parameters())
    with pytest.raises(ConfigError, match="freeze_vision_tower=true, and the policy .* has no vision tower"):
        load_policy(load_config(None, ["model.freeze_vision_tower=true"]).model, torch.device("cpu"))
