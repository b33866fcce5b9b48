"""Helpers shared by the tests: tiny random-init models of real architectures, in float64."""

from __future__ import annotations

import types

import torch

from treerl.models import build_model

ARCHS = ["tiny-qwen3", "tiny-qwen2", "tiny-llama"]
_MODELS: dict[tuple, torch.nn.Module] = {}


def _rms_norm_in_input_dtype(self, x: torch.Tensor) -> torch.Tensor:
    variance = x.pow(2).mean(-1, keepdim=True)
    return self.weight * (x * torch.rsqrt(variance + self.variance_epsilon))


def tiny_model(shape: str = "tiny-qwen3", vocab_size: int = 64, exact: bool = True):
    """A cached float64 model; tests must leave its parameters and .grad as they found them.

    `exact`: transformers' RMSNorm rounds to float32 even in a float64 model, which puts a ~1e-7
    noise floor under every comparison; exact models keep the norm in float64 so that any real
    difference between engines stands out. `exact=False` is the stock model.
    """
    key = (shape, vocab_size, exact)
    if key not in _MODELS:
        model = build_model(shape=shape, vocab_size=vocab_size, dtype=torch.float64, seed=0)
        if exact:
            for module in model.modules():
                if type(module).__name__.endswith("RMSNorm"):
                    module.forward = types.MethodType(_rms_norm_in_input_dtype, module)
        _MODELS[key] = model
    return _MODELS[key]
