"""The bench: FLOP model arithmetic, a tiny end-to-end run, its files, and the CLI."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from treerl.bench.engines import ENGINES, BenchConfig, contract_bytes, make_workload, profile_engines, run_bench
from treerl.bench.flops import flop_rates, image_flops, state_flops, tree_flops, vision_rates
from treerl.bench.peak import peak_memory
from treerl.bench.profile import bucket, profile_markdown
from treerl.bench.report import markdown, write
from treerl.cli.main import app
from treerl.engine import DfsEngine
from treerl.models import model_config
from treerl.tree import PrefixTree, TokenSequence


def test_flops_of_a_hand_counted_tree():
    config = model_config("tiny-qwen3", vocab_size=10)
    per_token, per_key = flop_rates(config)
    d, layers = 64, 2
    assert per_token == 2 * (layers * (d * 64 * 2 + d * 32 * 2 + 3 * d * 128) + d * 10)
    assert per_key == 4 * 4 * 16 * layers
    seqs = [TokenSequence(torch.tensor([1, 2, 3])), TokenSequence(torch.tensor([1, 2, 4, 5]))]
    flat, tree = tree_flops(PrefixTree.build(seqs), config)
    assert flat == 7 * per_token + (1 + 2 + 3 + 1 + 2 + 3 + 4) * per_key
    assert tree == 5 * per_token + (1 + 2 + 3 + 3 + 4) * per_key  # [1 2] [3] [4 5]


def test_a_hybrids_recurrent_layers_attend_to_no_keys():
    """small-qwen3.5: one attention layer in four; the Gated DeltaNet layers' projections still count per token."""
    hybrid, dense = flop_rates(model_config("small-qwen3.5")), flop_rates(model_config("small-qwen3"))
    assert hybrid[1] == dense[1] // 4 == 4 * 8 * 32
    assert hybrid[0] > 0.9 * dense[0]


def test_a_hybrids_mixers_count_their_state_work_per_token():
    """Three Gated DeltaNet layers, each carrying 8 heads x 32 x 32 delta-rule states (6 FLOPs an element a token)
    and a 512-channel window of 4 (2 an element): counted per token on top of the projections."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config("small-qwen3.5"))
    assert state_flops(model) == 3 * (6 * 8 * 32 * 32 + 2 * 512 * 4)
    with torch.device("meta"):
        assert state_flops(AutoModelForCausalLM.from_config(model_config("small-qwen3"))) == 0


def test_no_sharing_means_no_ideal_speedup():
    tree = PrefixTree.build(make_workload("sharing-1", 1 / 64, 1000))
    flat, unique = tree_flops(tree, model_config("tiny-qwen3"))
    assert flat == unique


def test_the_vision_tower_counts_every_shown_image_flat_and_each_distinct_image_once():
    """grpo-image: 4 visual questions, 8 samples each: flat runs the tower on each image 8 times, the tree once."""
    config = model_config("small-qwen2.5-vl", vocab_size=4096)
    tree = PrefixTree.build(make_workload("grpo-image", 1 / 64, 4096, config=config))
    flat, once = image_flops(tree, config)
    per_patch, per_token = vision_rates(config)
    assert once == 4 * (16 * 16 * per_patch + 64 * per_token) and flat == 8 * once  # 16 x 16 patches, 64 tokens
    assert image_flops(PrefixTree.build(make_workload("grpo", 1 / 64, 4096)), config) == (0, 0)
    with pytest.raises(ValueError, match="needs a vision-language shape"):
        make_workload("agent-screenshots", 1 / 64, 4096, config=model_config("small-qwen3"))


@pytest.mark.slow  # ~12 s on 2 cores
def test_image_workloads_run_each_engine_that_takes_images_and_refuse_the_rest():
    config = BenchConfig(shape="small-qwen2.5-vl", scale=1 / 256, repeats=1, warmup=0, memory=True,
                         workloads=["agent-screenshots"], engines=["flat", "packed", "dfs", "dta"])
    rows = run_bench(config)
    by = {(r["workload"], r["engine"]): r for r in rows}
    for workload in config.workloads:
        assert by[workload, "packed"]["refused"] and "does not feed images" in by[workload, "packed"]["refused"]
        dfs = by[workload, "dfs"]
        assert dfs["speedup"] > 0 and dfs["vision_flops_flat"] > dfs["vision_flops_tree"] > 0
        flat, dta = by[workload, "flat"]["peak_bytes"], by[workload, "dta"]["peak_bytes"]
        assert dfs["contract_bytes"] == max(flat, int(1.5 * dta))  # flat runs a sequence showing images alone
    assert "vision tower forward" in markdown(rows)


def test_peak_memory_sees_a_tensor():
    assert peak_memory(lambda: torch.ones(1 << 20)) >= 4 << 20


@pytest.mark.slow  # ~13 s on 2 cores
def test_every_engine_runs_and_dfs_rows_get_the_memory_contract():
    config = BenchConfig(shape="tiny-qwen3", vocab_size=128, scale=1 / 256, repeats=1, warmup=0, workloads=["agent"],
                         engines=list(ENGINES))
    rows = {r["engine"]: r for r in run_bench(config)}
    assert set(rows) == set(ENGINES)
    best = min(rows[name]["seconds"] for name in ("flat", "flat-packed", "flat-sequences"))
    assert max(rows[name]["speedup"] for name in ("flat", "flat-packed", "flat-sequences")) == 1.0
    assert rows["dfs"]["speedup"] == best / rows["dfs"]["seconds"]  # over the fastest flat layout
    assert rows["dta"]["vs_dta"] == 1.0 and rows["dfs"]["vs_dta"] == rows["dta"]["seconds"] / rows["dfs"]["seconds"]
    flat, dta = rows["flat-packed"]["peak_bytes"], rows["dta"]["peak_bytes"]
    assert rows["dfs"]["contract_bytes"] == max(flat, int(1.5 * dta))  # flat's micro-batch, or 1.5x the one-path walk
    assert rows["dfs-memory-one-path"]["contract_bytes"] == int(1.5 * dta)
    for name in ("flat", "packed", "dta", "dfs-unbounded-memory"):  # no contract: not DfsEngine's, the reference, a budget
        assert rows[name]["contract_bytes"] is None and not rows[name]["over_contract"]
    for name in ("dfs", "dfs-memory-one-path", "dfs-one-node-per-call", "dfs-always-recompute"):
        assert rows[name]["over_contract"] == (rows[name]["peak_bytes"] > rows[name]["contract_bytes"])
    assert "| contract MiB |" in markdown(list(rows.values()))


def test_a_hybrids_contract_is_flats_one_sequence_micro_batch():
    # flat cannot pack a hybrid (flat-packed refuses it): its micro-batch is one sequence, the CPU `flat` row's
    # layout when no flat-sequences row was run
    same = {"flat": {"peak_bytes": 300}, "dta": {"peak_bytes": 100}}
    assert contract_bytes(DfsEngine(), same, "flat-sequences") == 300
    assert contract_bytes(DfsEngine(), {**same, "flat-sequences": {"peak_bytes": 250}}, "flat-sequences") == 250
    assert contract_bytes(DfsEngine(), same, "flat-packed") is None  # attention-only: flat's packed rows, not run
    assert contract_bytes(DfsEngine(memory="one-path"), same, "flat-sequences") == 150


@pytest.mark.slow  # ~19 s on 2 cores
def test_profile_splits_the_step_time():
    config = BenchConfig(shape="tiny-qwen3", vocab_size=128, scale=1 / 128, warmup=0, workloads=["grpo"],
                         engines=["flat", "dfs"])
    rows = profile_engines(config)
    assert [r["engine"] for r in rows] == ["flat", "dfs"]
    for r in rows:
        parts = r["matmul"] + r["attention"] + r["other ops"] + r["host"]
        assert r["matmul"] > 0 and r["attention"] > 0 and r["ops"] > 100
        assert abs(parts - r["wall"]) < 1e-6 or r["host"] == 0.0
    assert bucket("aten::mm") == "matmul" and bucket("aten::_scaled_dot_product_flash_attention_for_cpu") == "attention"
    assert bucket("aten::index_copy_") == "other ops"
    table = profile_markdown(rows)
    assert "| grpo | dfs |" in table and "host" in table


@pytest.mark.slow  # ~9 s on 2 cores
def test_tiny_run_and_files(tmp_path):
    config = BenchConfig(shape="tiny-qwen3", vocab_size=128, scale=1 / 128, repeats=1, warmup=0,
                         workloads=["grpo", "sharing-1"], engines=["flat", "flat-packed", "dfs"])
    rows = run_bench(config)
    assert [(r["workload"], r["engine"]) for r in rows] == [(w, e) for w in config.workloads for e in config.engines]
    for row in rows:
        flat = min(r["seconds"] for r in rows if r["workload"] == row["workload"] and r["engine"].startswith("flat"))
        assert len(row["times"]) == 1 and row["seconds"] == row["times"][0]
        assert row["speedup"] == flat / row["seconds"] and row["of_ideal"] == row["speedup"] / row["ideal"]
        batch = make_workload(row["workload"], config.scale, config.vocab_size)
        flat_flops, unique_flops = tree_flops(PrefixTree.build(batch), model_config("tiny-qwen3", vocab_size=128))
        assert row["ideal"] == flat_flops / unique_flops and row["flat_tokens"] == sum(len(s) for s in batch)
    grpo = {r["engine"]: r for r in rows if r["workload"] == "grpo"}
    assert grpo["flat"]["compression"] > 2 and grpo["flat"]["ideal"] > 1.5
    # Flat in packed rows holds at least the float32 logits of every token at once; DFS walks the tree within the
    # contract: at most flat's micro-batch (the whole batch here).
    peaks = {engine: row["peak_bytes"] for engine, row in grpo.items()}
    assert peaks["flat-packed"] >= grpo["flat"]["flat_tokens"] * config.vocab_size * 4, peaks
    assert peaks["dfs"] <= peaks["flat-packed"], peaks
    # CPU time beside wall time on a CPU run (a shared machine changes it least); files without a flat engine to
    # compare with (one-path against the default, say): no speedup, and the table and plot still written
    assert all(0 < row["cpu_seconds"] for row in rows) and "| CPU time (s) |" in markdown(rows)
    dfs_only = [dict(r, speedup=None, of_ideal=None) for r in rows if r["engine"] == "dfs"]
    paths = write(dfs_only, [], {}, tmp_path)
    assert "| grpo |" in paths["md"].read_text() and paths["png"].stat().st_size > 1000


@pytest.mark.slow  # ~23 s on 2 cores
def test_cli_writes_json_markdown_and_plot(tmp_path):
    result = CliRunner().invoke(app, [
        "bench", "--shape", "tiny-qwen3", "--vocab-size", "128", "--scale", "0.005", "--repeats", "1",
        "--workloads", "agent", "--engines", "flat,dfs", "--no-memory", "--out", str(tmp_path),
    ])
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["settings"]["shape"] == "tiny-qwen3" and len(data["rows"]) == 2
    assert "| agent |" in (tmp_path / "bench.md").read_text()
    assert (tmp_path / "bench.png").stat().st_size > 1000
    result = CliRunner().invoke(app, [
        "bench", "--profile", "--shape", "tiny-qwen3", "--vocab-size", "128", "--scale", "0.005",
        "--workloads", "grpo", "--engines", "flat,dfs", "--out", str(tmp_path),
    ])
    assert result.exit_code == 0, result.output
    assert "| grpo | dfs |" in (tmp_path / "profile.md").read_text()


def test_memory_scaling_dfs_holds_a_path_flat_holds_the_batch():
    from treerl.bench.engines import memory_scaling

    config = BenchConfig(shape="tiny-qwen3", vocab_size=128, scale=1 / 64)
    rows = memory_scaling(config, groups=(1, 16))
    peak = {(r["engine"], r["samples"]): r["peak_bytes"] for r in rows}
    whole, path = "flat, whole batch at once", "dta (one node per call, recompute)"
    assert peak[(whole, 16)] > 6 * peak[(whole, 1)]
    assert peak[(path, 16)] < 2 * peak[(path, 1)]


def test_balance_cost_model_is_fitted_from_measured_steps(monkeypatch):
    """Step times that are an exact combination of the tree features: the fit finds it (R^2 = 1); with noise
    added, R^2 is what its definition gives. (Real CPU timings of a tiny model are too noisy to assert a fit.)"""
    from treerl.bench import balance
    from treerl.distributed import CostModel

    truth = CostModel(weights=(1e-3, 2e-6, 0.0, 0.0, 5e-5, 1e-7))
    config = BenchConfig(shape="tiny-qwen3", vocab_size=128, scale=1 / 128)
    for noise in (0.0, 0.3):
        measured: list[tuple[list[TokenSequence], float]] = []

        def timed(engine, model, batch, device, measured=measured, noise=noise):  # the true cost +/- noise, recorded
            measured.append((batch, truth(batch) * (1 + noise * (-1) ** len(measured))))
            return measured[-1][1]

        monkeypatch.setattr(balance, "timed_step", timed)
        fitted, r2 = balance.fit_cost_model(config, samples=12)
        assert len(measured) == 13  # a warm-up step, then the samples
        seconds = np.array([t for _, t in measured[1:]])
        residual = ((seconds - np.array([fitted(b) for b, _ in measured[1:]])) ** 2).sum()
        assert r2 == pytest.approx(1 - residual / ((seconds - seconds.mean()) ** 2).sum(), rel=1e-9)
        if noise == 0.0:
            assert r2 == pytest.approx(1.0, abs=1e-9) and fitted.weights == pytest.approx(truth.weights, rel=1e-4)
        else:
            assert 0.0 < r2 < 0.999, r2
