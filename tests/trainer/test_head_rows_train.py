"""engine.head_rows: a run whose LM head computes only the loss_mask positions (the default) trains exactly like one
that computes every position: the same losses, gradients and metrics, through every pass that fills a log-prob field
(old, proximal, reference), a rejecting rollout-correction preset, the mismatch measures, multi-turn masks with holes,
and SFT."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from treerl.engine import ValueHead
from treerl.trainer import SFT_DEFAULTS, ConfigError, sft, train
from treerl.trainer.core.build import build_train_engine
from treerl.trainer.core.config import EngineConfig

TIMED = ("time", "perf/", "rollout/seconds", "rollout/tokens_per_second")  # wall-clock figures differ run to run


def step_rows(output_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if any(key.startswith(("train/", "eval/")) for key in row)]


def assert_same_metrics(ours: list[dict], reference: list[dict], tol: float = 1e-6) -> int:
    """Every metric of every step equal to `tol` (relative, absolute below 1e-9); how many were compared."""
    assert [r["step"] for r in ours] == [r["step"] for r in reference] and ours
    compared = 0
    for mine, theirs in zip(ours, reference):
        assert mine.keys() == theirs.keys()
        for key, value in theirs.items():
            if key.startswith(TIMED) or not isinstance(value, (int, float)) or math.isnan(value):
                continue
            assert mine[key] == pytest.approx(value, rel=tol, abs=1e-9), (mine["step"], key)
            compared += 1
    return compared


@pytest.mark.parametrize("settings", [
    pytest.param(["rollout.task=guess_number", "algo.loss=grpo", "algo.kl_coef=0.05", "trainer.recompute_logprobs=true",
                  "trainer.mismatch_metrics=true"], id="old-and-reference-passes-multi-turn"),
    pytest.param(["algo.loss=decoupled_ppo", "algo.rollout_correction=decoupled_token_rs", "trainer.minibatches=2"],
                 id="proximal-pass-rejecting-preset"),
])
def test_a_run_computing_the_head_on_loss_mask_positions_equals_one_computing_it_everywhere(tiny_config, tmp_path,
                                                                                            settings):
    """Two steps (the second samples from the updated weights), float64: every logged metric the same."""
    common = ["trainer.steps=2", "model.dtype=float64", *settings]
    train(tiny_config(*common, name="masked"))
    train(tiny_config(*common, "engine.head_rows=all", name="all"))
    ours, reference = step_rows(tmp_path / "masked"), step_rows(tmp_path / "all")
    assert {"train/loss", "train/grad_norm", "train/entropy", "mismatch/kl_k1"} <= reference[0].keys()
    assert assert_same_metrics(ours, reference) > 20


def test_sft_computing_the_head_on_the_assistant_tokens_equals_computing_it_everywhere(tiny_config, tmp_path):
    common = ["trainer.steps=2", "model.dtype=float64", "sft.conversations_per_step=3", "sft.eval_conversations=2"]
    results = [sft(tiny_config(*common, *extra, config="sft_example", base=SFT_DEFAULTS, name=name))
               for name, extra in (("masked", []), ("all", ["engine.head_rows=all"]))]
    assert results[0].loss_end == pytest.approx(results[1].loss_end, rel=1e-9)
    assert assert_same_metrics(step_rows(tmp_path / "masked"), step_rows(tmp_path / "all"), tol=1e-9) > 4


def test_head_rows_takes_loss_mask_or_all(tiny_config):
    with pytest.raises(ConfigError, match="engine.head_rows='advantages' is not one of: loss_mask, all"):
        tiny_config("engine.head_rows=advantages")


@pytest.mark.parametrize("name", ["dfs", "packed", "flat"])
def test_the_policys_engine_computes_the_loss_mask_positions_a_critics_every_one(name):
    """What each setting builds (bf16-mixed: inside the autocast wrapper); a critic's values feed GAE beyond the mask."""
    policy = build_train_engine(EngineConfig(name=name), precision="bf16-mixed")
    assert policy.engine.head_rows == "loss_mask"
    assert build_train_engine(EngineConfig(name=name, head_rows="all")).head_rows is None
    assert build_train_engine(EngineConfig(name=name), head=ValueHead()).head_rows is None
