"""`treerl bench --weight-push URL`: what one weight push to an inference server costs, by where the weights go.

Beside the steps (docs/architecture.md): step 6's push to the servers, measured.

A push is what the trainer does once per policy version with `rollout.server_url`
(treerl.trainer.core.servers): write the policy as a transformers checkpoint, then have the server
load it in place (`CompletionsClient.push_weights`). This pushes the model the server serves (its
directory, `--model-path`, so the weights fit) `repeats` times through /dev/shm and through a
directory on disk, and reports the median time of each half and the rate over the model's size.
The server keeps serving the same weights; its version ends at repeats - 1.
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from treerl.rollout import CompletionsClient, load_tokenizer
from treerl.trainer.core.checkpoint import write_pretrained_atomically

SHARED_MEMORY = Path("/dev/shm")


def measure_weight_push(url: str, model_path: str, server_model: str, repeats: int, disk: Path) -> list[dict[str, Any]]:
    """One row per place the weights are written (/dev/shm, disk): write and load times, medians over `repeats`."""
    client = CompletionsClient(url, model=server_model, setting="--weight-push", model_setting="--server-model")
    [info] = client.connect()  # before the model loads: a server that is not there is said at once
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, local_files_only=True)
    tokenizer = load_tokenizer(model_path)
    megabytes = sum(t.numel() * t.element_size() for t in model.state_dict().values()) / 2**20
    rows = []
    places = [("/dev/shm", SHARED_MEMORY / f"treerl-bench-{os.getpid()}")] if SHARED_MEMORY.is_dir() else []
    for where, directory in [*places, ("disk", disk)]:
        writes, loads = [], []
        try:
            for version in range(repeats):
                started = time.perf_counter()
                write_pretrained_atomically(directory / "weights", model, model.state_dict(), tokenizer)
                written = time.perf_counter()
                client.push_weights(str((directory / "weights").resolve()), version)
                writes.append(written - started)
                loads.append(time.perf_counter() - written)
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        write, load = statistics.median(writes), statistics.median(loads)
        rows.append({"server": f"{info.kind} {info.release}", "parameters_m": model.num_parameters() / 1e6,
                     "megabytes": megabytes, "where": where, "write_s": write, "load_s": load,
                     "push_s": write + load, "mb_per_s": megabytes / (write + load), "repeats": repeats})
    return rows


def weight_push_markdown(rows: list[dict[str, Any]]) -> str:
    """The table docs/benchmarks.md shows."""
    lines = ["| server | parameters | weights (MB) | written to | write (s) | server load (s) | push (s) | MB/s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['server']} | {r['parameters_m']:.1f} M | {r['megabytes']:.0f} | {r['where']} | "
                     f"{r['write_s']:.3f} | {r['load_s']:.3f} | {r['push_s']:.3f} | {r['mb_per_s']:.0f} |")
    return "\n".join(lines)
