"""Mixed precision for any engine: every call of the wrapped engine runs under `torch.autocast`.

Step 5 (docs/architecture.md), under autocast.

    engine = AutocastEngine(DfsEngine(), torch.bfloat16)   # float32 parameters, bfloat16 compute
    engine.forward_backward(model, batch, loss_fn)         # gradients land in float32 .grad

Under autocast the model's linear layers and attention compute in the autocast dtype from float32
parameters (the master weights), the rest (norms, residual stream, softmax of the log-probs) in
float32; gradients arrive in the parameters' dtype. The tree engines route attention and the LM
head through their own kernels, which follow autocast: the attention gets q, k, v in its dtype
(`treerl.attention.dispatch.common_dtype`) and the head runs its matmuls in it
(`treerl.engine.head.compute_dtype`). Wrapping the engine, not each call site, puts the forward,
`forward_backward` (whose recomputation happens on the way back up) and every no-grad fill
(old, proximal and reference log-probs, a critic's values) under the same autocast.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from treerl.engine.base import Engine, LossFn, StepStats
from treerl.tree import TokenSequence


@contextlib.contextmanager
def autocast(model: torch.nn.Module, dtype: torch.dtype | None) -> Iterator[None]:
    """`torch.autocast(dtype)` on the device of `model`'s parameters; nothing when `dtype` is None."""
    if dtype is None:
        yield
        return
    device = next(model.parameters()).device.type
    with torch.autocast(device, dtype=dtype):
        yield


@dataclass
class AutocastEngine:
    """`engine` with every call under `torch.autocast(dtype)`: bf16-mixed training on float32 parameters."""

    engine: Engine
    dtype: torch.dtype = torch.bfloat16

    def forward(self, model: PreTrainedModel, sequences: Sequence[TokenSequence]) -> list[dict[str, torch.Tensor]]:
        with autocast(model, self.dtype):
            return self.engine.forward(model, sequences)

    def forward_backward(self, model: PreTrainedModel, sequences: Sequence[TokenSequence], loss_fn: LossFn) -> StepStats:
        with autocast(model, self.dtype):
            return self.engine.forward_backward(model, sequences, loss_fn)
