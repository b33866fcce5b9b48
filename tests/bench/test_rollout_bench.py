"""`treerl bench --rollout`: both sampler paths play the same calls and sample the same tokens; the shared path runs
exactly the ideal's tokens (each prompt token once, the decoded ones), the padded path every prompt whole."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from treerl.bench.rollout import RolloutBenchConfig, rollout_markdown, rollout_rows
from treerl.cli.main import app


def test_both_paths_play_the_same_calls_and_the_shared_one_runs_the_ideal_tokens():
    system = 40
    rows = rollout_rows(RolloutBenchConfig(shape="tiny-qwen3", vocab_size=256, repeats=1, system_tokens=system,
                                           threads=1))
    assert [(r["workload"], r["path"]) for r in rows] == [(w, p) for w in ("grpo_long_system", "agent_tree", "episode")
                                                          for p in ("padded", "shared")]
    for padded, shared in zip(rows[::2], rows[1::2]):
        assert padded["same_tokens"] == 1.0 and shared["unshared_calls"] == 0
        assert padded["prompt_tokens"] == shared["prompt_tokens"] == padded["prefill_tokens"]
        assert shared["model_tokens"] == shared["ideal_tokens"] < padded["model_tokens"]
        assert shared["speedup"] == padded["seconds"] / shared["seconds"] and padded["speedup"] == 1.0
    grpo = rows[1]
    assert grpo["ideal_tokens"] == system + 4 * 24 + 32 * 15  # the shared prompt once, each question, 15 runs a row
    assert rows[3]["cached_tokens"] > 0 and rows[5]["cached_tokens"] > 0  # later turns read the earlier ones
    assert "| grpo_long_system | shared |" in rollout_markdown(rows)


def test_the_command_writes_its_table_and_refuses_bad_options(tmp_path):
    runner = CliRunner()
    result = runner.invoke(app, ["bench", "--rollout", "--shape", "tiny-qwen3", "--vocab-size", "128", "--repeats",
                                 "1", "--threads", "1", "--system-tokens", "16", "--workloads", "grpo_long_system",
                                 "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    written = json.loads((tmp_path / "rollout.json").read_text())
    assert [r["path"] for r in written["rows"]] == ["padded", "shared"] and "load_before" in written["settings"]
    bad = runner.invoke(app, ["bench", "--rollout", "--workloads", "grpo"])
    assert bad.exit_code == 2 and "--workloads='grpo' is not one of: grpo_long_system, agent_tree, episode" in bad.output
    bad = runner.invoke(app, ["bench", "--rollout", "--system-tokens", "0"])
    assert bad.exit_code == 2 and "--system-tokens=0 must be > 0" in bad.output
