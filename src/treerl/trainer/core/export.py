"""`treerl export`: a checkpoint as a plain transformers model directory, for a server or `from_pretrained`.

Beside the steps (docs/architecture.md): a checkpoint out, for a server or `from_pretrained`.

`--shape` writes a named random-init shape instead (`treerl.models.SHAPES`, with the built-in
tokenizer): a model directory to try a server setup with before bringing a real checkpoint.

A LoRA checkpoint holds only the adapters. Export rebuilds the base the run trained on (the
checkpoint's `model.path`, or `model.shape` with `model.seed`), checks that it is that base (the
fingerprint the run saved), loads the adapters and merges them into the base weights (peft's
`merge_and_unload`). A full checkpoint is written again, without its trainer state.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from treerl.errors import UserError
from treerl.gguf_checkpoint import local_checkpoint
from treerl.models import DTYPES, base_fingerprint, is_lora
from treerl.rollout.conversations.images import image_processor
from treerl.trainer.core.build import load_policy
from treerl.trainer.core.checkpoint import (
    CONFIG_FILE,
    STATE_FILE,
    check_same_base,
    load_weights,
    read_state,
    verify_checkpoint,
    write_pretrained_atomically,
)
from treerl.trainer.core.config import ModelConfig, load_config
from treerl.trainer.core.inputs import check_writable_dir
from treerl.trainer.core.loop_state import LoopState


def export_checkpoint(checkpoint: str | Path, out: str | Path, dtype: str | None = None) -> Path:
    """Write the policy of `checkpoint` (adapters merged) to the new directory `out`, in `dtype` (default: as trained)."""
    out = Path(out)
    check_out(out, dtype)
    model, tokenizer = checkpoint_policy(checkpoint)
    return write_model(model, tokenizer, out, dtype)


def checkpoint_policy(checkpoint: str | Path, device: torch.device | None = None
                      ) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The policy a checkpoint holds (verified; LoRA adapters merged into the base they were trained on) and its
    tokenizer, built as the run built it (its own config: base model, dtype, LoRA)."""
    path = Path(checkpoint)
    verify_checkpoint(path)
    config = load_config(path / CONFIG_FILE)  # the run's own settings: its base model, dtype and LoRA
    model, tokenizer = load_policy(config.model, device or torch.device("cpu"))
    if is_lora(model):
        saved = LoopState.from_dict(read_state(path / STATE_FILE).get("loop", {}))
        check_same_base(path, saved.lora_base, base_fingerprint(model))
        load_weights(path, model)
        model = model.merge_and_unload()
    else:
        load_weights(path, model)
    return model, tokenizer


def export_shape(shape: str, out: str | Path, dtype: str | None = None, seed: int = 0) -> Path:
    """Write the random-init shape `shape` (seeded, with the built-in tokenizer) to the new directory `out`."""
    out = Path(out)
    check_out(out, dtype)
    model, tokenizer = load_policy(ModelConfig(shape=shape, seed=seed), torch.device("cpu"))
    images = image_processor(model.config)  # a vision-language shape's: a server processes its images as it says
    return write_model(model, tokenizer, out, dtype, images.processor if images is not None else None)


def export_model(path: str, gguf_file: str | None, out: str | Path, dtype: str | None = None) -> Path:
    """Write the model at `path` (a GGUF file or a packaged model: dequantized) to the new directory `out`."""
    out = Path(out)
    check_out(out, dtype)
    source = local_checkpoint(path, gguf_file, "--model-path", "--gguf-file")
    model, tokenizer = load_policy(ModelConfig(path=source), torch.device("cpu"))
    return write_model(model, tokenizer, out, dtype)


def check_out(out: Path, dtype: str | None) -> None:
    """Refuse, before anything is built, a dtype export does not know or an output that holds something or cannot be
    written (a model loaded for 11 s, then a PermissionError)."""
    if dtype is not None and dtype not in DTYPES:
        raise UserError(f"--dtype {dtype}: not one of {', '.join(DTYPES)}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"{out} already exists and is not an empty directory; export writes a new one")
    check_writable_dir(out, "OUT")


def write_model(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, out: Path, dtype: str | None,
                image_processor: Any = None) -> Path:
    """`model` (in `dtype`, if given), `tokenizer` (and `image_processor`) as a transformers model directory, complete
    or absent."""
    model.eval()
    if dtype is not None:
        model = model.to(getattr(torch, dtype))
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.exists():
        out.rmdir()  # empty (checked above): the atomic rename puts the complete directory there
    write_pretrained_atomically(out, model, model.state_dict(), tokenizer, image_processor)
    return out
