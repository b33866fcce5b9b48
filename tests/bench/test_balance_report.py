"""The --balance report: rows, markdown, and the claim it exists to show."""

from __future__ import annotations

import pytest

from treerl.distributed.cost import CostModel
from treerl.bench.balance import balance_markdown, balance_report
from treerl.bench.workloads import grpo_groups

# A plausible fitted model: per call, per unique token, per attention pair, per leaf, per sequence, per flat token.
FITTED = CostModel((1e-2, 9e-6, 2e-9, 5e-3, 1e-3, 1e-8))
COSTS = {"unfitted": CostModel(), "fitted": FITTED}


def test_rows_and_markdown_on_a_small_batch():
    batches = {"grpo": grpo_groups(prompts=3, group_size=4, prompt_len=30, response_len=9)}
    rows = balance_report(ranks=(2, 4), batches=batches, cost_models=COSTS)
    assert len(rows) == 2 * 2 * 3  # cost models x K x methods
    assert {r["method"] for r in rows} == {"treerl", "first-fit", "LPT"}
    unique = 3 * (30 + 4 * 9)  # each group: its 30-token prompt once, then 4 replies of 9
    for r in rows:
        assert r["max_over_mean"] >= 1.0 and r["makespan_over_ideal"] >= 1.0 - 1e-9
        # A group split over ranks recomputes its prompt once per extra rank, and nothing else is recomputed.
        assert r["unique_tokens"] == unique and (r["computed_tokens"] - unique) % 30 == 0, r
        assert r["compression_kept"] == unique / r["computed_tokens"], r
    assert {r["compression_kept"] for r in rows if r["method"] == "LPT"} == {1.0}  # LPT places whole groups
    assert min(r["compression_kept"] for r in rows) == unique / (unique + 3 * 30)  # first-fit, K = 4 (measured)
    text = balance_markdown(rows)
    assert "| grpo (" in text and text.count("| grpo (") == 4 and "**" in text


@pytest.mark.slow
def test_balancer_beats_the_baselines_on_the_benchmark_workloads():
    rows = balance_report(scale=0.1, cost_models=COSTS)
    groups: dict[tuple, dict[str, float]] = {}
    for r in rows:
        groups.setdefault((r["workload"], r["cost_model"], r["ranks"]), {})[r["method"]] = r["makespan"]
    for (workload, cost_model, k), makespan in groups.items():
        baseline = min(makespan["first-fit"], makespan["LPT"])
        assert makespan["treerl"] <= baseline * (1 + 1e-12), (workload, cost_model, k)
        if workload == "tau2-like agent" and k >= 4:
            assert makespan["treerl"] < baseline, (workload, cost_model, k)
