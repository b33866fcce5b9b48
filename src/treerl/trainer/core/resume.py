"""Where a run starts: a fresh output_dir or a checkpoint, and which settings may differ from the checkpoint's.

Before step 1 (docs/architecture.md): where the run starts.

    start = choose_start(config)                      # rank 0, before anything is written
    ...build the model and optimizer, load start.path...
    apply_hyperparameters(policy, config.trainer.lr, config.trainer)   # a changed lr, betas ... take effect

A run writes into `trainer.output_dir` only if it holds no run yet (none of OUTPUTS), if it resumes
the run there (`trainer.resume=auto`, or a checkpoint inside it), or if `trainer.overwrite=true`
(the old run's outputs are deleted first: by `delete_outputs`, once the new run has trained its first
step, so a run that fails while it sets up leaves the old one as it was). Other files in the directory
are never touched.

Resuming compares the new config with the checkpoint's: settings that define the model or the
objective (IMMUTABLE) must be equal, or the run is refused naming each difference; any other
difference (learning rate, steps, evaluation cadence, ...) takes the new value and is listed in one
log line. The optimizer's hyperparameters and the LR schedule are rebuilt from the new config, so a
new `trainer.lr` really is the learning rate from the next step on.
"""

from __future__ import annotations

import logging
import shutil
import uuid
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from treerl.algo import AlgoConfig
from treerl.errors import CheckpointError, UserError
from treerl.trainer.core.checkpoint import (
    Trainable,
    checkpoint_config,
    find_resume_path,
    read_manifest,
    remove_leftovers,
    step_dirs,
)
from treerl.trainer.core.config import Config, TrainerConfig, to_yaml

log = logging.getLogger("treerl.trainer")

OUTPUTS = ("checkpoints", "metrics.jsonl", "summary.json", "dropped.jsonl", "samples.jsonl", "tensorboard",
           "server_weights", "curves.png")
# What a checkpoint's weights and optimizer state only make sense with. ("algo.advantage" is compared resolved:
# it decides whether a critic is trained.)
IMMUTABLE = ("model.path", "model.shape", "model.tokenizer_path", "model.dtype", "algo.loss", "algo.advantage",
             "critic.path", "model.lora.rank", "model.lora.alpha", "model.lora.target_modules",
             "rollout.eval_fraction", "rollout.eval_data_path")  # the last two: which items are held out of training
NOT_SETTINGS = ("trainer.resume", "trainer.output_dir", "trainer.overwrite")  # where and how, not what


@dataclass(frozen=True)
class Start:
    """Where a run starts: a verified checkpoint (None: step 0), its step, and the run's id."""

    path: Path | None
    step: int
    run_id: str
    replaces: bool = False  # output_dir holds an earlier run's outputs that this run deletes before it writes


def choose_start(config: Config) -> Start:
    """Claim output_dir (checked to be one by `check_paths`) and pick the checkpoint to resume, refusing before anything
    is built or written."""
    trainer = config.trainer
    out = Path(trainer.output_dir)
    for leftover in remove_leftovers(out):
        log.warning("removed %s, an incomplete checkpoint left by a run that was killed while writing it", leftover)
    path = find_resume_path(trainer.resume, out)
    if path is None:
        return Start(None, 0, uuid.uuid4().hex[:12], replaces=claim_fresh(trainer))
    manifest = read_manifest(path)  # verified by find_resume_path
    step = int(manifest["step"])
    if trainer.steps <= step:
        raise UserError(f"trainer.steps={trainer.steps}, but checkpoint {path} has already done {step} steps: set "
                        f"trainer.steps above {step} to train on from it")
    changes = compare_with_checkpoint(config, checkpoint_config(path), path)
    another_run = out.resolve() not in path.resolve().parents and outputs_in(out)
    if another_run and not trainer.overwrite:
        raise UserError(f"trainer.output_dir={str(out)!r} already holds another run ({', '.join(another_run)}); "
                        f"to continue from {path} write to an empty output_dir, or replace that run with "
                        "trainer.overwrite=true")
    if changes:
        log.warning("resuming from %s with new values (they are used from now on): %s", path, "; ".join(changes))
    return Start(path, step, manifest.get("run_id") or uuid.uuid4().hex[:12], replaces=bool(another_run))


def claim_fresh(trainer: TrainerConfig) -> bool:
    """A run from step 0 may write into output_dir: it holds no run, or overwrite / resume=auto allows replacing it
    (returns True: the earlier run's outputs are to be deleted before this run writes)."""
    out = Path(trainer.output_dir)
    held = outputs_in(out)
    if not held:
        return False
    broken = [p.name for _, p in step_dirs(out)]
    if trainer.overwrite:
        log.warning("trainer.overwrite=true: the earlier run's %s in %s are deleted once this run has trained a step",
                    ", ".join(held), out)
    elif trainer.resume == "auto" and not broken:
        log.warning("trainer.resume=auto: %s holds no checkpoint (the earlier run saved none); starting from step 0 "
                    "and replacing its %s once this run has trained a step", out, ", ".join(held))
    elif trainer.resume == "auto":
        raise CheckpointError(f"trainer.resume=auto: no complete checkpoint in {out / 'checkpoints'} (broken: "
                              f"{', '.join(broken)}; see the warnings above); start afresh with trainer.overwrite=true")
    else:
        raise UserError(f"trainer.output_dir={str(out)!r} already holds a run ({', '.join(held)}): continue it with "
                        "trainer.resume=auto, or replace it with trainer.overwrite=true (or choose another output_dir)")
    return True


def outputs_in(out: Path) -> list[str]:
    """The outputs of a run that output_dir holds (OUTPUTS present in it)."""
    return [name for name in OUTPUTS if (out / name).exists()]


def delete_outputs(out: Path) -> None:
    for name in outputs_in(out):
        target = out / name
        if target.is_dir():
            shutil.rmtree(target)
        else:
            target.unlink()


def compare_with_checkpoint(config: Config, saved: dict[str, Any], path: Path) -> list[str]:
    """The settings that differ from the checkpoint's, as "key: old -> new"; a CheckpointError naming every
    IMMUTABLE one that differs."""
    now = flatten(_plain(config))
    before = flatten(saved)
    for key, current in (("algo.advantage", config.algo.resolved().advantage),):
        now[key] = current
        before[key] = _resolved_advantage(saved.get("algo", {}))
    differ = {key: (before[key], now[key]) for key in now
              if key in before and before[key] != now[key] and key not in NOT_SETTINGS}
    fixed = [f"{key}: {old!r} in the checkpoint, {new!r} now" for key, (old, new) in differ.items() if key in IMMUTABLE]
    if fixed:
        raise CheckpointError(f"cannot resume from {path}: {'; '.join(fixed)} (these must stay as the checkpoint was "
                              "trained; start a new run in another output_dir to change them)")
    return [f"{key}: {old!r} -> {new!r}" for key, (old, new) in differ.items()]


def apply_hyperparameters(part: Trainable, lr: float, trainer: TrainerConfig) -> None:
    """After loading a checkpoint: the optimizer's and schedule's hyperparameters from the new config (loading put
    back the checkpoint's), the current learning rate recomputed by the (new) schedule at the restored step."""
    scheduler, groups = part.scheduler, part.optimizer.param_groups
    for group in groups:
        group.update(betas=tuple(trainer.betas), eps=trainer.adam_eps, weight_decay=trainer.weight_decay,
                     initial_lr=lr)
    scheduler.base_lrs = [lr] * len(groups)
    rates = [base * factor(scheduler.last_epoch) for base, factor in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, rate in zip(groups, rates):
        group["lr"] = rate
    scheduler._last_lr = rates


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _plain(config: Config) -> dict[str, Any]:
    """The config as the checkpoint stores it (YAML types: lists, not tuples)."""
    import yaml

    return yaml.safe_load(to_yaml(config))


def _resolved_advantage(saved_algo: dict[str, Any]) -> str | None:
    known = {f.name for f in fields(AlgoConfig)}
    try:
        return AlgoConfig(**{k: v for k, v in saved_algo.items() if k in known}).resolved().advantage
    except (TypeError, ValueError):
        return saved_algo.get("advantage")
