"""`treerl export`: a checkpoint (LoRA adapters merged into their base) as a transformers model directory.

Beside the steps (docs/architecture.md): a checkpoint out, for a server or `from_pretrained`.
"""

from __future__ import annotations

from pathlib import Path

import typer

from treerl.errors import UserError
from treerl.models import SHAPES
from treerl.trainer.core.export import export_checkpoint, export_model, export_shape


def export(
    paths: list[Path] = typer.Argument(..., help="CHECKPOINT OUT: a checkpoint directory (output_dir/checkpoints/"
                                       "step_N), then the model directory to write (new, or empty); with --shape or "
                                       "--model-path, OUT alone", show_default=False),
    shape: str = typer.Option(None, help=f"write this random-init shape instead of a checkpoint ({', '.join(SHAPES)})"),
    model_path: str = typer.Option(None, "--model-path", help="write this model instead of a checkpoint: a GGUF file "
                                   "(dequantized), a directory of them, or a packaged model (smollm2-135m-instruct, "
                                   "gemma3-270m)"),
    gguf_file: str = typer.Option(None, "--gguf-file", help="--model-path holds several GGUF files: this one"),
    seed: int = typer.Option(0, help="with --shape: the seed of its random weights"),
    dtype: str = typer.Option(None, help="cast the weights: float32, bfloat16, float16, float64 (default: as trained)"),
) -> None:
    """Write a checkpoint's policy as a plain transformers model: LoRA adapters are merged into the base. With
    --shape, a named random-init shape and the built-in tokenizer (a model to try a server setup with); with
    --model-path, a GGUF model dequantized (a checkpoint any server loads)."""
    if shape is not None and model_path is not None:
        raise UserError("--shape and --model-path each name the model to write: give one")
    if len(paths) != (1 if shape or model_path else 2):
        raise UserError("treerl export CHECKPOINT OUT, or treerl export --shape SHAPE OUT, or treerl export "
                        "--model-path MODEL OUT")
    if shape is not None and shape not in SHAPES:
        raise UserError(f"--shape {shape!r}: not one of {', '.join(SHAPES)}")
    if shape:
        path = export_shape(shape, paths[0], dtype, seed)
    elif model_path:
        path = export_model(model_path, gguf_file, paths[0], dtype)
    else:
        path = export_checkpoint(paths[0], paths[1], dtype)
    typer.echo(f"wrote {path}: AutoModelForCausalLM.from_pretrained({str(path)!r}) loads it, as does any server that "
               "reads transformers checkpoints (vLLM, SGLang, treerl serve)")
