"""`treerl serve`: a model behind an OpenAI-compatible completions API with token ids and log-probs."""

from __future__ import annotations

import typer

DTYPES = ("float32", "bfloat16", "float16", "float64")


def serve(
    model_path: str = typer.Option(None, "--model-path", help="local checkpoint (default: random-init --shape)"),
    shape: str = typer.Option("tiny-qwen3", help="model shape when no --model-path (see treerl.models.SHAPES)"),
    tokenizer_path: str = typer.Option(
        None, "--tokenizer", help="local tokenizer (default: --model-path's, or the built-in character tokenizer)"
    ),
    host: str = typer.Option("127.0.0.1", help="address to listen on"),
    port: int = typer.Option(8000, help="port to listen on"),
    dtype: str = typer.Option("float32", help=f"model dtype: {', '.join(DTYPES)}"),
    device: str = typer.Option("cpu", help="torch device"),
    seed: int = typer.Option(0, help="seed of the random-init weights"),
    served_model_name: str = typer.Option("default", help="the model name clients send"),
) -> None:
    """Serve the embedded sampling engine with vLLM's /v1/completions API (tokens + behaviour log-probs)."""
    import torch

    from treerl.models import build_model
    from treerl.rollout.embedded import EmbeddedEngine
    from treerl.rollout.server import run_server
    from treerl.rollout.tokenizer import load_tokenizer

    if dtype not in DTYPES:
        raise typer.BadParameter(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    tokenizer = load_tokenizer(tokenizer_path or model_path)
    model = build_model(
        path=model_path, shape=shape, vocab_size=None if model_path else len(tokenizer),
        dtype=getattr(torch, dtype), device=device, seed=seed,
    )
    typer.echo(f"treerl serve: {model_path or shape} on http://{host}:{port}/v1 as {served_model_name!r}")
    run_server(EmbeddedEngine(model), tokenizer, host=host, port=port, model_name=served_model_name)
