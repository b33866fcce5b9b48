"""`treerl inspect` reads a JSONL of token sequences and prints the tree's stats."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from treerl.cli.main import app
from treerl.tree.io import write_jsonl
from treerl.bench.workloads import grpo_groups


def test_inspect_table_and_json(tmp_path):
    path = tmp_path / "batch.jsonl"
    write_jsonl(grpo_groups(prompts=2, group_size=4, prompt_len=30, response_len=10), path)
    runner = CliRunner()
    table = runner.invoke(app, ["inspect", str(path)])
    assert table.exit_code == 0, table.output
    assert "compression T/U" in table.output and "320" in table.output  # T = 8 x 40
    as_json = runner.invoke(app, ["inspect", str(path), "--json", "--chunk-tokens", "8"])
    stats = json.loads(as_json.output)
    assert (stats["flat_tokens"], stats["unique_tokens"], stats["leaves"]) == (320, 2 * 30 + 8 * 10, 8)
    assert stats["chunks"] == 2 * 4 + 8 * 2  # 30-token prompts -> 4 chunks, 10-token answers -> 2


def test_inspect_names_a_bad_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"tokens": [1, 2]}) + "\n" + json.dumps({"ids": [3]}) + "\n")
    result = CliRunner().invoke(app, ["inspect", str(path)])
    assert result.exit_code == 2
    assert "bad.jsonl:2: field 'tokens'" in result.output
