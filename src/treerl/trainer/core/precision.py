"""`trainer.precision`: what the parameters are stored in and what the model computes in.

Steps 5 and 6 (docs/architecture.md): the dtypes they run in.

| precision    | parameters, AdamW state, gradients | compute                                   |
| ------------ | ---------------------------------- | ----------------------------------------- |
| `fp32`       | float32 (float64 if model.dtype=float64) | the parameters' dtype                |
| `bf16-mixed` | float32 (the master weights)       | bfloat16 matmuls (autocast), float32 rest  |
| `bf16`       | bfloat16                           | bfloat16                                  |

Under `bf16-mixed` every engine call (forward, forward_backward, the no-grad fills of old,
proximal and reference log-probs and of a critic's values) and the embedded sampler run under
`torch.autocast(bfloat16)` (`treerl.engine.AutocastEngine`), so behaviour and training log-probs
are one function. With FSDP2 the all-gathered parameters are bfloat16 as well
(`MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`): half the memory and traffic
of gathering float32, gradients reduced and accumulated in float32 (see treerl.distributed.parallel).
Names follow Lightning (`bf16-mixed`, `bf16-true`, `32-true`), which are accepted as aliases.
"""

from __future__ import annotations

import torch

PRECISIONS = ("fp32", "bf16-mixed", "bf16")
ALIASES = {"32": "fp32", "32-true": "fp32", "float32": "fp32", "bf16-true": "bf16", "bfloat16": "bf16",
           "bf16_mixed": "bf16-mixed"}
# precision -> the parameter dtypes it allows (model.dtype); the first is its default
PARAMETER_DTYPES = {"fp32": ("float32", "float64"), "bf16-mixed": ("float32",), "bf16": ("bfloat16",)}


def canonical(precision: str) -> str:
    """The precision's own name (aliases resolved); a ValueError naming the known ones otherwise."""
    name = ALIASES.get(precision, precision)
    if name not in PRECISIONS:
        raise ValueError(f"trainer.precision={precision!r} is not one of: {', '.join(PRECISIONS)} "
                         f"(aliases: {', '.join(ALIASES)})")
    return name


def parameter_dtype(precision: str, model_dtype: str | None) -> str:
    """The dtype parameters are stored in: model.dtype if set and allowed, else the precision's default."""
    allowed = PARAMETER_DTYPES[precision]
    if model_dtype is None:
        return allowed[0]
    if model_dtype not in allowed:
        fix = {"bfloat16": "trainer.precision=bf16 (pure bfloat16) or bf16-mixed (bfloat16 compute on float32 master "
                           "weights)",
               "float16": "trainer.precision=bf16-mixed (float16 training needs loss scaling, which treerl does not do)",
               }.get(model_dtype, "model.dtype=float32, or leave model.dtype unset")
        raise ValueError(f"model.dtype={model_dtype} does not go with trainer.precision={precision}, which keeps the "
                         f"parameters in {' or '.join(allowed)}; use {fix}")
    return model_dtype


def autocast_dtype(precision: str) -> torch.dtype | None:
    """The dtype engines and the sampler compute in under autocast; None: no autocast."""
    return torch.bfloat16 if precision == "bf16-mixed" else None
