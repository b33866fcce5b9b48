"""The per-token outputs of a DFS walk, the losses read from them, and the gradients the losses send back.

Step 5 (docs/architecture.md): the DFS walk's outputs, losses and their gradients.

Each token's outputs (log-probs, entropy, values) land, as plain values, in its *slot* of a flat
per-tree buffer (treerl.engine.base.OutputSlots) when the unit that computes them runs. When the
last node of a sequence has run, all its outputs are known: its loss is evaluated on a gather of
its slots (as leaf tensors) and d(loss)/d(output) is added to a gradient buffer of the same slots,
which each unit's backward reads on the way back up. The walk's traversal (treerl.engine.dfs)
knows nothing of losses; this module knows nothing of the model.
"""

from __future__ import annotations

import torch

from treerl.engine.base import LossFn, OutputSlots, StepStats, sum_losses
from treerl.tree import PrefixTree


class WalkOutputs:
    """Output slots and their gradients, the step's summed loss and stats, and which nodes a loss reads."""

    def __init__(self, tree: PrefixTree, names: tuple[str, ...], slots: OutputSlots, dtype: torch.dtype,
                 device: torch.device, loss_fn: LossFn | None):
        self.tree, self.loss_fn = tree, loss_fn
        self.values = {name: torch.zeros(slots.total, dtype=dtype, device=device) for name in names}
        self.grads = {name: torch.zeros_like(v) for name, v in self.values.items()} if loss_fn is not None else {}
        self.stats = StepStats(sequences=len(tree.sequences), flat_tokens=sum(len(s) for s in tree.sequences))
        self.total_loss = torch.zeros((), dtype=torch.float64, device=device)
        self.needs_backward: set[int] = set()  # nodes on the path of a loss that depends on the outputs

    def record(self, slots: torch.Tensor, outputs: dict[str, torch.Tensor]) -> None:
        """Write a unit's outputs (detached) into their slots."""
        for name, out in outputs.items():
            self.values[name].index_copy_(0, slots, out.detach().to(self.values[name].dtype))

    def known(self, slots: torch.Tensor) -> dict[str, torch.Tensor]:
        """The outputs recorded in these slots (a recomputed unit's, for `Head.replay`)."""
        return {name: v[slots] for name, v in self.values.items()}

    def evaluate(self, ends: list[int], end_slots: torch.Tensor) -> None:
        """Evaluate the losses of the sequences `ends` (all their outputs are known); add d(loss)/d(outputs)."""
        leaves = {name: v[end_slots].requires_grad_() for name, v in self.values.items()}
        views, offset = [], 0
        for s in ends:
            n = len(self.tree.sequences[s])
            views.append((s, self.tree.sequences[s], {name: t[offset : offset + n] for name, t in leaves.items()}))
            offset += n
        total = sum_losses(views, self.loss_fn, self.stats)
        self.total_loss += total.detach().to(self.total_loss.dtype)
        if not total.requires_grad:
            return
        self.needs_backward.update(i for s in ends for i in self.tree.path(s))
        names = list(leaves)
        grads = torch.autograd.grad(total, [leaves[name] for name in names], allow_unused=True)
        for name, g in zip(names, grads):
            if g is not None:
                self.grads[name].index_add_(0, end_slots, g.to(self.grads[name].dtype))

    def output_grads(self, outputs: dict[str, torch.Tensor], slots: torch.Tensor) -> tuple[list, list]:
        """The unit's outputs that carry a graph, and the loss gradients of their slots."""
        tensors, grads = [], []
        for name, out in outputs.items():
            if out.requires_grad:
                tensors.append(out)
                grads.append(self.grads[name][slots].to(out.dtype))
        return tensors, grads

    def per_sequence(self, all_slots: torch.Tensor) -> list[dict[str, torch.Tensor]]:
        """Every sequence's outputs, gathered from the slots (`all_slots`: every sequence's, one after another)."""
        lengths = [len(s) for s in self.tree.sequences]
        gathered = {name: v[all_slots].split(lengths) for name, v in self.values.items()}
        return [{name: parts[i] for name, parts in gathered.items()} for i in range(len(lengths))]
