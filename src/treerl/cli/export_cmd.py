"""`treerl export`: a checkpoint (LoRA adapters merged into their base) as a transformers model directory.

Beside the steps (docs/architecture.md): a checkpoint out, for a server or `from_pretrained`.
"""

from __future__ import annotations

from pathlib import Path

import typer

from treerl.trainer.core.export import export_checkpoint


def export(
    checkpoint: Path = typer.Argument(..., help="a checkpoint directory (output_dir/checkpoints/step_N)"),
    out: Path = typer.Argument(..., help="the model directory to write (must not exist, or be empty)"),
    dtype: str = typer.Option(None, help="cast the weights: float32, bfloat16, float16, float64 (default: as trained)"),
) -> None:
    """Write a checkpoint's policy as a plain transformers model: LoRA adapters are merged into the base."""
    path = export_checkpoint(checkpoint, out, dtype)
    typer.echo(f"wrote {path}: AutoModelForCausalLM.from_pretrained({str(path)!r}) loads it, as does any server that "
               "reads transformers checkpoints (vLLM, SGLang, treerl serve)")
