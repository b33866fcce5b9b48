"""Synchronous against asynchronous RL on one task: training reward against wall time, and the time to a reward.

Beside the steps (docs/architecture.md): measures the whole loop, synchronous against asynchronous.

    treerl bench --async --seeds 0,1
    treerl bench --async --config guess_number --set trainer.steps=200 --target 0.6

Both modes run the same config (a packaged name or a YAML file, plus key=value overrides), task
and seed, one after the other in this process, each timed from the call of `train` (building the
policy, starting the rollout workers and the evaluations included) to its return. The trainer
runs `threads` torch threads in both modes (default 1: the tiny built-in models gain nothing from
intra-op threads, and on a loaded machine a second thread can make a step many times slower); the
asynchronous run adds its `trainer.rollout_workers` workers of `trainer.worker_threads` threads
each, so on 2 cores the trainer and one worker sample and train side by side. What async can save
is at most the sampling time of a synchronous step; its stale samples (trained up to
`trainer.max_staleness` versions late, corrected by decoupled PPO) may in turn need more steps.

Reported per run: wall time, steps per second, the evaluation reward at the start and the end, the
training reward (mean of the last 20 steps), and the wall time at which the training reward,
smoothed over 20 steps, first reaches the target (by default 90% of what the synchronous run of that
seed ends with). Written to `out`: async_compare.json, async_compare.md, async_compare.png.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch

from treerl.trainer import load_config, train

WINDOW = 20  # steps the training reward is smoothed over
MODES = ("sync", "async")


def run_mode(config_name: str | None, overrides: list[str], mode: str, seed: int, threads: int, out: Path) -> dict:
    """One training run; its summary and the smoothed training reward against elapsed seconds."""
    output_dir = out / f"{mode}_seed{seed}"
    config = load_config(config_name, [*overrides, f"trainer.mode={mode}", f"trainer.seed={seed}",
                                       f"rollout.seed={seed}", f"trainer.output_dir={output_dir}",
                                       "trainer.progress=false", "trainer.tensorboard=false", "trainer.save_final=false"])
    previous = torch.get_num_threads()
    workers = config.trainer.rollout_workers * config.trainer.worker_threads if mode == "async" else 0
    torch.set_num_threads(threads + workers)  # train_async keeps for the trainer what its workers leave
    load = os.getloadavg()[0]
    started = time.time()
    try:
        result = train(config)
    finally:
        torch.set_num_threads(previous)
    rows = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "train/loss" in r and r.get("rollout/reward_mean") is not None]
    rewards = [r["rollout/reward_mean"] for r in rows]
    smoothed = [statistics.fmean(rewards[max(0, i + 1 - WINDOW) : i + 1]) for i in range(len(rewards))]
    summary = json.loads((output_dir / "summary.json").read_text())
    return {
        "mode": mode, "seed": seed, "seconds": result.seconds, "steps": result.steps,
        "steps_per_second": result.steps / result.seconds, "reward_start": result.reward_start,
        "reward_end": result.reward_end, "train_reward_last": result.train_reward_last,
        "load_before": load, "load_after": os.getloadavg()[0], "counters": summary.get("async"),
        "curve": [(r["time"] - started, s) for r, s in zip(rows, smoothed)],
        "lag_mean": statistics.fmean(r["async/lag_mean"] for r in rows) if mode == "async" else 0.0,
    }


def time_to(curve: list[tuple[float, float]], target: float) -> float | None:
    """Seconds until the smoothed training reward first reaches `target` (None: never)."""
    return next((t for t, reward in curve if reward >= target), None)


def compare(config_name: str | None = "arithmetic", overrides: list[str] | tuple[str, ...] = (),
            seeds: list[int] | tuple[int, ...] = (0,), target: float | None = None, threads: int = 1,
            out: Path = Path("outputs/bench/async")) -> list[dict]:
    """Run sync then async for each seed; rows with wall time, rewards and time to the target reward."""
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for seed in seeds:
        runs = {mode: run_mode(config_name, list(overrides), mode, seed, threads, out) for mode in MODES}
        goal = target if target is not None else 0.9 * runs["sync"]["curve"][-1][1]
        for run in runs.values():
            run["target"] = goal
            run["time_to_target"] = time_to(run["curve"], goal)
            rows.append(run)
    setup = {"config": config_name, "overrides": list(overrides), "threads": threads, "cpu_count": os.cpu_count()}
    (out / "async_compare.json").write_text(json.dumps({"setup": setup, "runs": rows}, indent=1) + "\n")
    (out / "async_compare.md").write_text(markdown(rows) + "\n")
    plot(rows, out / "async_compare.png")
    return rows


def markdown(rows: list[dict]) -> str:
    """One line per run."""
    header = ("| seed | mode | wall s | steps/s | eval reward start -> end | train reward (last 20) | target | "
              "time to target (s) | mean lag | load avg |")
    lines = [header, "|---:|---|---:|---:|---|---:|---:|---:|---:|---|"]
    for r in rows:
        reached = "never" if r["time_to_target"] is None else f"{r['time_to_target']:.1f}"
        lines.append(f"| {r['seed']} | {r['mode']} | {r['seconds']:.1f} | {r['steps_per_second']:.2f} | "
                     f"{r['reward_start']:.3f} -> {r['reward_end']:.3f} | {r['train_reward_last']:.3f} | "
                     f"{r['target']:.3f} | {reached} | {r['lag_mean']:.2f} | "
                     f"{r['load_before']:.1f} -> {r['load_after']:.1f} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    """Smoothed training reward against wall time, one line per run."""
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for r in rows:
        ax.plot([t for t, _ in r["curve"]], [v for _, v in r["curve"]], label=f"{r['mode']} (seed {r['seed']})",
                linestyle="-" if r["mode"] == "async" else "--")
    ax.axhline(rows[0]["target"], color="grey", linewidth=0.8)
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel(f"training reward (mean of {WINDOW} steps)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
