"""`treerl bench --balance`: the data-parallel balancer against the baselines, with a measured cost model.

Beside the steps (docs/architecture.md): measures step 4 (the split over ranks).

For each workload, cost model and rank count K: the max/mean cost ratio across ranks, the makespan against
the ideal (whole batch as one tree, split perfectly: no imbalance and nothing recomputed), and the
compression kept after assignment. Costs are estimates from treerl.distributed.cost, not timings: the
unfitted model counts unique tokens, and a fitted one comes from DfsEngine step times measured here, on
random sub-batches of the benchmark workloads (the same model and device as the engine bench), so the
makespans compare plans by what a step costs on this machine, not only by unique-token counts.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import numpy as np
import torch

from treerl.bench.engines import BenchConfig, make_workload, timed_step
from treerl.bench.workloads import AgentShape, agent_trees, grpo_groups, random_trees
from treerl.distributed import CostModel
from treerl.distributed.assign import balance, evaluate, first_fit, lpt
from treerl.engine import DfsEngine
from treerl.models import build_model
from treerl.tree import PrefixTree, TokenSequence

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


def fit_cost_model(config: BenchConfig, samples: int = 24) -> tuple[CostModel, float]:
    """Time DfsEngine on random sub-batches of the workloads, fit CostModel; also return its R^2."""
    device = torch.device(config.device)
    model = build_model(shape=config.shape, vocab_size=config.vocab_size, dtype=getattr(torch, config.dtype),
                        device=device, seed=config.seed)
    rng = random.Random(config.seed)
    pools = [make_workload(w, config.scale, model.config.vocab_size, config.seed) for w in ("grpo", "agent", "sharing-4")]
    engine = DfsEngine()
    timed_step(engine, model, pools[0][:2], device)  # warm-up
    measured = []
    for i in range(samples):
        pool = pools[i % len(pools)]
        size = max(1, round(len(pool) ** rng.random()))  # log-uniform sizes: small and large trees alike
        batch = rng.sample(pool, size)
        measured.append((batch, timed_step(engine, model, batch, device)))
    fitted = CostModel.fit(measured)
    seconds = np.array([t for _, t in measured])
    predicted = np.array([fitted(batch) for batch, _ in measured])
    r2 = 1 - ((seconds - predicted) ** 2).sum() / ((seconds - seconds.mean()) ** 2).sum()
    return fitted, float(r2)


def balance_tables(config: BenchConfig, scale: float = 1.0) -> tuple[list[dict], str, CostModel]:
    """Rows and markdown for K = 2, 4, 8 on the tau2-like, GRPO and random workloads."""
    fitted, r2 = fit_cost_model(config)
    name = f"fitted on {config.shape}/{config.device}/{config.dtype} (R^2 {r2:.3f})"
    rows = balance_report(batches=workloads(scale), cost_models={"unfitted (unique tokens)": CostModel(), name: fitted})
    return rows, balance_markdown(rows), fitted
