"""`treerl bench --profile`: where one step's time goes, per engine, from torch.profiler.

Beside the steps (docs/architecture.md): where step 5's time goes.

Each aten operator's own time (children excluded: host time on CPU, kernel time on CUDA) is put in a
bucket by its name: matrix multiplies, attention kernels, and every other operator (norms, activations,
copies, the engine's gathers and scatters). What the operators do not account for is host time:
Python, the engine's bookkeeping, dispatch and the autograd engine (on CUDA: time the device sat idle).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from treerl.bench.peak import _quiet_stderr

MATMUL = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_addmm_activation")
ATTENTION = ("attention", "flash", "sdpa", "scaled_dot_product")  # parts of the names of attention kernels


def bucket(op: str) -> str:
    """"matmul", "attention" or "other ops" for an aten operator's name."""
    if op in MATMUL:
        return "matmul"
    if any(word in op for word in ATTENTION):
        return "attention"
    return "other ops"


def profile_step(step: Callable[[], float], device: torch.device) -> dict:
    """Profile `step` (one timed forward_backward, returning its wall seconds): wall seconds, seconds per bucket,
    host seconds and operator calls."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    prof = profile(activities=activities)
    with _quiet_stderr():  # the profiler's C++ side prints a line at every start and stop
        prof.start()
    try:
        wall = step()
    finally:
        with _quiet_stderr():
            prof.stop()
    seconds = {"matmul": 0.0, "attention": 0.0, "other ops": 0.0}
    ops = 0
    for event in prof.key_averages():
        if not event.key.startswith("aten::"):
            continue  # autograd nodes, Python scopes: host time, counted below
        own = event.self_device_time_total if device.type == "cuda" else event.self_cpu_time_total
        seconds[bucket(event.key)] += own / 1e6
        ops += event.count
    host = max(0.0, wall - sum(seconds.values()))
    return dict(wall=wall, **seconds, host=host, ops=ops)


def profile_markdown(rows: list[dict]) -> str:
    """One line per (workload, engine): wall time, then its shares."""
    lines = ["| workload | engine | wall (s) | matmul | attention | other ops | host (Python, bookkeeping) | aten ops |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        shares = " | ".join(f"{r[key]:.3f} ({r[key] / r['wall']:.0%})" for key in ("matmul", "attention", "other ops", "host"))
        lines.append(f"| {r['workload']} | {r['engine']} | {r['wall']:.3f} | {shares} | {r['ops']:,} |")
    return "\n".join(lines)
