"""The input embedding's gradient added by rows, not as a dense [vocab, d] tensor every backward call.

Step 5 (docs/architecture.md): what one DFS backward call costs besides its rows.

Autograd's backward of an embedding lookup builds a dense gradient of the whole table (zeros, then the rows
added), and a table tied to the LM head has that summed with the head's gradient before it reaches `.grad`:
three passes over vocab x d floats per backward call, whatever the call's rows. The DFS walk runs many calls
(under `memory="one-path"` one small node each), so on a model whose vocabulary is large against its nodes
(SmolLM2-135M: 49,152 x 576, a fifth of its weights) this was a third of a small call's time. Here the
lookup's output enters the graph as a leaf instead, and after each backward call its gradient rows are summed
by token (in float32 at least) and added to the table's `.grad` at those rows only. The result is the same gradient,
up to the order of a sum.

Only a plain `torch.nn.Embedding` whose backward is exactly that sum: its own class (a subclass may scale
or transform what it looks up), no `max_norm` (renormalises the table in the forward), no
`scale_grad_by_freq`, not sparse, a plain trainable tensor (not a sharded FSDP2 parameter, whose gradient
its own hooks reduce). Rows of `padding_idx` get no gradient, as in torch. Anything else keeps autograd's path.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from transformers import PreTrainedModel

from treerl.engine.head import GRAD_LOCK


def rows_apply(module: nn.Module) -> bool:
    """Whether this input embedding's gradient can be added by rows (see the module docstring)."""
    if type(module) is not nn.Embedding:
        return False
    weight = module.weight
    return (weight.requires_grad and module.max_norm is None and not module.scale_grad_by_freq
            and not module.sparse and type(weight.data) is torch.Tensor)


class EmbeddingRows:
    """While active: each lookup under grad is a leaf of the graph; `flush` adds the leaves' gradients by rows."""

    def __init__(self, model: PreTrainedModel):
        module = model.get_input_embeddings()
        self.module = module if rows_apply(module) else None
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # (token ids, the lookup's leaf)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Record lookups (no-op for an embedding autograd must handle)."""
        if self.module is None:
            yield
            return
        handle = self.module.register_forward_hook(self._hook)
        try:
            yield
        finally:
            handle.remove()
            self.pending.clear()

    def _hook(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
        """A lookup under grad: its output becomes a leaf whose gradient `flush` will add by rows."""
        if not torch.is_grad_enabled():
            return None
        leaf = output.detach().requires_grad_()
        self.pending.append((args[0], leaf))
        return leaf.clone()  # the model may edit what it looked up in place (CTRL scales it, GIT adds positions)

    def flush(self) -> None:
        """Add the gradient of every lookup a backward reached to the table's `.grad`, at its rows only.

        Lookups no backward has reached yet (a unit whose graph is kept while its descendants run) wait."""
        waiting = []
        for ids, leaf in self.pending:
            if leaf.grad is None:
                waiting.append((ids, leaf))
            else:
                self._add(ids.flatten(), leaf.grad.flatten(0, -2))
        self.pending = waiting

    def _add(self, ids: torch.Tensor, grad_rows: torch.Tensor) -> None:
        """Sum the rows by token in float32, then add each token's sum to `.grad` once."""
        weight = self.module.weight
        if self.module.padding_idx is not None:
            keep = ids != self.module.padding_idx
            ids, grad_rows = ids[keep], grad_rows[keep]
        tokens, where = torch.unique(ids, return_inverse=True)
        dtype = torch.promote_types(grad_rows.dtype, torch.float32)  # bf16 rows summed in float32, float64 as it is
        sums = torch.zeros(len(tokens), grad_rows.shape[-1], dtype=dtype, device=grad_rows.device)
        sums.index_add_(0, where, grad_rows.to(dtype))
        with GRAD_LOCK:  # two threads' backward passes (or the tied head's) add into the same .grad
            if weight.grad is None:
                weight.grad = torch.zeros_like(weight)
            weight.grad.index_add_(0, tokens, sums.to(weight.grad.dtype))
