"""Checkpoints that are whole or absent, verified before use, read without unpickling code, and resume exactly.

After step 6 (docs/architecture.md): the run's state on disk.

Layout of `output_dir/checkpoints/step_000123/` (123 = steps completed):

    config.json, generation_config.json,   the policy: a transformers checkpoint, loadable as `model.path=...`
    model.safetensors, tokenizer files     (the config carries the tokenizer's eos id, so generate stops there)
                                           (LoRA: adapter_config.json + adapter_model.safetensors, peft's
                                           format, instead; `treerl export` merges them into the base)
    trainer_state.pt                       optimizer, LR schedule, RNG states, step, loop state (LoopState)
    config.yaml                            the run's resolved config
    critic/                                PPO's critic the same way (model files + trainer_state.pt)
    manifest.json                          step, run id, and every file's size and sha256

Whole or absent: everything is written into `checkpoints/.tmp-step_000123-<pid>`, every file and
directory is fsynced, and only then is the directory renamed to `step_000123` (one atomic rename), so
a process killed at any moment leaves the earlier checkpoints and, at most, a `.tmp-*` directory that
is never read (and is removed by the next run in that output_dir). Old checkpoints are renamed away
before they are deleted, for the same reason; one renamed away to be replaced by a new copy of its step is put
back by the next run if the kill came before the new copy took its name.

Verified: a checkpoint is used only if its manifest is there and every file it lists has the recorded
size and sha256; `resume=auto` skips one that is not, with a warning naming it and why.

No code from a file: `trainer_state.pt` holds only tensors, numbers, strings, lists, tuples and dicts,
and is read with `torch.load(weights_only=True)`; weights are safetensors.

The data position is the step itself: a step's rollout prompts and sampling seed, and an SFT
step's conversations, are functions of (config, step), so nothing else needs saving. Under FSDP2
the full (unsharded) weights and optimizer state are gathered; every rank calls `save_checkpoint`
and rank 0 writes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from safetensors import SafetensorError
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

from treerl.errors import CheckpointError, TrainingStopped
from treerl.models import (
    ADAPTER_FILE,
    adapter_names,
    first_nonfinite,
    is_lora,
    model_names,
    read_weights,
    tied_names,
)
from treerl.trainer.core.config import yaml_problem
from treerl.trainer.core.loop_state import LoopState

log = logging.getLogger("treerl.trainer")

STATE_FILE = "trainer_state.pt"
MANIFEST = "manifest.json"
CONFIG_FILE = "config.yaml"
CRITIC_DIR = "critic"  # the critic's part of a checkpoint
FORMAT = 2  # manifest format; 1 was the unverified layout before manifests
_NAME = re.compile(r"^step_(\d+)$")
_TEMPORARY = (".tmp-", ".trash-")  # prefixes of directories being written or deleted


@dataclass
class Trainable:
    """A model with its optimizer and LR schedule: what one part of a checkpoint saves and restores."""

    model: PreTrainedModel
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler


# ---------------------------------------------------------------------------------------------- finding
def checkpoint_dir(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / "checkpoints" / f"step_{step:06d}"


def step_dirs(output_dir: str | Path) -> list[tuple[int, Path]]:
    """Every `checkpoints/step_N` directory under output_dir (complete or not), oldest first."""
    root = Path(output_dir) / "checkpoints"
    if not root.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in root.iterdir() if (m := _NAME.match(p.name)) and p.is_dir())


def verify_checkpoint(path: str | Path) -> dict[str, Any]:
    """The manifest of a complete checkpoint; a CheckpointError naming the checkpoint and what is wrong otherwise."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path}: {'not a directory' if path.exists() else 'does not exist'}")
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files, step = manifest["files"], int(manifest["step"])
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path}: no {MANIFEST} (an incomplete checkpoint, or not a treerl "
                              "checkpoint directory)") from None
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"checkpoint {path}: unreadable {MANIFEST} ({type(e).__name__}: {e})") from None
    if not isinstance(files, dict) or not all(isinstance(e, dict) and {"bytes", "sha256"} <= set(e)
                                              for e in files.values()):
        raise CheckpointError(f"checkpoint {path}: unreadable {MANIFEST} (files must map each path to its bytes "
                              "and sha256)")
    check_inside(path)
    for name, expected in files.items():
        file = inside(path, name)
        if not file.is_file():
            raise CheckpointError(f"checkpoint {path}: {name} is missing")
        size = file.stat().st_size
        if size != expected["bytes"]:
            raise CheckpointError(f"checkpoint {path}: {name} has {size} bytes, the manifest says {expected['bytes']}")
        if _sha256(file) != expected["sha256"]:
            raise CheckpointError(f"checkpoint {path}: {name} is corrupt (its sha256 differs from the manifest's)")
    if STATE_FILE not in files:
        raise CheckpointError(f"checkpoint {path}: the manifest lists no {STATE_FILE}")
    manifest["step"] = step
    return manifest


def inside(path: Path, name: str) -> Path:
    """The file a manifest entry names, which must lie inside the checkpoint: a relative path without `..`, not
    through a link that leads out (a crafted manifest must not make resume read or hash any other file)."""
    relative = Path(name)
    if relative.is_absolute() or ".." in relative.parts or not relative.parts:
        raise CheckpointError(f"checkpoint {path}: its {MANIFEST} names {name!r}, a path outside the checkpoint "
                              "(entries are relative paths inside it)")
    file = path / relative
    if not file.resolve().is_relative_to(path.resolve()):
        raise CheckpointError(f"checkpoint {path}: {name} is a link to {file.resolve()}, outside the checkpoint")
    return file


def check_inside(path: Path) -> None:
    """No file or folder of a checkpoint may be a link that leads out of it: loading it would read another file."""
    root = path.resolve()
    for folder, folders, names in os.walk(path):  # not into linked folders
        for item in (Path(folder) / name for name in folders + names):
            if item.is_symlink() and not item.resolve().is_relative_to(root):
                raise CheckpointError(f"checkpoint {path}: {item.relative_to(path)} is a link to {item.resolve()}, "
                                      "outside the checkpoint")


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest complete checkpoint under output_dir/checkpoints (newer broken ones are skipped with a warning)."""
    for _, path in reversed(step_dirs(output_dir)):
        try:
            verify_checkpoint(path)
        except CheckpointError as e:
            log.warning("skipping %s; resuming from an older checkpoint if there is one", e)
            continue
        return path
    return None


def find_resume_path(resume: str | None, output_dir: str | Path) -> Path | None:
    """`trainer.resume`: None (fresh start), "auto" (the newest complete checkpoint in output_dir, or none),
    or a checkpoint directory (verified)."""
    if resume is None:
        return None
    if resume == "auto":
        return latest_checkpoint(output_dir)
    try:
        verify_checkpoint(resume)
    except CheckpointError as e:
        raise CheckpointError(f"trainer.resume={resume!r}: {e}") from None
    return Path(resume)


def checkpoint_config(path: str | Path) -> dict[str, Any]:
    """The resolved config a checkpoint was written with, as nested dicts (empty if it has none)."""
    import yaml

    file = Path(path) / CONFIG_FILE
    if not file.is_file():
        return {}
    try:
        config = yaml.safe_load(file.read_text()) or {}  # safe: a !!python tag is refused, never constructed
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file}: not a readable config ({yaml_problem(e)}); a checkpoint's {CONFIG_FILE} holds "
                              "plain YAML values only") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{file}: expected a mapping of config sections, got {type(config).__name__}")
    return config


def read_manifest(path: str | Path) -> dict[str, Any]:
    """A checkpoint's manifest as written, unverified (empty if there is none or it is unreadable)."""
    try:
        manifest = json.loads((Path(path) / MANIFEST).read_text())
    except (OSError, ValueError):
        return {}
    return manifest if isinstance(manifest, dict) else {}


# ---------------------------------------------------------------------------------------------- RNG
def rng_states() -> dict[str, Any]:
    """Every generator's state as tensors and plain values (readable with weights_only=True)."""
    version, internal, gauss = random.getstate()
    kind, keys, position, has_gauss, cached = np.random.get_state()
    states: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), int(position), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    version, internal, gauss = states["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, position, has_gauss, cached = states["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), position, has_gauss, cached))
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


# ---------------------------------------------------------------------------------------------- saving
def save_checkpoint(
    path: Path,
    parts: dict[str, Trainable],
    tokenizer: PreTrainedTokenizerBase,
    step: int,
    loop_state: LoopState,
    config_yaml: str,
    run_id: str,
    is_main: bool,
) -> None:
    """Gather every part's full state (a collective under FSDP2: every rank calls this), check its weights are
    finite, and write the whole checkpoint atomically on rank 0. `parts`: "" (the policy) and optionally "critic"."""
    gathered = {}
    for name, part in parts.items():
        weights = full_weights(part.model)
        optimizer = get_optimizer_state_dict(part.model, part.optimizer,
                                             options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        gathered[name] = (part.model, weights, optimizer, part.scheduler.state_dict())
    problem = None
    if is_main:
        problem = next((f"{name or 'policy'} weight {bad}" for name, (_, weights, _, _) in gathered.items()
                        if (bad := first_nonfinite(weights))), None)
    problem = _from_main(problem)
    if problem is not None:
        raise TrainingStopped(f"not writing checkpoint {path}: the {problem} is NaN or inf (after {step} steps); "
                              "the newest checkpoint on disk is the last good one")
    if is_main:
        root = path.parent
        root.mkdir(parents=True, exist_ok=True)
        tmp = root / f"{_TEMPORARY[0]}{path.name}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        for name, (model, weights, optimizer, scheduler) in gathered.items():
            write_pretrained(tmp / name, model, weights, tokenizer)
            state = {"step": step, "optimizer": optimizer, "scheduler": scheduler}
            if not name:
                state |= {"rng": rng_states(), "loop": loop_state.to_dict()}
            torch.save(state, tmp / name / STATE_FILE)
        (tmp / CONFIG_FILE).write_text(config_yaml)
        manifest = {"format": FORMAT, "step": step, "run_id": run_id, "parts": sorted(gathered),
                    "files": _seal(tmp)}
        _write_synced(tmp / MANIFEST, json.dumps(manifest, indent=1) + "\n")
        _fsync_dir(tmp)
        _publish(tmp, path)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def full_weights(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """The full (unsharded) weights on CPU, only the adapters of a LoRA model (its base never changes); a
    collective under FSDP2, so every rank calls it."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                                ignore_frozen_params=is_lora(model)))


def write_pretrained(
    path: Path, model: PreTrainedModel, weights: dict[str, torch.Tensor], tokenizer: PreTrainedTokenizerBase,
    image_processor: Any = None,
) -> None:
    """A fresh transformers checkpoint directory (safetensors weights, config, tokenizer, and a vision-language
    model's `image_processor` config where given: a server processes images as it says) at `path`.

    The config and generation config get the tokenizer's eos/bos/pad ids where they have none, so that
    `generate` on the checkpoint stops at the end of a reply.
    """
    hf_logging.disable_progress_bar()  # no "Writing model shards" bar through the training progress bar
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    for config in (model.config, getattr(model, "generation_config", None)):
        for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
            if config is not None and getattr(config, key, None) is None and getattr(tokenizer, key) is not None:
                setattr(config, key, getattr(tokenizer, key))
    model.save_pretrained(path, state_dict=weights, safe_serialization=True)
    tokenizer.save_pretrained(path)
    if image_processor is not None:
        image_processor.save_pretrained(path)


def write_pretrained_atomically(
    path: Path, model: PreTrainedModel, weights: dict[str, torch.Tensor], tokenizer: PreTrainedTokenizerBase,
    image_processor: Any = None,
) -> None:
    """`write_pretrained` into a temporary sibling, then renamed to `path`: a reader (an inference server loading
    the new weights) never sees half of it. Not fsynced nor hashed: a crash loses nothing a checkpoint holds."""
    tmp = path.with_name(f"{_TEMPORARY[0]}{path.name}-{os.getpid()}")
    write_pretrained(tmp, model, weights, tokenizer, image_processor)
    _publish(tmp, path)


def _seal(root: Path) -> dict[str, dict[str, Any]]:
    """fsync every file and directory under `root`; each file's size and sha256, by relative path."""
    files = {}
    for folder, _, names in os.walk(root):
        for name in sorted(names):
            file = Path(folder) / name
            files[file.relative_to(root).as_posix()] = {"bytes": file.stat().st_size, "sha256": _sha256(file, sync=True)}
        _fsync_dir(Path(folder))
    return files


def _sha256(file: Path, sync: bool = False) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
        if sync:
            os.fsync(f.fileno())
    return digest.hexdigest()


def _write_synced(file: Path, text: str) -> None:
    with open(file, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _publish(tmp: Path, path: Path) -> None:
    """Rename a complete directory to its final name; a directory already there is renamed away, then deleted."""
    trash = path.with_name(f"{_TEMPORARY[1]}{path.name}-{os.getpid()}")
    if path.exists():
        os.replace(path, trash)
    os.replace(tmp, path)
    _fsync_dir(path.parent)
    shutil.rmtree(trash, ignore_errors=True)


def remove_leftovers(output_dir: str | Path) -> list[Path]:
    """Clear the `.tmp-*` / `.trash-*` directories a killed run left in output_dir/checkpoints; returns those deleted.

    A whole checkpoint renamed away to be replaced (`_publish`, killed before the new copy took its name) is put
    back under its name instead: a kill at any moment leaves the previous copy of a step."""
    root = Path(output_dir) / "checkpoints"
    found = [p for p in root.iterdir() if p.name.startswith(_TEMPORARY)] if root.is_dir() else []
    deleted = []
    for path in found:
        name = root / path.name.removeprefix(_TEMPORARY[1]).rpartition("-")[0]
        if path.name.startswith(_TEMPORARY[1]) and not name.exists() and _is_whole(path):
            os.replace(path, name)
            log.warning("put back %s, a checkpoint a killed run was replacing, as %s", path, name)
            continue
        shutil.rmtree(path, ignore_errors=True)
        deleted.append(path)
    return deleted


def _is_whole(path: Path) -> bool:
    try:
        verify_checkpoint(path)
    except CheckpointError:
        return False
    return True


def prune_checkpoints(output_dir: str | Path, keep: int, run_id: str) -> None:
    """Delete all but the `keep` newest checkpoints written by run `run_id` (keep = 0: keep all); a checkpoint of
    another run is never touched. Each is renamed away first, so a kill never leaves half of one."""
    if keep <= 0:
        return
    mine = [path for _, path in step_dirs(output_dir) if read_manifest(path).get("run_id") == run_id]
    for path in mine[:-keep]:
        trash = path.with_name(f"{_TEMPORARY[1]}{path.name}-{os.getpid()}")
        os.replace(path, trash)
        shutil.rmtree(trash, ignore_errors=True)


# ---------------------------------------------------------------------------------------------- loading
def load_checkpoint(path: Path, parts: dict[str, Trainable]) -> tuple[int, LoopState]:
    """Restore every part's weights, optimizer and schedule, and the RNG states, from a verified checkpoint
    (every rank reads it); returns (step, loop state)."""
    loop = LoopState()
    step = 0
    for name, part in parts.items():
        folder = path / name
        if not (folder / STATE_FILE).is_file():
            raise CheckpointError(f"checkpoint {path} has no {name}/ (it was not written by a run with a {name})")
        load_weights(folder, part.model)
        state = read_state(folder / STATE_FILE)
        try:
            set_optimizer_state_dict(part.model, part.optimizer, state["optimizer"],
                                     options=StateDictOptions(full_state_dict=True))
            part.scheduler.load_state_dict(state["scheduler"])
        except (KeyError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"checkpoint {folder}: its optimizer state does not fit this run's model "
                                  f"({type(e).__name__}: {e})") from None
        if not name:
            step, loop = int(state["step"]), LoopState.from_dict(state["loop"])
            set_rng_states(state["rng"])
    return step, loop


def load_weights(folder: Path, model: PreTrainedModel) -> None:
    """A checkpoint part's safetensors weights into `model` (sharded or not); every name and shape must fit."""
    if is_lora(model):
        return load_adapters(folder, model)
    weights = model_names(model, read_weights(folder))
    expected = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    for name, tensor in weights.items():
        if name in expected and tuple(expected[name].shape) != tuple(tensor.shape):
            raise CheckpointError(f"checkpoint {folder} does not fit the model: {name} has shape "
                                  f"{tuple(tensor.shape)}, the model's is {tuple(expected[name].shape)}")
    incompatible = set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True, strict=False))
    missing = set(incompatible.missing_keys) - tied_names(model)
    if missing or incompatible.unexpected_keys:
        raise CheckpointError(
            f"checkpoint {folder} does not fit the model: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(incompatible.unexpected_keys)[:5]}"
        )


def load_adapters(folder: Path, model: PreTrainedModel) -> None:
    """A LoRA checkpoint's adapters (peft's files) into `model`'s adapters (sharded or not); each must be there."""
    file = folder / ADAPTER_FILE
    if not file.is_file():
        raise CheckpointError(f"checkpoint {folder} has no {ADAPTER_FILE}: it was not written by a run with LoRA "
                              "(model.lora.rank > 0)")
    try:
        saved = load_file(file)
    except (OSError, SafetensorError) as e:
        raise CheckpointError(f"{file}: unreadable safetensors ({type(e).__name__}: {e})") from None
    names = adapter_names(model)
    trainable = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                                     ignore_frozen_params=True))
    if set(saved) != set(names) or any(tuple(saved[k].shape) != tuple(trainable[names[k]].shape) for k in saved):
        raise CheckpointError(f"checkpoint {folder}: its adapters do not fit the model's (different "
                              "model.lora settings or base model)")
    set_model_state_dict(model, {names[k]: v for k, v in saved.items()},
                         options=StateDictOptions(full_state_dict=True, strict=False))


def check_same_base(path: Path, saved: list[float] | None, current: list[float] | None, rtol: float = 1e-6) -> None:
    """A LoRA checkpoint's adapters only make sense on the base they were trained on: compare its fingerprint
    (treerl.models.base_fingerprint) with the base built now."""
    if saved is None or current is None:
        return
    same = len(saved) == len(current) and all(abs(a - b) <= rtol * max(abs(a), abs(b), 1.0)
                                              for a, b in zip(saved, current))
    if not same:
        raise CheckpointError(f"checkpoint {path}: its LoRA adapters were trained on another base model (the weights "
                              "at model.path changed, or model.shape / model.seed differ); load it with the base it "
                              "was trained on")


def read_state(file: Path) -> dict[str, Any]:
    """A trainer_state.pt, read without running code from it (weights_only: tensors and plain values only)."""
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 (truncated, not a torch file, or an object weights_only refuses)
        raise CheckpointError(f"{file}: not a readable trainer state ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''})") from None
    if not isinstance(state, dict) or not {"step", "optimizer", "scheduler"} <= set(state):
        raise CheckpointError(f"{file}: not a treerl trainer state (expected step, optimizer and scheduler)")
    return state


def _from_main(value: Any) -> Any:
    """Rank 0's `value` on every rank (identity in one process)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]

