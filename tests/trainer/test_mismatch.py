"""Mismatch metrics in a run (sampler against trainer at the same weights) and the correction presets in treerl train."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support import treerl_serve
from test_rl import metrics_rows

from treerl.trainer import ConfigError, train

MEASURES = ("tokens", "abs_logprob_diff_mean", "abs_logprob_diff_max", "kl_k1", "kl_k3", "ratio_p01", "ratio_p05",
            "ratio_p50", "ratio_p95", "ratio_p99", "ratio_min", "ratio_max", "ratio_outside_half_two",
            "seq_geo_ratio_mean", "seq_geo_ratio_min", "seq_geo_ratio_max")


def trained_rows(output_dir: Path) -> list[dict]:
    return [row for row in metrics_rows(output_dir) if "train/loss" in row]


@pytest.mark.parametrize("recompute", ["false", "true"])
def test_a_run_measures_the_embedded_sampler_against_the_trainer_every_step(tiny_config, tmp_path, recompute):
    """trainer.mismatch_metrics=true: every step logs each measure over its trained tokens (against a pass of its own,
    or the recomputed old_logprobs); the embedded float32 sampler and the tree engine agree to rounding; summary.json
    holds the run's summary."""
    train(tiny_config("trainer.steps=2", "trainer.mismatch_metrics=true", f"trainer.recompute_logprobs={recompute}"))
    rows = trained_rows(tmp_path / "run")
    assert len(rows) == 2
    for row in rows:
        assert {f"mismatch/{m}" for m in MEASURES} <= row.keys()
        assert row["mismatch/tokens"] == row["batch/trained_tokens"] > 0
        assert row["mismatch/abs_logprob_diff_max"] < 1e-3 and row["mismatch/ratio_outside_half_two"] == 0.0
        assert row["mismatch/ratio_min"] <= row["mismatch/ratio_p01"] <= row["mismatch/ratio_p50"] <= row[
            "mismatch/ratio_p99"] <= row["mismatch/ratio_max"]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())["mismatch"]
    assert summary["steps"] == 2 and summary["tokens"] == sum(row["mismatch/tokens"] for row in rows)
    assert summary["abs_logprob_diff_max"] == max(row["mismatch/abs_logprob_diff_max"] for row in rows)


def test_a_run_without_servers_or_a_preset_measures_nothing(tiny_config, tmp_path):
    train(tiny_config("trainer.steps=1"))
    assert not any(key.startswith("mismatch/") for key in trained_rows(tmp_path / "run")[0])
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["mismatch"] == {}


@pytest.mark.parametrize("loss", ["grpo", "gspo", "decoupled_ppo"])
def test_a_preset_trains_and_says_what_it_did(tiny_config, tmp_path, loss):
    """A decoupled preset on a loss without a proximal pass of its own gets one; its weights on an on-policy float32
    batch are all but 1."""
    train(tiny_config("trainer.steps=1", f"algo.loss={loss}", "algo.rollout_correction=decoupled_token_rs"))
    row = trained_rows(tmp_path / "run")[0]
    assert row["rollout_correction/dropped"] == 0.0 and row["rollout_correction/weight_mean"] == 1.0
    assert row["mismatch/tokens"] > 0


def test_recomputed_old_log_probs_leave_a_preset_nothing_to_correct(tiny_config):
    with pytest.raises(ConfigError, match="algo.rollout_correction=decoupled_token_is corrects the sampler's log-probs, "
                                          "which trainer.recompute_logprobs=true replaces"):
        tiny_config("algo.rollout_correction=decoupled_token_is", "trainer.recompute_logprobs=true")


@pytest.mark.slow
def test_a_bfloat16_server_against_a_float32_trainer_is_a_measured_mismatch(tiny_config, tmp_path):
    """`treerl serve --dtype bfloat16` samples for a float32 trainer of the same weights: the measures see it, far above
    the float32 server's rounding."""
    kl = {}
    for dtype in ("float32", "bfloat16"):
        with treerl_serve("--seed", "0", "--dtype", dtype) as url:
            train(tiny_config(f"rollout.server_url={url}", "trainer.steps=1",
                              f"rollout.weights_dir={tmp_path / 'pushed' / dtype}", name=dtype))
        kl[dtype] = trained_rows(tmp_path / dtype)[0]["mismatch/kl_k3"]
    assert kl["float32"] < 1e-10 and kl["bfloat16"] > 1e-8, kl  # ~4e-14 and ~4e-7 on a tiny random-init model
