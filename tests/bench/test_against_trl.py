"""`treerl bench --against trl`: one step of TRL 1.16's GRPOTrainer (its own venv, tools/trl-venv.sh, built when
missing: never skipped) and of `treerl train` on each workload, the settings TRL reports matched to treerl's; bad
input refused in one line before anything trains."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from treerl.bench.against_trl import compare, trl_settings
from treerl.errors import UserError

ROOT = Path(__file__).resolve().parents[2]
TINY = ["trainer.steps=1", "rollout.prompts_per_step=1", "rollout.group_size=2", "rollout.max_new_tokens=6"]


@pytest.fixture(scope="module")
def trl_python():
    """The TRL venv's python, built by the project's script (CI starts it in the background)."""
    done = subprocess.run([str(ROOT / "tools" / "trl-venv.sh")], check=False, capture_output=True, text=True,
                          timeout=1800)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """SmolLM2-135M-Instruct as the transformers directory `treerl export --model-path` writes."""
    from treerl.trainer.core.export import export_model

    return export_model("smollm2-135m-instruct", None, tmp_path_factory.mktemp("model") / "smollm2")


@pytest.mark.slow
def test_one_step_of_each_trainer_on_every_workload(tmp_path, trl_python, smollm2):
    result = compare(None, [*TINY, f"model.path={smollm2}"], ["short", "long_system", "multi_turn"], [0], trl_python,
                     1, None, tmp_path)
    assert [(r["workload"], r["trainer"].split()[0]) for r in result["rows"]] == [
        (w, t) for w in ("short", "long_system", "multi_turn") for t in ("TRL", "treerl")]
    assert result["setup"]["trl"].startswith("1.16.")
    for run in result["steps"]:
        [step] = run["steps"]
        assert step["seconds"] > 0 and step["generate"] > 0 and step["update"] > 0, run
        assert step["trained_tokens"] > 0 and step["computed_tokens"] >= step["trained_tokens"], run
        assert step["reward_mean"] is not None and 0 <= step["reward_mean"] <= 1, run
        assert step["generate"] + step["logprobs"] + step["update"] <= step["seconds"] * 1.001, run  # a split
        if run["trainer"] == "trl":  # TRL's split adds up to its step: every part timed once
            parts = ("generate", "reward", "logprobs", "rollout_other", "update", "optimizer")
            assert sum(step[p] for p in parts) == pytest.approx(step["seconds"], rel=1e-6), run
    for workload in ("short", "long_system", "multi_turn"):
        run = tmp_path / workload / "seed0"
        reported = json.loads((run / "trl_settings.json").read_text())["settings"]  # GRPOConfig as TRL resolved it
        assert reported | {"max_tool_calling_iterations": None, "generation_kwargs": None} == {
            "loss_type": "dapo", "beta": 0.0, "epsilon": 0.2, "epsilon_high": 0.2, "scale_rewards": "group",
            "num_generations": 2, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 1,
            "generation_batch_size": 2, "max_completion_length": 6 if workload != "multi_turn" else 3 * 6 + 2 * 24,
            "temperature": 0.7, "top_p": 1.0, "top_k": 0, "gradient_checkpointing": False, "bf16": False,
            "num_iterations": 1, "max_grad_norm": 1.0, "entropy_coef": 0.02,
            "max_tool_calling_iterations": None, "generation_kwargs": None}, workload
        treerl = yaml.safe_load((run / "treerl.yaml").read_text())
        assert treerl["algo"]["aggregation"] == "token_mean" and treerl["algo"]["adv_eps"] == 1e-4
        assert treerl["rollout"]["temperature"] == 0.7 and treerl["trainer"]["lr"] == 2e-5
    multi = json.loads((tmp_path / "multi_turn" / "seed0" / "trl_settings.json").read_text())["settings"]
    assert multi["max_tool_calling_iterations"] == 2 and multi["generation_kwargs"] == {"max_new_tokens": 6}
    table = (tmp_path / "against_trl.md").read_text()
    assert "| short | 0 | TRL 1.16." in table and "step time TRL / treerl" in table
    assert (tmp_path / "against_trl.png").stat().st_size > 0


def test_the_long_system_prompt_is_shared_by_every_prompt_and_about_600_tokens():
    from transformers import AutoTokenizer

    from treerl.bench.against_trl import AGENT_INSTRUCTIONS, base_config, rows
    from treerl.gguf_checkpoint import local_checkpoint

    tokenizer = AutoTokenizer.from_pretrained(local_checkpoint("smollm2-135m-instruct"))
    assert 550 <= len(tokenizer(AGENT_INSTRUCTIONS)["input_ids"]) <= 700
    config = base_config(None, ["trainer.steps=2"])
    short, long = rows(config, "short"), rows(config, "long_system")
    assert len(short) == len(long) == 2 * 4
    assert [r["prompt"][1:] for r in long] == [r["prompt"] for r in short]  # the same questions, in the same order
    assert all(r["prompt"][0] == {"role": "system", "content": AGENT_INSTRUCTIONS} for r in long)


def test_multi_turn_opens_with_games_the_environment_would_answer():
    from treerl.bench.against_trl import GAME, PRACTICE, base_config, game_opening, rows
    from treerl.bench.trl_guess_env import HiddenNumber

    opening = game_opening()
    assert opening[0] == {"role": "system", "content": GAME}
    assert opening[-1] == {"role": "user", "content": "Find the hidden number."}
    assert [r["prompt"] for r in rows(base_config(None, ["trainer.steps=2"]), "multi_turn")] == [opening] * 8
    for game in PRACTICE:  # each practice game is one HiddenNumber plays: its answers, ending on "correct"
        env = HiddenNumber()
        env.reset(secret=game[-1][0])
        assert [env.guess(number) for number, _ in game] == [answer for _, answer in game]
        assert game[-1][1] == "correct" and env.get_reward() == 1.0
    calls = [m["tool_calls"][0]["function"] for m in opening if m.get("tool_calls")]
    shown = [m["content"] for m in opening if m["role"] == "tool"]
    assert calls == [{"name": "guess", "arguments": {"number": n}} for game in PRACTICE for n, _ in game]
    assert shown == [answer for game in PRACTICE for _, answer in game]


@pytest.mark.parametrize(("overrides", "said"), [
    (["algo.kl_coef=0.1"], "algo.kl_coef=0.1 has no matched setting in TRL's GRPOTrainer"),
    (["trainer.ppo_epochs=2"], "trainer.ppo_epochs=2 has no matched setting"),
    (["trainer.precision=bf16-mixed"], "trainer.precision='bf16-mixed' has no matched setting"),
    (["algo.aggregation=seq_sum"], "algo.aggregation=seq_sum has no TRL loss_type matched here"),
    (["algo.loss=dr_grpo"], "algo.loss=dr_grpo"),
    (["algo.adv_eps=1e-6"], "algo.adv_eps=1e-06: TRL divides by the group's std + 1e-4"),
    (["rollout.group_size=1"], "rollout.group_size=1: TRL's GRPOTrainer needs >= 2"),
    (["rollout.top_k=5"], "rollout.top_k=5 has no matched setting"),
])
def test_a_setting_trl_cannot_match_is_refused_in_one_line_before_anything_runs(tmp_path, overrides, said):
    with pytest.raises(UserError, match="^--against trl: ") as refused:
        compare(None, overrides, ["short"], [0], "/no/such/python", 1, None, tmp_path)
    assert said in str(refused.value) and "\n" not in str(refused.value)
    assert not any(tmp_path.iterdir())  # nothing was written, nothing ran


def test_no_trl_where_it_is_looked_for_is_one_line(tmp_path):
    with pytest.raises(UserError, match=r"^--trl-python /no/such/python: no such file$"):
        compare(None, [], ["short"], [0], "/no/such/python", 1, None, tmp_path)
    with pytest.raises(UserError, match=r"^--trl-python .*: not TRL 1\.16 \(.*No module named 'trl'"):
        compare(None, [], ["short"], [0], sys.executable, 1, None, tmp_path)  # treerl's own environment has no TRL
    with pytest.raises(UserError, match=r"^--workloads tau2: --against trl runs short, long_system, multi_turn$"):
        compare(None, [], ["tau2"], [0], sys.executable, 1, None, tmp_path)


@pytest.mark.slow
def test_a_model_trl_cannot_load_is_one_line_before_anything_trains(tmp_path, trl_python):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "no-such-architecture"}')
    with pytest.raises(UserError, match=rf"^--against trl: TRL's run failed: the model {broken}: ") as refused:
        compare(None, [*TINY, f"model.path={broken}"], ["short"], [0], trl_python, 1, None, tmp_path / "out")
    assert "\n" not in str(refused.value)
    assert not (tmp_path / "out" / "short" / "seed0" / "treerl").exists()  # treerl never started


def test_the_cli_says_what_it_refuses_in_one_line(tmp_path):
    from typer.testing import CliRunner

    from treerl.cli.main import app

    result = CliRunner().invoke(app, ["bench", "--against", "verl", "--out", str(tmp_path)])
    assert result.exit_code != 0 and "--against verl: the one trainer measured against is trl" in result.output


def test_trl_settings_are_treerls_own():
    from treerl.bench.against_trl import base_config

    config = base_config(None, ["rollout.group_size=4", "trainer.lr=1e-5", "algo.aggregation=seq_mean_token_mean"])
    settings = trl_settings(config, "long_system", 3, 1)
    assert settings["loss_type"] == "grpo" and settings["group_size"] == settings["micro_batch"] == 4
    assert settings["lr"] == 1e-5 and settings["seed"] == 3 and settings["max_completion_length"] == 16
    assert trl_settings(config, "short", 3, 1)["micro_batch"] == 4 * 4  # the whole batch in one forward
    assert trl_settings(config, "multi_turn", 3, 1)["micro_batch"] == 4  # a group: 32 episodes would not fit
    assert trl_settings(base_config(None, []), "short", 0, 1)["loss_type"] == "dapo"  # token_mean, TRL's default
