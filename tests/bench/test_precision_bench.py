"""`treerl bench --precision`: every variant and engine measured on the same batch, with the right parameters."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from treerl.bench.precision import VARIANTS
from treerl.cli.main import app

pytest.importorskip("peft")


@pytest.mark.slow  # ~9 s on 2 cores
def test_cli_measures_each_variant_with_flat_and_dfs(tmp_path):
    result = CliRunner().invoke(app, [
        "bench", "--precision", "--shape", "tiny-qwen3", "--vocab-size", "64", "--prompt-tokens", "12",
        "--response-tokens", "4", "--samples", "3", "--lora-rank", "2", "--engines", "flat,dfs", "--out", str(tmp_path),
    ])
    assert result.exit_code == 0, result.output
    rows = json.loads((tmp_path / "precision.json").read_text())["rows"]
    assert [(r["variant"], r["engine"]) for r in rows] == [(v, e) for v in VARIANTS for e in ("flat", "dfs")]
    by = {(r["variant"], r["engine"]): r for r in rows}
    full = by["fp32", "dfs"]["parameters"]
    assert by["fp32", "dfs"]["weight_bytes"] == 4 * full and by["bf16", "dfs"]["weight_bytes"] == 2 * full
    assert by["bf16-mixed", "dfs"]["weight_bytes"] == 4 * full  # float32 master weights
    lora = by["bf16-mixed + LoRA", "dfs"]
    assert 0 < lora["trainable"] < full / 10 and by["fp32", "flat"]["trainable"] == full
    assert all(r["seconds"] > 0 and r["peak_bytes"] > 0 and r["flat_tokens"] == 3 * 16 for r in rows)
    assert "| bf16-mixed + LoRA | dfs |" in (tmp_path / "precision.md").read_text()
