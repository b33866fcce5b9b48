"""Checkpoints that resume exactly: weights (safetensors), optimizer, schedule, RNG states, data position, step.

Layout of `output_dir/checkpoints/step_000123/` (123 = steps completed):

    config.json, model.safetensors   the policy, loadable by transformers and by `model.path=...`
    tokenizer files                  so the directory is a complete checkpoint
    trainer_state.pt                 optimizer, LR schedule, RNG states, step, loop state (written last)
    config.yaml                      the run's resolved config

The data position is the step itself: a step's rollout prompts and sampling seed, and an SFT
step's conversations, are functions of (config, step), so nothing else needs saving. Under FSDP2
the full (unsharded) weights and optimizer state are gathered; every rank calls `save_checkpoint`
and rank 0 writes. A checkpoint is written to a temporary directory and renamed when complete,
so `resume=auto` never picks a half-written one.
"""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

STATE_FILE = "trainer_state.pt"
_NAME = re.compile(r"^step_(\d+)$")


def checkpoint_dir(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / "checkpoints" / f"step_{step:06d}"


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The complete checkpoint with the most steps under output_dir/checkpoints, or None."""
    root = Path(output_dir) / "checkpoints"
    found = [(int(m.group(1)), p) for p in root.glob("step_*") if (m := _NAME.match(p.name)) and (p / STATE_FILE).exists()]
    return max(found)[1] if found else None


def find_resume_path(resume: str | None, output_dir: str | Path) -> Path | None:
    """`trainer.resume`: None (fresh start), "auto" (latest in output_dir, or fresh), or a checkpoint directory."""
    if resume is None:
        return None
    if resume == "auto":
        return latest_checkpoint(output_dir)
    path = Path(resume)
    if not (path / STATE_FILE).exists():
        raise FileNotFoundError(f"trainer.resume={resume!r}: not a complete checkpoint (no {STATE_FILE} in it)")
    return path


def rng_states() -> dict[str, Any]:
    states = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def save_checkpoint(
    path: Path,
    model: PreTrainedModel,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    tokenizer: PreTrainedTokenizerBase,
    step: int,
    loop_state: dict[str, Any],
    config_yaml: str,
    is_main: bool,
) -> None:
    """Gather the full state (a collective under FSDP2: every rank calls this) and write it on rank 0."""
    weights = full_weights(model)
    optimizer_state = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if is_main:
        tmp = path.with_name(path.name + ".tmp")
        write_pretrained(tmp, model, weights, tokenizer)
        (tmp / "config.yaml").write_text(config_yaml)
        state = {
            "step": step, "optimizer": optimizer_state, "scheduler": scheduler.state_dict(),
            "rng": rng_states(), "loop": loop_state,
        }
        torch.save(state, tmp / STATE_FILE)
        shutil.rmtree(path, ignore_errors=True)
        tmp.rename(path)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def full_weights(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """The full (unsharded) weights on CPU; a collective under FSDP2, so every rank calls it."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def write_pretrained(
    path: Path, model: PreTrainedModel, weights: dict[str, torch.Tensor], tokenizer: PreTrainedTokenizerBase
) -> None:
    """A fresh transformers checkpoint directory (safetensors weights, config, tokenizer) at `path`."""
    hf_logging.disable_progress_bar()  # no "Writing model shards" bar through the training progress bar
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    model.save_pretrained(path, state_dict=weights, safe_serialization=True)
    tokenizer.save_pretrained(path)


def load_checkpoint(
    path: Path,
    model: PreTrainedModel,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> tuple[int, dict[str, Any]]:
    """Restore weights, optimizer, schedule and RNG from `path` (every rank reads it); returns (step, loop state)."""
    options = StateDictOptions(full_state_dict=True, strict=False)
    incompatible = set_model_state_dict(model, read_weights(path), options=options)
    missing = set(incompatible.missing_keys) - tied_names(model)
    if missing or incompatible.unexpected_keys:
        raise ValueError(
            f"checkpoint {path} does not fit the model: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(incompatible.unexpected_keys)[:5]}"
        )
    state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=False)
    set_optimizer_state_dict(model, optimizer, state["optimizer"], options=StateDictOptions(full_state_dict=True))
    scheduler.load_state_dict(state["scheduler"])
    set_rng_states(state["rng"])
    return state["step"], state["loop"]


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a save_pretrained directory: model.safetensors, or the shards its index lists."""
    single = path / "model.safetensors"
    if single.exists():
        return load_file(single)
    index = path / "model.safetensors.index.json"
    if not index.exists():
        raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json")
    shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    weights: dict[str, torch.Tensor] = {}
    for shard in shards:
        weights.update(load_file(path / shard))
    return weights


def tied_names(model: torch.nn.Module) -> set[str]:
    """Names of parameters registered under several names (tied embeddings): saved once, loaded through the other."""
    by_id: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), []).append(name)
    return {name for names in by_id.values() if len(names) > 1 for name in names}


def prune_checkpoints(output_dir: str | Path, keep: int) -> None:
    """Delete all but the `keep` most recent complete checkpoints (keep = 0: keep all)."""
    if keep <= 0:
        return
    root = Path(output_dir) / "checkpoints"
    found = sorted((int(m.group(1)), p) for p in root.glob("step_*") if (m := _NAME.match(p.name)))
    for _, path in found[:-keep]:
        shutil.rmtree(path, ignore_errors=True)
