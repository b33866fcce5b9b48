"""Models: a transformers causal LM from a local path, or a randomly initialised config of a real architecture.

Nothing here downloads weights: a path must exist on disk, and the built-in shapes (tiny ones for
tests and the CPU demo, real-size ones for GPU benchmarks) start from random weights.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, PreTrainedModel, Qwen2Config, Qwen3Config

ARCHITECTURES = {"qwen3": Qwen3Config, "qwen2": Qwen2Config, "llama": LlamaConfig}

# Named shapes: (architecture, overrides). "tiny" ones are for tests and the CPU demo.
SHAPES: dict[str, tuple[str, dict]] = {
    "tiny-qwen3": ("qwen3", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=16)),
    "tiny-qwen2": ("qwen2", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2)),
    "tiny-llama": ("llama", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2)),
    "small-qwen3": ("qwen3", dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
                                  num_key_value_heads=4, head_dim=32)),
    "qwen3-0.6b": ("qwen3", dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                                 tie_word_embeddings=True, rope_theta=1_000_000.0)),
}


def model_config(shape: str, vocab_size: int | None = None, max_positions: int = 32768):
    """The transformers config of a named shape (see SHAPES), random weights to be initialised from it."""
    if shape not in SHAPES:
        raise ValueError(f"unknown model shape {shape!r}; known: {', '.join(SHAPES)}")
    arch, overrides = SHAPES[shape]
    kwargs = dict(vocab_size=512, max_position_embeddings=max_positions, tie_word_embeddings=False)
    kwargs.update(overrides)
    if vocab_size is not None:
        kwargs["vocab_size"] = vocab_size
    return ARCHITECTURES[arch](**kwargs)


def build_model(
    path: str | None = None,
    shape: str = "tiny-qwen3",
    vocab_size: int | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
    attn_implementation: str = "sdpa",
    auto_class: type = AutoModelForCausalLM,
    overrides: dict | None = None,
) -> PreTrainedModel:
    """Load a model from a local `path`, or build shape `shape`; weights not in the checkpoint are seeded.

    `auto_class` and config `overrides` build other heads on the same body (the critic:
    AutoModelForTokenClassification with num_labels=1).
    """
    if path and not Path(path).exists():
        raise FileNotFoundError(f"model.path {path!r} does not exist (treerl never downloads weights)")
    config = load_config(path) if path else model_config(shape, vocab_size=vocab_size)
    config.update(overrides or {})
    config._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    if path:
        model = auto_class.from_pretrained(path, config=config, dtype=dtype, local_files_only=True)
    else:
        model = auto_class.from_config(config, dtype=dtype)
    return model.to(device)


def load_config(path: str) -> object:
    """The config of a local checkpoint, without its weights."""
    return AutoConfig.from_pretrained(path, local_files_only=True)
