"""The `--balance` report: the treerl balancer against the baselines on the benchmark workloads.

Beside the steps (docs/architecture.md): measures step 4 for `treerl bench --balance`.

For each workload, cost model and rank count K: the max/mean cost ratio across ranks, the
makespan against the ideal (whole batch as one tree, split perfectly: no imbalance and nothing
recomputed), and the compression kept after assignment. Costs are estimates from
treerl.distributed.cost (unfitted: unique tokens; `treerl bench --balance` adds one fitted from step
times it measures), not timings: this is arithmetic on tree shapes and runs in seconds.
"""

from __future__ import annotations

from collections.abc import Callable

from treerl.distributed.assign import balance, evaluate, first_fit, lpt
from treerl.distributed.cost import CostModel
from treerl.tree import PrefixTree, TokenSequence
from treerl.tree.workloads import AgentShape, agent_trees, grpo_groups, random_trees

METHODS: dict[str, Callable] = {"treerl": balance, "first-fit": first_fit, "LPT": lpt}


def workloads(scale: float = 1.0) -> dict[str, list[TokenSequence]]:
    """The benchmark's tree workloads (tau2-like agent episodes, GRPO groups) and random tries."""
    return {
        "tau2-like agent": agent_trees(AgentShape().scaled(scale)),
        "GRPO 16x8": grpo_groups(prompts=16, group_size=8, prompt_len=512, response_len=256, jitter=0.8),
        "GRPO 4x16": grpo_groups(prompts=4, group_size=16, prompt_len=2048, response_len=512, jitter=0.8),
        "random (sharing 4)": random_trees(sequences=64, length=1024, sharing=4.0),
    }


def balance_report(
    scale: float = 1.0,
    ranks: tuple[int, ...] = (2, 4, 8),
    micro_batch_tokens: int | None = None,
    batches: dict[str, list[TokenSequence]] | None = None,
    cost_models: dict[str, CostModel] | None = None,
) -> list[dict]:
    """One row per workload x cost model x K x method."""
    cost_models = cost_models or {"unfitted (unique tokens)": CostModel()}
    rows = []
    for workload, sequences in (batches if batches is not None else workloads(scale)).items():
        stats = PrefixTree.build(sequences).stats()
        for cost_name, cost in cost_models.items():
            for k in ranks:
                for method, assign in METHODS.items():
                    if assign is balance:
                        assignment = balance(sequences, k, micro_batch_tokens, cost=cost)
                    else:
                        assignment = assign(sequences, k, micro_batch_tokens)
                    result = evaluate(assignment, sequences, cost)
                    rows.append(dict(
                        workload=workload, cost_model=cost_name, ranks=k, method=method, chosen=assignment.method,
                        sequences=stats.sequences, flat_tokens=stats.flat_tokens, unique_tokens=stats.unique_tokens,
                        compression=stats.compression, max_over_mean=result.imbalance, makespan=result.makespan,
                        makespan_over_ideal=result.vs_ideal, computed_tokens=result.computed_tokens,
                        compression_after=result.compression, compression_kept=result.compression_kept,
                        micro_batches=result.micro_batches,
                    ))
    return rows


def balance_markdown(rows: list[dict]) -> str:
    """One table per cost model; a cell is `max/mean · makespan/ideal · compression after assignment`."""
    out = []
    methods = list(dict.fromkeys(r["method"] for r in rows))
    for cost_name in dict.fromkeys(r["cost_model"] for r in rows):
        legend = (f"**Cost model: {cost_name}.** Cell: max/mean cost across ranks · makespan / ideal · "
                  "compression T/U kept after assignment (global T/U in the first column). Lower makespan is better; "
                  "the best per row is bold.")
        out += [legend, ""]
        out.append("| workload (T/U) | K | " + " | ".join(methods) + " |")
        out.append("|---|---:|" + "---:|" * len(methods))
        keys = dict.fromkeys((r["workload"], r["ranks"]) for r in rows if r["cost_model"] == cost_name)
        for workload, k in keys:
            cells = {r["method"]: r for r in rows if (r["cost_model"], r["workload"], r["ranks"]) == (cost_name, workload, k)}
            best = min(c["makespan"] for c in cells.values())
            line = [f"{workload} ({next(iter(cells.values()))['compression']:.1f}x)", str(k)]
            for m in methods:
                c = cells[m]
                text = f"{c['max_over_mean']:.3f} · {c['makespan_over_ideal']:.3f} · {c['compression_after']:.2f}x"
                line.append(f"**{text}**" if c["makespan"] <= best * (1 + 1e-9) else text)
            out.append("| " + " | ".join(line) + " |")
        out.append("")
    return "\n".join(out)

