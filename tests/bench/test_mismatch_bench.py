"""`treerl bench --mismatch URL`: a sampler's log-probs against the trainer's recomputation, measured as treerl train
measures them (treerl.algo.mismatch); the real vLLM server's figures are in docs/benchmarks.md."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from support import treerl_serve
from typer.testing import CliRunner

from treerl.bench.mismatch import measure_sampler, mismatch_markdown, sampled_sequences
from treerl.cli.main import app
from treerl.models import build_model
from treerl.rollout import Completion, EmbeddedSampler, SamplingParams, builtin_tokenizer

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random-init model with the built-in tokenizer (its chat template), as `treerl export` writes one."""
    path = tmp_path_factory.mktemp("mismatch") / "policy"
    tokenizer = builtin_tokenizer()
    build_model(shape="tiny-qwen3", vocab_size=len(tokenizer), seed=0).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def chat(texts: list[str]) -> list[list[int]]:
    tokenizer = builtin_tokenizer()
    return [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                          return_dict=False) for t in texts]


def test_the_sequences_hold_the_samplers_logprobs_on_the_reply_only():
    [seq] = sampled_sequences([[5, 6, 7]], [[Completion([8, 9], [-0.5, -1.5], "length", [0, 0])]])
    assert seq.tokens.tolist() == [5, 6, 7, 8, 9]
    assert seq.fields["loss_mask"].tolist() == [0, 0, 0, 1, 1]
    assert seq.fields["old_logprobs"].tolist() == [0, 0, 0, -0.5, -1.5]


@pytest.mark.parametrize("sampler_autocast, trainer_precision, gap", [
    (None, "fp32", False),  # one precision: rounding
    (torch.bfloat16, "fp32", True),  # a bfloat16 sampler against a float32 trainer
    (None, "bf16-mixed", True),  # the reverse
])
def test_a_samplers_precision_is_measured_against_the_trainers(model_dir, sampler_autocast, trainer_precision, gap):
    """The embedded sampler in one precision, the trainer's engine in another: every sampled token is measured, and
    only a precision gap shows (k3 ~4e-14 against ~1e-6 on this tiny model)."""
    model = build_model(path=model_dir).eval()
    prompts = chat(["3+4=", "hi", "guess a number"])
    params = SamplingParams(n=3, max_new_tokens=10, temperature=0.8, seed=1)
    metrics = measure_sampler(EmbeddedSampler(model, autocast=sampler_autocast), model, prompts, params,
                              trainer_precision)
    replies = EmbeddedSampler(model, autocast=sampler_autocast).generate(prompts, params)
    assert metrics["mismatch/tokens"] == sum(len(c.tokens) for group in replies for c in group)
    if gap:
        assert metrics["mismatch/kl_k3"] > 1e-8 and metrics["mismatch/abs_logprob_diff_max"] > 1e-4, metrics
    else:
        assert metrics["mismatch/kl_k3"] < 1e-10 and metrics["mismatch/abs_logprob_diff_max"] < 1e-4, metrics


def test_the_bench_measures_a_bfloat16_server_against_a_float32_trainer(model_dir, tmp_path):
    """`treerl bench --mismatch URL` against `treerl serve --dtype bfloat16` of the same model: the weights pushed,
    sampled, recomputed in float32, the table printed and written (one row)."""
    with treerl_serve("--model-path", str(model_dir), "--dtype", "bfloat16", "--served-model-name", "policy") as url:
        result = CliRunner().invoke(app, ["bench", "--mismatch", url, "--model-path", str(model_dir), "--prompts", "3",
                                          "--samples", "2", "--response-tokens", "8", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    [row] = json.loads((tmp_path / "mismatch.json").read_text())
    assert "treerl" in row["server"] and row["trainer"] == "float32 (fp32)" and row["sequences"] == 6
    assert 0 < row["tokens"] <= 6 * 8 and row["kl_k3"] > 1e-8
    assert (tmp_path / "mismatch.md").read_text().strip() == mismatch_markdown([row]) and "| policy |" in result.output


def test_the_plot_draws_runs_side_by_side(tmp_path):
    """tools/mismatch_plot.py (docs/img/smollm2-bf16-server-mismatch.png): each run's reward and mismatch from its
    metrics.jsonl, into one PNG; the reward's running mean is the mean of the last WINDOW steps."""
    spec = importlib.util.spec_from_file_location("mismatch_plot", ROOT / "tools" / "mismatch_plot.py")
    plot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot)
    assert plot.running_mean([1.0, 3.0, 2.0], window=2) == [1.0, 2.0, 2.5]
    runs = {}
    for name in ("a", "b"):
        rows = [{"step": 0, "eval/reward_mean": 0.1}] + [
            {"step": s, "rollout/reward_mean": 0.1 * s, "mismatch/kl_k3": 1e-3, "mismatch/ratio_p01": 0.9,
             "mismatch/ratio_p50": 1.0, "mismatch/ratio_p99": 1.1} for s in range(4)]
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        runs[name] = tmp_path / name
    out = plot.plot_runs(runs, tmp_path / "side.png", title="two runs")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
