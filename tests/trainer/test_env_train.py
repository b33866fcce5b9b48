"""`treerl train` on an ecosystem environment (rollout.env): reasoning-gym datasets mixed, a TextArena game, each
environment's reward and named metrics logged per step, at evaluation and in summary.json; sync and async."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from treerl.errors import TrainingStopped
from treerl.trainer import train

LEGS = "reasoning_gym:leg_counting"
MIXED = ("rollout.env=[{env: reasoning_gym:leg_counting, env_args: {min_animals: 1, max_animals: 2}}, "
         "{env: reasoning_gym:basic_arithmetic, env_args: {min_terms: 2, max_terms: 2}}]")
SMALL = ["rollout.system_prompt=", "rollout.max_new_tokens=6", "trainer.steps=2", "trainer.eval_prompts=2"]


def rows(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_run_logs_each_environments_reward_and_metrics(tiny_config, tmp_path, mode):
    extra = ["trainer.mode=async", "algo.advantage=group", "rollout.group_size=2"] if mode == "async" else []
    result = train(tiny_config(MIXED, *SMALL, "rollout.prompts_per_step=4", *extra, name=mode))
    logged = rows(tmp_path / mode)
    steps = [r for r in logged if "train/loss" in r]
    assert len(steps) == 2
    for row in steps:
        envs = [k.split("/")[1] for k in row if k.startswith("env/") and k.endswith("/samples")]
        assert envs and set(envs) <= {LEGS, "reasoning_gym:basic_arithmetic"}
        assert sum(row[f"env/{env}/samples"] for env in envs) == row["rollout/kept"]
        for env in envs:
            assert 0 <= row[f"env/{env}/answered"] <= 1 and f"env/{env}/reward_mean" in row
    evaluated = [r for r in logged if "eval/reward_mean" in r]
    assert len(evaluated) == 2 and any(k.startswith("eval/env/") for k in evaluated[0])
    summary = json.loads((tmp_path / mode / "summary.json").read_text())
    assert summary["environments"] == result.environments
    for env, figures in summary["environments"].items():
        assert {"reward_mean", "samples", "answered"} <= set(figures), env
    assert any("eval_reward_start" in figures and "eval_reward_end" in figures
               for figures in summary["environments"].values())


def test_a_textarena_game_trains(tiny_config, tmp_path):
    train(tiny_config("rollout.env=textarena:GuessTheNumber-v0", "rollout.env_args={max_number: 4, max_turns: 1}",
                      "rollout.max_new_tokens=4", "trainer.steps=1"))
    [step] = [r for r in rows(tmp_path / "run") if "train/loss" in r]
    assert step["rollout/kept"] == 2 * 4 * 2 and step["rollout/dropped"] == 0  # 2 episodes x 4 x branch_factor 2
    assert step["batch/compression"] > 1  # each episode's turns share its prefix
    assert step["env/textarena:GuessTheNumber-v0/samples"] == step["rollout/kept"]  # trajectories, not model calls
    assert step["env/textarena:GuessTheNumber-v0/reward_mean"] == pytest.approx(step["rollout/reward_mean"])


def test_episodes_cut_by_treerls_bound_are_dropped_and_written_down(tiny_config, tmp_path):
    """rollout.max_turns=1 cuts every game before it ends (a random reply is an invalid move, forgiven once): each
    episode is dropped (env_truncated) into dropped.jsonl, the run that trained no step stops with exit code 3 and
    writes no checkpoint of the weights it started from."""
    with pytest.raises(TrainingStopped, match="no step of this run trained.*env_truncated"):
        train(tiny_config("rollout.env=textarena:GuessTheNumber-v0", "rollout.env_args={max_number: 4, max_turns: 1}",
                          "rollout.max_turns=1", "rollout.max_new_tokens=4", "trainer.steps=1",
                          "trainer.max_failed_steps=0"))
    dropped = [json.loads(line) for line in (tmp_path / "run" / "dropped.jsonl").read_text().splitlines()]
    assert dropped and all(row["reason"].startswith("environment episode cut at rollout.max_turns=1 replies before "
                                                    "it ended (the game's own limit: max_turns=1") for row in dropped)
    assert all("Guess The Number" in row["prompt"] for row in dropped)
    assert not (tmp_path / "run" / "checkpoints").exists() or not any((tmp_path / "run" / "checkpoints").iterdir())
