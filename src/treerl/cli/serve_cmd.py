"""`treerl serve`: a model behind an OpenAI-compatible completions API with token ids and log-probs.

Beside the steps (docs/architecture.md): step 1's sampling served to other processes.
"""

from __future__ import annotations

import ipaddress

import typer

from treerl.cli.options import check_positive
from treerl.errors import UserError
from treerl.models import DTYPES
from treerl.rollout.sampling.client import API_KEY_ENV
from treerl.rollout.sampling.prefix_cache import DEFAULT_TOKENS
from treerl.rollout.serving.server import PROTOCOLS


def serve(
    model_path: str = typer.Option(None, "--model-path", help="local checkpoint, GGUF file or packaged model "
                                   "(smollm2-135m-instruct, gemma3-270m) (default: random-init --shape)"),
    gguf_file: str = typer.Option(None, "--gguf-file", help="--model-path holds several GGUF files: this one"),
    shape: str = typer.Option("tiny-qwen3", help="model shape when no --model-path (see treerl.models.SHAPES)"),
    tokenizer_path: str = typer.Option(
        None, "--tokenizer", help="local tokenizer (default: --model-path's, or the built-in character tokenizer)"
    ),
    host: str = typer.Option("127.0.0.1", help="address to listen on (other than loopback: --api-key is required)"),
    port: int = typer.Option(8000, help="port to listen on"),
    api_key: str = typer.Option(
        None, "--api-key", envvar=API_KEY_ENV, show_default=False,
        help=f"clients must send 'Authorization: Bearer KEY' (or set {API_KEY_ENV}); without it, on loopback only, "
             "anyone on this machine may call every endpoint, /update_weights_from_disk included",
    ),
    max_n: int = typer.Option(64, help="most samples per prompt ('n') a request may ask for"),
    max_tokens: int = typer.Option(4096, help="most tokens per sample ('max_tokens') a request may ask for"),
    max_prompts: int = typer.Option(256, help="most prompts in one request"),
    request_timeout: float = typer.Option(600.0, help="seconds a generation may run before it is stopped (504)"),
    dtype: str = typer.Option("float32", help=f"model dtype: {', '.join(DTYPES)}"),
    device: str = typer.Option("cpu", help="torch device"),
    seed: int = typer.Option(0, help="seed of the random-init weights"),
    served_model_name: str = typer.Option("default", help="the model name clients send"),
    trust_remote_code: bool = typer.Option(False, help="run Python code shipped with --model-path (auto_map)"),
    prefix_cache_tokens: int = typer.Option(DEFAULT_TOKENS, help="tokens of computed prefixes whose K/V the server "
                                            "keeps across requests (a conversation's next turn prefills only its "
                                            "new tokens; emptied when weights are loaded); 0: none"),
    protocol: str = typer.Option("vllm", help="the server it imitates: vllm (0.32: /v1/completions, "
                                 "/inference/v1/generate, its RL routes) or sglang (0.5.23: /generate and its routes)"),
) -> None:
    """Serve the embedded sampler with the HTTP protocol of vLLM or SGLang (tokens + behaviour log-probs).

    On loopback (the default host) no API key is needed unless --api-key / TREERL_API_KEY sets one; on any
    other address one is required. SIGTERM or Ctrl-C stops generations in progress and exits.
    """
    import torch

    from treerl.gguf_checkpoint import local_checkpoint
    from treerl.models import build_model, check_device, check_model_dir
    from treerl.rollout.conversations.tokenizer import load_tokenizer
    from treerl.rollout.sampling.embedded import EmbeddedSampler
    from treerl.rollout.serving.server import Guard, run_server

    if protocol not in PROTOCOLS:
        raise UserError(f"--protocol must be one of {', '.join(PROTOCOLS)}, got {protocol!r}")
    if dtype not in DTYPES:
        raise typer.BadParameter(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if not api_key and not is_loopback(host):
        raise UserError(f"--host {host} is reachable from other machines: set --api-key (or {API_KEY_ENV}) so that "
                        "only your clients can sample and load weights")
    check_positive({"--max-n": max_n, "--max-tokens": max_tokens, "--max-prompts": max_prompts,
                    "--request-timeout": request_timeout})
    if prefix_cache_tokens < 0:
        raise UserError(f"--prefix-cache-tokens={prefix_cache_tokens} must be >= 0 (0: no cache)")
    if not 1 <= port <= 65535:
        raise UserError(f"--port={port} must be a TCP port, 1 to 65535")
    device = str(check_device(device, "--device"))
    if model_path is not None:
        model_path = local_checkpoint(model_path, gguf_file, "--model-path", "--gguf-file")
        check_model_dir(model_path, "--model-path")
    tokenizer = load_tokenizer(tokenizer_path or model_path, trust_remote_code=trust_remote_code)
    model = build_model(
        path=model_path, shape=shape, vocab_size=None if model_path else len(tokenizer),
        dtype=getattr(torch, dtype), device=device, seed=seed, trust_remote_code=trust_remote_code,
    )
    guard = Guard(api_key=api_key or None, max_n=max_n, max_tokens=max_tokens, max_prompts=max_prompts,
                  request_timeout=request_timeout)
    access = "API key required" if guard.api_key else "no API key (loopback only)"
    typer.echo(f"treerl serve: {model_path or shape} on http://{host}:{port} as {served_model_name!r}, {protocol} "
               f"protocol; {access}")
    run_server(EmbeddedSampler(model, prefix_cache_tokens=prefix_cache_tokens), tokenizer, host=host, port=port,
               model_name=served_model_name, guard=guard, protocol=protocol)


def is_loopback(host: str) -> bool:
    """Only this machine can connect to `host` (localhost, 127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
