"""AlgoConfig as the `algo` section of a YAML config: overrides, defaults per loss, errors naming the key."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from treerl.algo import AlgoConfig
from treerl.algo.config import LOSS_DEFAULTS, LOSSES


def from_overrides(*dotlist: str) -> AlgoConfig:
    schema = OmegaConf.structured({"algo": AlgoConfig})
    merged = OmegaConf.merge(schema, OmegaConf.from_dotlist(list(dotlist)))
    return OmegaConf.to_object(merged)["algo"]


def test_yaml_overrides_build_a_config() -> None:
    config = from_overrides(
        "algo.loss=grpo",
        "algo.clip_eps=0.2",
        "algo.kl_coef=0.04",
        "algo.kl_estimator=k3",
        "algo.aggregation=token_mean",
    )
    assert isinstance(config, AlgoConfig)
    assert (config.loss, config.clip_eps, config.kl_coef, config.aggregation) == ("grpo", 0.2, 0.04, "token_mean")


@pytest.mark.parametrize("loss", LOSSES)
def test_each_loss_resolves_its_usual_settings(loss: str) -> None:
    resolved = from_overrides(f"algo.loss={loss}").resolved()
    for key, value in LOSS_DEFAULTS[loss].items():
        assert getattr(resolved, key) == value
    assert resolved.clip_eps_high == (4e-4 if loss == "gspo" else resolved.clip_eps)


def test_an_explicit_key_beats_the_loss_default() -> None:
    resolved = AlgoConfig(loss="dr_grpo", aggregation="token_mean").resolved()
    assert (resolved.aggregation, resolved.advantage) == ("token_mean", "group_mean")


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"loss": "ppo2"}, "algo.loss='ppo2' is not one of"),
        ({"aggregation": "mean"}, "algo.aggregation='mean' is not one of"),
        ({"kl_estimator": "k4"}, "algo.kl_estimator='k4'"),
        ({"clip_eps": 0.0}, "algo.clip_eps=0.0 must be > 0"),
        ({"dual_clip": 0.5}, "algo.dual_clip=0.5 must be > 1"),
        ({"gamma": 1.5}, r"algo.gamma=1.5 must be in \[0, 1\]"),
        ({"kl_coef": -1.0}, "algo.kl_coef=-1.0 must be >= 0"),
        ({"behav_imp_weight_cap": 5.0}, "only applies to algo.loss=decoupled_ppo"),
    ],
)
def test_bad_values_name_the_key(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AlgoConfig(**overrides)


def test_kl_in_reward_needs_a_token_level_estimator() -> None:
    with pytest.raises(ValueError, match="algo.kl_in_reward=True needs per-token rewards"):
        AlgoConfig(loss="grpo", kl_in_reward=True).resolved()
