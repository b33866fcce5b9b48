"""`treerl bench --balance`: the data-parallel balancer against the baselines, with a measured cost model.

Beside the steps (docs/architecture.md): measures step 4 (the split over ranks).

The cost model is fitted from DfsEngine step times measured here, on random sub-batches of the
benchmark workloads (the same model and device as the engine bench), so the makespans compare
plans by what a step costs on this machine, not only by unique-token counts.
"""

from __future__ import annotations

import random

import numpy as np
import torch

from treerl.bench.run import BenchConfig, make_workload, timed_step
from treerl.distributed import CostModel
from treerl.distributed.report import balance_markdown, balance_report, workloads
from treerl.engine import DfsEngine
from treerl.models import build_model


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
